"""
Stock TRL vs rloo_efficient for each model family, on the default workload's shape (hidden 128, 2 layers, float32;
P = 2048, C = 64, k = 8, 3 steps): the whole run's working memory and the median step time. Each family is built from
its own config (rloo_efficient.tiny_models): Gemma 3, Gemma 4 and GPT-OSS with their real sliding windows (512, 512
and 128, every other layer), so the windowed paths run; Gemma 4 with 4 layers (2 of them reusing the others' keys and
values); the MoE families under TRL's default config, the load-balancing loss on (GLM-4-MoE and Nemotron-H have
none); the hybrids (Qwen3.5, Qwen3.5-MoE: Gated DeltaNet and attention; Nemotron-H: Mamba2, attention and experts, 3
layers) on transformers' torch kernels. Each run is its own process, stock and ours alternate, and the ratios are
medians over `--repeats`.

    python experiments/bench_families.py --repeats 3 --output results/families.md
    python experiments/bench_families.py --trainer grpo --families llama --repeats 3 --output results/grpo.md
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_common import run_workload

FAMILIES = ["llama", "gemma3", "phi3", "olmo2", "smollm3", "granite", "qwen3_moe", "gpt_oss", "gemma4", "glm4_moe",
            "qwen3_5", "qwen3_5_moe", "nemotron_h"]


def run(method: str, arch: str, args, directory: Path) -> dict:
    return run_workload(method, [
        "--trainer", args.trainer, "--arch", arch, "--prompt_length", str(args.prompt_length),
        "--max_completion_length", str(args.completion_length), "--num_generations", str(args.k),
        "--per_device_train_batch_size", str(args.k), "--max_steps", "3",
    ], directory, f"{method}_{arch}")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=FAMILIES)
    parser.add_argument("--trainer", default="rloo", choices=["rloo", "grpo"], help="TRL's trainer, stock vs ours")
    parser.add_argument("--prompt_length", type=int, default=2048)
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", default=None, help="Markdown file for the table (default: print only)")
    args = parser.parse_args(argv)
    lines = [
        f"# python experiments/bench_families.py {' '.join(argv if argv is not None else sys.argv[1:])}",
        f"# {args.trainer.upper()}; P = {args.prompt_length}, C = {args.completion_length}, k = {args.k}, 3 steps; "
        "working memory: peak resident "
        "set above the loaded models (GiB); step time: median of steps 2-3 (s); medians over repeats",
        "| family | stock working (GiB) | ours working (GiB) | ratio | stock step (s) | ours step (s) | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    print("\n".join(lines), flush=True)
    for arch in args.families:
        samples = {"stock": [], "ours": []}
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeats):
                for method in ("stock", "ours"):
                    samples[method].append(run(method, arch, args, Path(tmp)))
        working = {m: [r["working_gib"] for r in rs] for m, rs in samples.items()}
        step = {m: [r["median_step_time_s"] for r in rs] for m, rs in samples.items()}
        memory_ratio = statistics.median(o / s for o, s in zip(working["ours"], working["stock"], strict=True))
        time_ratio = statistics.median(o / s for o, s in zip(step["ours"], step["stock"], strict=True))
        line = (f"| {arch} | {statistics.median(working['stock']):.3f} | {statistics.median(working['ours']):.3f} | "
                f"{memory_ratio:.2f}x | {statistics.median(step['stock']):.2f} | {statistics.median(step['ours']):.2f} | "
                f"{time_ratio:.2f}x |")  # fmt: skip
        lines.append(line)
        print(line, flush=True)
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
