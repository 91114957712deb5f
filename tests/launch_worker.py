"""
One rank of tests/test_launchers.py, started by `accelerate launch --config_file <config> --num_processes 2`: runs
each training in `--runs` (a JSON list) one after the other in this process, stock TRL or ours, on the tiny float32
workload (models pre-built by the test), and writes this rank's metrics, completions and sharing counters to
`<out>/<name>_rank<r>.json`.

A run: {"name", "method": "stock"|"ours", "num_generations", "per_device_train_batch_size",
"gradient_accumulation_steps", "reward": "rule"|"separate"|"hydra", "images": bool, and for ours optionally
"held_prefix_budget_gib"}; with "images", the workload is a tiny Qwen2-VL checkpoint with its processor and an image per
prompt, scored by a rule on the completion's tokens.
"""

import argparse
import functools
import hashlib
import json
import os
import sys
import warnings
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import trl  # noqa: E402

from rloo_efficient import RLOOTrainer  # noqa: E402
from rloo_efficient.trainers.ranks import Ranks  # noqa: E402
from rloo_efficient.demo.workload import (  # noqa: E402  # noqa: E402
    build_dataset,
    build_model_dir,
    build_processing_class,
    build_reward_adapter_dir,  # noqa: E402
    build_reward_model_dir,
    build_tokenizer,
    vowel_reward,
)
from tests.conftest import METRICS, per_micro_batch, tiny_workload, training_args  # noqa: E402


def launcher_workload(model_cache, images: bool = False):
    # float32: DeepSpeed keeps float32 weights whatever the checkpoint holds (float64 does not survive ZeRO)
    if images:  # 8 prompts, each with its own 8x8 or 16x8 image
        return tiny_workload(model_cache, model_dtype="float32", arch="qwen2_vl", image_size=8, num_prompts=8)
    return tiny_workload(model_cache, model_dtype="float32")


def token_reward(completion_ids, **kwargs):  # varies within every group (the vowel rule can be all 0 on images)
    return [float(sum(ids) % 17) for ids in completion_ids]


