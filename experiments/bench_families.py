"""
Stock TRL vs rloo_efficient for each model family, on the default workload's shape (hidden 128, 2 layers, float32;
P = 2048, C = 64, k = 8, 3 steps): the whole run's working memory and the median step time. Each family is built from
its own config (rloo_efficient.demo.tiny_models): Gemma 3, Gemma 4 and GPT-OSS with their real sliding windows (512, 512
and 128, every other layer), so the windowed paths run; Gemma 4 with 4 layers (2 of them reusing the others' keys and
values); the MoE families under TRL's default config, the load-balancing loss on (GLM-4-MoE and Nemotron-H have
none); the hybrids (Qwen3.5, Qwen3.5-MoE: Gated DeltaNet and attention; Nemotron-H: Mamba2, attention and experts, 3
layers) on transformers' torch kernels. Each run is its own process, stock and ours alternate, and the ratios are
medians over `--repeats`.

    python experiments/bench_families.py --repeats 3 --output results/families.md
    python experiments/bench_families.py --trainer grpo --families llama --repeats 3 --output results/grpo.md
"""

import statistics
import sys
import tempfile
from pathlib import Path

from bench_common import Report, alternate, parser_for, run_workload


FAMILIES = ["llama", "gemma3", "phi3", "olmo2", "smollm3", "granite", "qwen3_moe", "gpt_oss", "gemma4", "glm4_moe",
            "qwen3_5", "qwen3_5_moe", "nemotron_h"]


def run(method: str, arch: str, args, directory: Path) -> dict:
    return run_workload(method, [
        "--trainer", args.trainer, "--arch", arch, "--prompt_length", str(args.prompt_length),
        "--max_completion_length", str(args.completion_length), "--num_generations", str(args.k),
        "--per_device_train_batch_size", str(args.k), "--max_steps", "3",
    ], directory, f"{method}_{arch}")  # fmt: skip


def main(argv=None) -> int:
    parser = parser_for(__doc__, prompt_length=2048, completion_length=64, k=8, repeats=1, output=True)
    parser.add_argument("--families", nargs="+", default=FAMILIES)
    parser.add_argument("--trainer", default="rloo", choices=["rloo", "grpo"], help="TRL's trainer, stock vs ours")
    args = parser.parse_args(argv)
    report = Report([
        f"# python experiments/bench_families.py {' '.join(argv if argv is not None else sys.argv[1:])}",
        f"# {args.trainer.upper()}; P = {args.prompt_length}, C = {args.completion_length}, k = {args.k}, 3 steps; "
        "working memory: peak resident "
        "set above the loaded models (GiB); step time: median of steps 2-3 (s); medians over repeats",
        "| family | stock working (GiB) | ours working (GiB) | ratio | stock step (s) | ours step (s) | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ], args.output)  # fmt: skip
    for arch in args.families:
        with tempfile.TemporaryDirectory() as tmp:
            samples = alternate(lambda method, repeat: run(method, arch, args, Path(tmp)), args.repeats)
        working = {m: [r["working_gib"] for r in rs] for m, rs in samples.items()}
        step = {m: [r["median_step_time_s"] for r in rs] for m, rs in samples.items()}
        memory_ratio = statistics.median(o / s for o, s in zip(working["ours"], working["stock"], strict=True))
        time_ratio = statistics.median(o / s for o, s in zip(step["ours"], step["stock"], strict=True))
        report.add(f"| {arch} | {statistics.median(working['stock']):.3f} | {statistics.median(working['ours']):.3f} | "
                   f"{memory_ratio:.2f}x | {statistics.median(step['stock']):.2f} | "
                   f"{statistics.median(step['ours']):.2f} | {time_ratio:.2f}x |")  # fmt: skip
    return report.write()


if __name__ == "__main__":
    sys.exit(main())
