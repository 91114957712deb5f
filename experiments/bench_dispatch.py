"""
Aten operators dispatched and host synchronizations over a whole training run, stock TRL vs rloo_efficient, same
seed and data. On a GPU each operator that runs a kernel is a launch (microseconds whatever its size) and each host
synchronization stalls the launch queue; counted on CPU these are exact, repeatable numbers. "Launching" leaves out
views and bare allocations, which run no kernel.

    python experiments/bench_dispatch.py --prompt_length 256 --completion_length 32 --ks 2 4 16 --layers 4
"""

import argparse
import sys
import tempfile
import warnings

import trl

from rloo_efficient import RLOOConfig, RLOOTrainer
from rloo_efficient.demo.workload import WorkloadConfig, build_dataset, build_model_dir, build_tokenizer, vowel_reward
from rloo_efficient.profiling.op_count import OpCounter


def count_run(method: str, k: int, prompt_length: int, completion_length: int, layers: int, steps: int) -> OpCounter:
    """Operators dispatched by `trainer.train()` (model loading excluded) for one method."""
    tmp = tempfile.mkdtemp()
    workload = WorkloadConfig(prompt_length=prompt_length, num_hidden_layers=layers)
    args = RLOOConfig(output_dir=tmp, bf16=False, per_device_train_batch_size=k, num_generations=k,
                      max_completion_length=completion_length, max_steps=steps, logging_steps=1, report_to=[],
                      save_strategy="no", seed=1, disable_tqdm=True, profile_memory=False)  # fmt: skip
    trainer_class, args = (RLOOTrainer, args) if method == "ours" else (trl.RLOOTrainer, args.to_stock())
    trainer = trainer_class(model=build_model_dir(workload), reward_funcs=vowel_reward, args=args,
                            train_dataset=build_dataset(workload), processing_class=build_tokenizer())  # fmt: skip
    with OpCounter() as ops:
        trainer.train()
    return ops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt_length", type=int, default=256)
    parser.add_argument("--completion_length", type=int, default=32)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 16])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    print(f"# python experiments/bench_dispatch.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# default tiny model with {args.layers} layers, P={args.prompt_length}, C={args.completion_length}, "
          f"{args.steps} steps, one group per micro-batch")  # fmt: skip
    print("| k | stock ops | ours ops | ratio | stock launching | ours launching | ratio | stock host syncs | "
          "ours host syncs |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in args.ks:
        stock, ours = (count_run(m, k, args.prompt_length, args.completion_length, args.layers, args.steps)
                       for m in ("stock", "ours"))  # fmt: skip
        print(f"| {k} | {stock.total} | {ours.total} | {ours.total / stock.total:.3f} | {stock.launching} | "
              f"{ours.launching} | {ours.launching / stock.launching:.3f} | {stock.host_syncs} | {ours.host_syncs} |",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
