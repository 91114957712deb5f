"""
Stock TRL vs ours at small micro-batches, where a group's rows fall in several micro-batches and each would forward
its prompt again: GRPO, k = 8, two prompts per step (16 rows) of 1,024 or 4,096 tokens, completions of varied length
(up to 128 tokens, EOS likelier), beta 0.05 (the reference pass runs), micro-batches of 1, 2 and 4 rows with gradient
accumulation filling the generation batch (16, 8 and 4 steps).

Per phase: the tokens the policy and reference forwards were given (stock's padded rows; ours packed, each prompt's
held forward included), against the tree of the whole generation batch (ours with one micro-batch holding every
row: what the tokens cannot go below), the phase's peak memory above the loaded models, and its time (medians over
steps 2-3 and the repeats); then the whole step. Each run is its own process (tiny llama, hidden 128, 2 layers,
float32, CPU), stock and ours alternating.

    python experiments/bench_micro_batch.py --repeats 3 --output results/micro_batch.md
    python experiments/bench_micro_batch.py --trainer rloo --arch qwen3_next --prompt_lengths 1024 --rows 1 2
"""

import statistics
import sys
import tempfile
from pathlib import Path

from bench_common import Report, alternate, parser_for, run_workload


EOS = 2  # the workload's tokenizer
COMMON = ["--hidden_size", "128", "--num_hidden_layers", "2", "--max_steps", "3", "--num_generations", "8",
          "--num_prompts", "16", "--beta", "0.05", "--max_completion_length", "128",
          "--generation_kwargs", f'{{"sequence_bias": [[[{EOS}], 1.0]]}}']  # fmt: skip
ROWS = 16  # per generation batch: 2 prompts x k
PHASES = ("reference_logps", "policy_logps", "train")


def arguments(trainer: str, arch: str, prompt_length: int, rows: int) -> list[str]:
    """The workload at `rows` rows per micro-batch, accumulation filling the generation batch."""
    steps = ROWS // rows
    return [*COMMON, "--trainer", trainer, "--arch", arch, "--prompt_length", str(prompt_length),
            "--per_device_train_batch_size", str(rows), "--gradient_accumulation_steps", str(steps),
            "--steps_per_generation", str(steps)]  # fmt: skip


def median_over(results: list[dict], value) -> float:
    return statistics.median(value(result) for result in results)


def phase_time(result: dict, phase: str) -> float:
    steps = result["steps"][1:] or result["steps"]
    return statistics.median(step["phases"][phase]["time_s"] for step in steps if phase in step["phases"])


def rows_of(label: str, prompt_length: int, rows: int, samples: dict[str, list[dict]], tree: dict) -> list[str]:
    lines = []
    for phase in PHASES + ("step",):
        if phase == "step":
            tokens = {m: sum(r["language_model_tokens"].get(p, 0) for p in PHASES) for m, (r, *_) in samples.items()}
            tree_tokens = sum(tree["language_model_tokens"].get(p, 0) for p in PHASES)
            peak = {m: median_over(rs, lambda r: r["working_gib"]) for m, rs in samples.items()}
            time = {m: median_over(rs, lambda r: r["median_step_time_s"]) for m, rs in samples.items()}
        else:
            if phase not in samples["stock"][0]["language_model_tokens"]:
                continue
            tokens = {m: rs[0]["language_model_tokens"].get(phase, 0) for m, rs in samples.items()}
            tree_tokens = tree["language_model_tokens"].get(phase, 0)
            peak = {m: median_over(rs, lambda r: r["per_phase_peak_gib"][phase] - r["memory_after_load_gib"])
                    for m, rs in samples.items()}  # fmt: skip
            time = {m: median_over(rs, lambda r: phase_time(r, phase)) for m, rs in samples.items()}
        lines.append(
            f"| {label} | {prompt_length:,} | {rows} | {phase} | {tokens['stock']:,} | {tokens['ours']:,} | {tree_tokens:,} | "
            f"{tokens['ours'] / tree_tokens:.2f}x | {peak['stock']:.3f} | {peak['ours']:.3f} | {time['stock']:.2f} | "
            f"{time['ours']:.2f} | {time['ours'] / time['stock']:.2f}x |"
        )  # fmt: skip
    return lines


def main(argv=None) -> int:
    parser = parser_for(__doc__, prompt_lengths=[1024, 4096], repeats=1, output=True)
    parser.add_argument("--trainer", default="grpo", choices=["grpo", "rloo"])
    parser.add_argument("--arch", default="llama", help="the tiny model's family (a hybrid: qwen3_next, nemotron_h)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="rows per micro-batch")
    args = parser.parse_args(argv)
    header = [f"# python experiments/bench_micro_batch.py {' '.join(argv if argv is not None else sys.argv[1:])}",
              "# k = 8, 2 prompts per step, beta 0.05, completions <= 128 tokens; tiny models (hidden 128, 2 layers, "
              "float32), CPU; tokens of the whole run (3 steps); peak: above the loaded models (GiB); time: s per step",
              "| run | prompt | rows per micro-batch | phase | stock tokens | ours tokens | whole-batch tree | ours / tree | "
              "stock peak | ours peak | stock s | ours s | ours / stock |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    report = Report(header, args.output)
    with tempfile.TemporaryDirectory() as directory:
        for prompt_length in args.prompt_lengths:
            workload = lambda rows: arguments(args.trainer, args.arch, prompt_length, rows)  # noqa: E731
            tree = run_workload("ours", workload(ROWS), Path(directory), f"tree_{prompt_length}")
            for rows in args.rows:
                samples = alternate(lambda method, repeat: run_workload(
                    method, workload(rows), Path(directory), f"{method}_{prompt_length}_{rows}_{repeat}"), args.repeats)
                report.add(*rows_of(f"{args.trainer.upper()} {args.arch}", prompt_length, rows, samples, tree))
    return report.write()


if __name__ == "__main__":
    sys.exit(main())
