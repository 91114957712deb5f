"""
Stock TRL vs rloo_efficient on a screenshot-like vision workload: each prompt one image of 1,369 image tokens (what a
1024x1024 screenshot gives Qwen2.5-VL's tower; here a 148x148 image on the tiny tower's patches of 2 merged 2x2) and
about 200 text tokens, 256-token completions, k = 8, one group per step, 3 steps. The tiny Qwen2.5-VL (hidden 128, 2
layers, float32; its tower 1 layer) keeps this on a CPU; the counts are the workload's, whatever the model's size.

Per group (a run's totals over its 3 groups / 3): language-model tokens forwarded (padding included: what each
forward computes) and images the vision tower encodes, in every phase; the whole run's working memory (peak resident
set above the loaded models) and the median step time. Each run is its own process, stock and ours alternate, and the
ratios are medians over `--repeats`.

    python experiments/bench_vision.py --repeats 3 --output results/vision.md
    python experiments/bench_vision.py --trainer grpo --repeats 3 --output results/vision_grpo.md
    python experiments/bench_vision.py --trainer grpo --rows 1 --output results/vision_rows1.md   # one row per
        # micro-batch: each group's prompt and image held across its micro-batches (`held_prefix_budget_gib`)
"""

import statistics
import sys
import tempfile
from pathlib import Path

from bench_common import Report, alternate, parser_for, run_workload


STEPS = 3


def run(method: str, args, directory: Path) -> dict:
    return run_workload(method, [
        "--trainer", args.trainer, "--arch", args.arch, "--image_size", str(args.image_size),
        "--image_width", str(args.image_size), "--prompt_length", str(args.prompt_length),
        "--max_completion_length", str(args.completion_length), "--num_generations", str(args.k),
        "--per_device_train_batch_size", str(args.rows), "--gradient_accumulation_steps", str(args.k // args.rows),
        "--steps_per_generation", str(args.k // args.rows), "--max_steps", str(STEPS),
    ], directory, method)  # fmt: skip


def per_group(counts: dict) -> str:
    """`phase: n, ...` per group, and the total."""
    parts = [f"{phase} {number // STEPS:,}" for phase, number in counts.items()]
    return f"{sum(counts.values()) // STEPS:,} ({', '.join(parts)})"


def main(argv=None) -> int:
    # --prompt_length: text tokens per prompt
    parser = parser_for(__doc__, prompt_length=200, completion_length=256, k=8, repeats=1, output=True)
    parser.add_argument("--trainer", default="rloo", choices=["rloo", "grpo"], help="TRL's trainer, stock vs ours")
    parser.add_argument("--arch", default="qwen2_5_vl")
    parser.add_argument("--image_size", type=int, default=148, help="pixels a side (148: 1,369 image tokens)")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows per micro-batch (default k), gradient accumulation filling the group")  # fmt: skip
    args = parser.parse_args(argv)
    args.rows = args.rows or args.k
    if args.k % args.rows:
        parser.error("--rows must divide k")
    with tempfile.TemporaryDirectory() as tmp:
        samples = alternate(lambda method, repeat: run(method, args, Path(tmp)), args.repeats)
    first = {method: runs[0] for method, runs in samples.items()}  # counts are deterministic: any run's
    working = {m: [r["working_gib"] for r in rs] for m, rs in samples.items()}
    step = {m: [r["median_step_time_s"] for r in rs] for m, rs in samples.items()}
    memory_ratio = statistics.median(o / s for o, s in zip(working["ours"], working["stock"], strict=True))
    time_ratio = statistics.median(o / s for o, s in zip(step["ours"], step["stock"], strict=True))
    tokens = {m: sum(r["language_model_tokens"].values()) for m, r in first.items()}
    images = {m: sum(r["images_encoded"].values()) for m, r in first.items()}
    report = Report([
        f"# python experiments/bench_vision.py {' '.join(argv if argv is not None else sys.argv[1:])}",
        f"# {args.trainer.upper()}, tiny {args.arch}: one {args.image_size}x{args.image_size} image and "
        f"~{args.prompt_length} text tokens per prompt, C = {args.completion_length}, k = {args.k}, one group per step "
        f"in micro-batches of {args.rows} row(s), {STEPS} steps; medians over {args.repeats} repeat(s)",
        "| per group | stock | ours | ratio |",
        "|---|---:|---:|---:|",
        f"| language-model tokens forwarded | {per_group(first['stock']['language_model_tokens'])} | "
        f"{per_group(first['ours']['language_model_tokens'])} | {tokens['ours'] / tokens['stock']:.2f}x |",
        f"| images through the vision tower | {per_group(first['stock']['images_encoded'])} | "
        f"{per_group(first['ours']['images_encoded'])} | {images['ours'] / images['stock']:.2f}x |",
        f"| working memory, whole run (GiB) | {statistics.median(working['stock']):.3f} | "
        f"{statistics.median(working['ours']):.3f} | {memory_ratio:.2f}x |",
        f"| step time (s) | {statistics.median(step['stock']):.2f} | {statistics.median(step['ours']):.2f} | "
        f"{time_ratio:.2f}x |",
    ], args.output)  # fmt: skip
    return report.write()


if __name__ == "__main__":
    raise SystemExit(main())
