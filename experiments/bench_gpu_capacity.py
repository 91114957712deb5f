"""
Each method's largest micro-batch on the GPU: stock TRL vs rloo_efficient on one workload at 1, 2, 4, ... rows per
micro-batch (gradient accumulation filling one group's step, as `experiments/bench_gpu.py` runs it), from one row up
until a size does not fit; for the largest that fits, its step time and its peak above the fixed state. Issue 58's row:
Qwen3-8B's shape (random weights, its vocabulary, the LM head untied as the model's) with LoRA (r 16 on every linear
layer), P=8192, C=1024, k=8, bf16, gradient checkpointing on, beta 0.05. Each run is its own process.

    python experiments/bench_gpu_capacity.py                       # Qwen3-8B LoRA, P=8192 C=1024 k=8, on the GPU
    python experiments/bench_gpu_capacity.py --methods ours        # one method (a device call too short for both)
    python experiments/bench_gpu_capacity.py --preset tiny --prompt_length 256 --completion_length 16 --k 4
                                                                   # a seconds-long check of this script, any device

A run that fails for another reason than memory stops that method's search and is reported as such.
"""

import sys
import tempfile
from pathlib import Path

from bench_common import Report, parser_for
from bench_gpu import above_fixed, run, steady


def sizes(k: int) -> list[int]:
    """The rows per micro-batch tried, smallest first: the powers of two that divide `k` (a group's rows fill whole
    micro-batches), and `k`."""
    return sorted({*(2**i for i in range(k.bit_length()) if k % 2**i == 0), k})


def largest(method: str, args, device_args: list[str]) -> tuple[int | None, dict | None, str]:
    """`(rows, results, next)`: the most rows per micro-batch that fit `method`'s run, that run's results (None, None
    where one row does not fit), and what the next size did."""
    fits, results, following = None, None, "none larger (a whole group per micro-batch)"
    for rows in sizes(args.k):
        with tempfile.TemporaryDirectory() as tmp:
            outcome = run(method, args.preset, args.prompt_length, args.completion_length, args.k, [], Path(tmp),
                          device_args, rows, steps=args.max_steps)  # fmt: skip
        print(f"# {method}, {rows} rows per micro-batch: {outcome if isinstance(outcome, str) else 'fits'}",
              flush=True)  # fmt: skip
        if isinstance(outcome, str):
            following = f"{rows}: {outcome}"
            break
        fits, results = rows, outcome
    return fits, results, following


def main(argv=None) -> int:
    parser = parser_for(__doc__, prompt_length=8192, completion_length=1024, k=8, output=True)
    parser.add_argument("--preset", default="qwen3-8b", help="a workload preset, or `tiny` for the tiny model")
    parser.add_argument("--no_lora", action="store_true", help="full fine-tuning instead of LoRA r 16")
    parser.add_argument("--methods", nargs="+", default=["stock", "ours"], choices=["stock", "ours"])
    parser.add_argument("--max_steps", type=int, default=2, help="steps per run (the last is the one timed)")
    args = parser.parse_args(argv)
    import torch

    on_gpu = torch.cuda.is_available()
    device_args = ["--bf16", "true" if on_gpu else "false", *([] if args.no_lora else ["--lora", "true"])]
    args.preset = None if args.preset == "tiny" else args.preset
    peak = "peak_allocated_gib" if on_gpu else "peak_rss_gib"
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    report = Report([
        f"# python experiments/bench_gpu_capacity.py {' '.join(argv if argv is not None else sys.argv[1:])}",
        (f"# device {device}, torch {torch.__version__}; {args.preset or 'tiny'} P={args.prompt_length} "
         f"C={args.completion_length} k={args.k}, {'full fine-tuning' if args.no_lora else 'LoRA r 16'}, "
         f"{args.max_steps} steps a run (the last timed); memory in GiB, above the fixed state as bench_gpu.py "
         f"counts it"),
        (f"| method | most rows per micro-batch that fit | step (s) | step vs stock's, each at its most | "
         f"{'peak allocated' if on_gpu else 'peak resident'} | above fixed | the next size |"),
        "|---|---:|---:|---:|---:|---:|---|",
    ], args.output)
    found = {method: largest(method, args, device_args) for method in args.methods}
    stock = found.get("stock", (None, None, ""))[1]
    for method, (rows, results, following) in found.items():
        if results is None:
            report.add(f"| {method} | none (one row: {following.split(': ', 1)[-1]}) | | | | | |")
            continue
        step, above = steady(results, None, "time_s"), above_fixed(results, None, peak)
        base = steady(stock, None, "time_s") if stock is not None else None
        report.add(f"| {method} | {rows} | {step:.2f} | {f'{step / base:.2f}x' if base else ''} | "
                   f"{steady(results, None, peak):.2f} | {above:.2f} | {following} |")  # fmt: skip
    return report.write()


if __name__ == "__main__":
    sys.exit(main())