def train(run: dict, out: Path, model_cache: str) -> dict:
    images = run.get("images", False)
    cfg = launcher_workload(model_cache, images)
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    reward, extra = (token_reward if images else vowel_reward), {}
    if run["reward"] == "separate":
        reward = [vowel_reward, build_reward_model_dir(cfg)]
    elif run["reward"] == "hydra":
        from peft import LoraConfig

        reward = [vowel_reward, build_reward_adapter_dir(cfg, rank=4)]
        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    stock = run["method"] == "stock"
    # use_cpu: without it, transformers runs each CPU process on its own instead of in a gloo process group
    settings = dict(num_generations=run["num_generations"], per_device_train_batch_size=run["per_device_train_batch_size"],
                    gradient_accumulation_steps=run["gradient_accumulation_steps"], steps_per_generation=None,
                    max_steps=3, optim="sgd", learning_rate=1e-1, use_cpu=True, model_init_kwargs=None,
                    **({"config_class": trl.RLOOConfig} if stock else {}))  # fmt: skip
    if not stock and "held_prefix_budget_gib" in run:
        settings["held_prefix_budget_gib"] = run["held_prefix_budget_gib"]
    args = training_args(out / run["name"], **settings)
    # Whether the processes' plans of held prompts agreed, per plan where they must (forwards are collective):
    # [training (else a no-grad pass), agreed]. Ours' every agreement across processes goes through Ranks.agree,
    # wrapped before the trainer binds it in its parts
    agreed, agree = [], Ranks.agree

    def recorded_agree(ranks, values):
        outcome = agree(ranks, values)
        if ranks.collective():  # (elsewhere each process plans alone: True, however many plans it makes)
            agreed.append([torch.is_grad_enabled(), outcome])
        return outcome

    Ranks.agree = recorded_agree
    try:
        trainer_class = trl.RLOOTrainer if stock else RLOOTrainer
        trainer = trainer_class(model=path, reward_funcs=reward, args=args, train_dataset=dataset,
                                processing_class=build_processing_class(cfg) if images else build_tokenizer(),
                                **extra)  # fmt: skip
        encoded = []  # images through the vision tower, per call
        if images:
            language_model = trainer.accelerator.unwrap_model(trainer.model).model
            encode = language_model.get_image_features

            @functools.wraps(encode)  # generate reads its signature
            def recorded_encode(pixel_values, image_grid_thw=None, *args, **kwargs):
                encoded.append(len(image_grid_thw))
                return encode(pixel_values, image_grid_thw, *args, **kwargs)

            language_model.get_image_features = recorded_encode
        # Each call of generation on this rank: how many distinct prompts among how many rows
        generations = []
        generate = trainer._generate_single_turn

        def recorded(prompt_ids, images, multimodal_fields):
            prompts = sorted({hashlib.sha1(str(ids).encode()).hexdigest()[:12] for ids in prompt_ids})
            generations.append({"rows": len(prompt_ids), "prompts": prompts})
            return generate(prompt_ids, images, multimodal_fields)

        trainer._generate_single_turn = recorded
        scoring_chunks = []  # the chunks stock's no-grad log-prob passes forward (TRL's, by its batch size)
        forward = trainer._get_per_token_logps_and_entropies

        def recorded_forward(model, input_ids, *args, **kwargs):
            if not torch.is_grad_enabled():
                batch_size = (args[2] if len(args) > 2 else kwargs.get("batch_size")) or input_ids.size(0)
                scoring_chunks.append(-(-input_ids.size(0) // batch_size))
            return forward(model, input_ids, *args, **kwargs)

        trainer._get_per_token_logps_and_entropies = recorded_forward
        trainer.train()
    finally:
        Ranks.agree = agree
    return {
        "generations": generations,
        "images_encoded": encoded,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None,
        "metrics": [{k: e.get(k) for k in METRICS} for e in trainer.state.log_history if "loss" in e],
        "per_micro_batch": per_micro_batch(trainer),  # metrics that may differ where ours kept groups together
        "completions": list(trainer._logs["completion"]),
        "rewards": {name: list(values) for name, values in trainer._logs["rewards"].items()},
        "shared_prefill_tokens": getattr(trainer, "shared_prefill_tokens", None),
        "packed_forward_tokens": getattr(trainer, "packed_forward_tokens", None),
        "held_forward_tokens": getattr(trainer, "held_forward_tokens", None),
        "plans_agreed": agreed,
        "stock_scoring_chunks": sum(scoring_chunks),
        "scoring_forward_calls": getattr(trainer, "scoring_forward_calls", None),
        "reward_forward_tokens": getattr(trainer, "reward_forward_tokens", None),
        "share_prefix": trainer._switches.prefix if hasattr(trainer, "_switches") else None,
        "reward_funcs": [type(func).__name__ for func in trainer.reward_funcs],
        # Under ZeRO-3, the fraction of each model's parameters this rank holds between forwards
        "held_fraction": {name: held_fraction(model) for name, model in (("policy", trainer.model_wrapped),
                          ("reference", trainer.ref_model), ("reward", trainer.reward_funcs[-1]))},  # fmt: skip
        "trainer": trainer,
    }


def held_fraction(model) -> float | None:
    """Parameters this rank holds over the model's parameters, for a ZeRO-3-partitioned model (else None)."""
    parameters = list(getattr(model, "parameters", lambda: [])())
    if not parameters or not hasattr(parameters[0], "ds_numel"):
        return None
    return sum(p.ds_tensor.numel() for p in parameters) / sum(p.ds_numel for p in parameters)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model_cache", required=True)
    parser.add_argument("--runs", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    out = Path(args.out)
    trainer = None
    for run in json.loads(args.runs):
        result = train(run, out, args.model_cache)
        trainer = result.pop("trainer")
        (out / f"{run['name']}_rank{rank}.json").write_text(json.dumps(result))
    # Leave the process group (TRL's Trainer does not); the exit below is what avoids the abort at teardown
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
    # Results written, process group left: skip the interpreter's teardown, where a thread left behind in the CPU
    # (gloo) processes aborts one run in about seven ("terminate called without an active exception", torch 2.13)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
