"""
One rank of a data-parallel run for tests/test_distributed.py, launched with `torch.distributed.run`: stock TRL or
ours on the tiny float64 workload, same seed and data; writes this rank's metrics, completions and token counts to
`<out>/<method>_rank<r>.json`.

    python -m torch.distributed.run --nproc_per_node 2 tests/dp_worker.py --method ours --out /tmp/dp ...
"""

import argparse
import json
import os
import sys
import warnings
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import trl  # noqa: E402

from rloo_efficient import RLOOTrainer  # noqa: E402
from rloo_efficient.core.generation.generate import unique_rows  # noqa: E402
from rloo_efficient.core.generation.tree_prefill import plan_tree_prefill  # noqa: E402
from rloo_efficient.demo.workload import build_dataset, build_model_dir, build_tokenizer, vowel_reward  # noqa: E402
from tests.conftest import METRICS, tiny_workload, training_args  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=["stock", "ours"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model_cache", required=True)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--steps_per_generation", type=int, default=2)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])

    cfg = tiny_workload(args.model_cache)
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    # use_cpu: without it, transformers runs each CPU process on its own instead of in a gloo process group
    settings = dict(num_generations=args.num_generations, per_device_train_batch_size=args.per_device_train_batch_size,
                    steps_per_generation=args.steps_per_generation, max_steps=3, optim="sgd", learning_rate=1e-1,
                    use_cpu=True)  # fmt: skip
    config_class = trl.RLOOConfig if args.method == "stock" else None
    training = training_args(Path(args.out) / args.method, **({"config_class": config_class} if config_class else {}),
                             **settings)  # fmt: skip
    trainer_class = trl.RLOOTrainer if args.method == "stock" else RLOOTrainer
    trainer = trainer_class(model=path, reward_funcs=vowel_reward, args=training, train_dataset=dataset,
                            processing_class=build_tokenizer())  # fmt: skip

    # Each call of generation on this rank: how many distinct prompts, rows, how wide the padded prompt batch, and the
    # prompt tokens a shared prefill forwards: the prompts' prefix tree where it saves tokens, else each distinct
    # prompt padded, where prompts repeat
    generations = []
    generate = trainer._generate_single_turn

    def recorded(prompt_ids, images, multimodal_fields):
        first, inverse = unique_rows(prompt_ids)
        width = max(map(len, prompt_ids))
        plan = plan_tree_prefill(prompt_ids, first, width)
        prefill = plan.tree.num_tokens if plan else len(first) * (width - 1) if len(first) < len(inverse) else 0
        generations.append((len(first), len(prompt_ids), width, prefill))
        return generate(prompt_ids, images, multimodal_fields)

    trainer._generate_single_turn = recorded
    trainer.train()
    # Leave the process group (TRL's Trainer does not); the exit below is what avoids the abort at teardown
    trainer.accelerator.end_training()
    result = {
        "rank": rank,
        "world_size": trainer.accelerator.num_processes,
        "metrics": [{k: e.get(k) for k in METRICS} for e in trainer.state.log_history if "loss" in e],
        "completions": list(trainer._logs["completion"]),
        "generations": generations,
        "shared_prefill_tokens": getattr(trainer, "shared_prefill_tokens", None),
        "packed_forward_tokens": getattr(trainer, "packed_forward_tokens", None),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.method}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    # Results written, process group left: skip the interpreter's teardown, where a thread left behind in the CPU
    # (gloo) processes aborts one run in about seven ("terminate called without an active exception", torch 2.13)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
