"""
Stock TRL vs rloo_efficient on GPU-sized workloads: random-weight models shaped like Qwen3-0.6B and Qwen3-1.7B (their
vocabulary size, the LM head tied to the input embedding as theirs are: `--untied` for the shape measured until
2026-12-07), bf16, gradient checkpointing on, beta 0.05, one group per micro-batch, completions running
to their maximum length. Each run is its own process (`experiments/run_rloo.py`, so one run's memory cannot lower
another's peak), 3 steps; the table gives the median of the steady steps (2 and 3) per phase: time (the profiler
synchronizes the device at phase boundaries), peak allocated and peak reserved.

    python experiments/bench_gpu.py                       # the issue's workloads, on the GPU
    python experiments/bench_gpu.py --workloads 1.7b      # the 1.7B workloads alone (0.6b: the others)
    python experiments/bench_gpu.py --workloads smoke     # a seconds-long check of this script, on any device
    python experiments/bench_gpu.py --ablations           # also ours with each generation feature off
    python experiments/bench_gpu.py --workloads 0.6b-k8 --ablations empty_cache_policy=after_generation
    python experiments/bench_gpu.py --workloads 0.6b-rows1   # one row per micro-batch: prompts held across them
    python experiments/bench_gpu.py --workloads 0.6b-k8 --continuous_batching   # stock's paged backend too

A run that runs out of memory is reported as such.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import Report  # noqa: E402
from memory_history import RECORDED_STEP


HERE = Path(__file__).resolve().parent
# (name, preset, prompt length, completion length, k)
WORKLOADS = {
    "gpu": [
        ("0.6B P=3072 C=256 k=8", "qwen3-0.6b", 3072, 256, 8),
        ("0.6B P=3072 C=256 k=16", "qwen3-0.6b", 3072, 256, 16),
        ("1.7B P=16384 C=128 k=8", "qwen3-1.7b", 16384, 128, 8),
        ("1.7B P=16384 C=128 k=16", "qwen3-1.7b", 16384, 128, 16),
    ],
    "smoke": [("tiny P=256 C=16 k=4", None, 256, 16, 4)],
}
# Each group alone, for a device session too short for all four (one run takes ~80 s on an H200 at 0.6B)
WORKLOADS["0.6b"], WORKLOADS["1.7b"] = WORKLOADS["gpu"][:2], WORKLOADS["gpu"][2:]
WORKLOADS["0.6b-k8"], WORKLOADS["1.7b-k8"] = WORKLOADS["gpu"][:1], WORKLOADS["gpu"][2:3]
# One row per micro-batch, 8 accumulated (a memory-bound user's setting): each prompt held across the micro-batches
WORKLOADS["0.6b-rows1"] = [("0.6B P=3072 C=256 k=8, 1 row per micro-batch", "qwen3-0.6b", 3072, 256, 8, 1)]
WORKLOADS["0.6b-rows2"] = [("0.6B P=3072 C=256 k=8, 2 rows per micro-batch", "qwen3-0.6b", 3072, 256, 8, 2)]
# Completions longer than the prompts (a reasoning run): a no-grad pass's one-row chunks cannot merge, each replayed
# from a CUDA graph (graph_scoring_passes, against its ablation)
WORKLOADS["0.6b-long-rows1"] = [("0.6B P=512 C=1024 k=8, 1 row per micro-batch", "qwen3-0.6b", 512, 1024, 8, 1)]
ABLATIONS = {"share_prompt_kv_cache=False": ["--share_prompt_kv_cache", "false"],
             "share_generation_prefill=False": ["--share_generation_prefill", "false"],
             "empty_cache_policy=after_generation": ["--empty_cache_policy", "after_generation"],
             "share_prompt_kv_cache=True": ["--share_prompt_kv_cache", "true"],  # the prompt kept once, always
             # generate's own decoding loop instead of static buffers captured as a CUDA graph (the default on CUDA)
             "static_decoding=False": ["--static_decoding", "false"],
             # each micro-batch forwarding its rows' prompts (on a CPU stand-in of a host-bound GPU, training at two
             # rows per micro-batch dispatched fewer operators so: results/host_bound.md)
             "held_prefix_budget_gib=0": ["--held_prefix_budget_gib", "0"],
             # the one-row no-grad passes' chunks forwarded eagerly, not replayed from CUDA graphs
             "graph_scoring_passes=False": ["--graph_scoring_passes", "false"]}  # fmt: skip
GIB = "gib"


def run(method: str, preset, prompt_length, completion_length, k, extra, out_dir: Path, device_args,
        rows: int | None = None, history: str | None = None, steps: int = 3) -> dict | str:  # fmt: skip
    """One run of `steps` optimizer steps; `rows` per micro-batch (default k), accumulation filling one group's step;
    `history`: where step 2's allocator history goes (experiments/memory_history.py)."""
    results = out_dir / f"{method}_{len(list(out_dir.iterdir()))}.json"
    rows = rows or k
    extra = [*extra, *(["--memory_history", history] if history else [])]
    command = [
        sys.executable, str(HERE / "run_rloo.py"), "--method", method, "--prompt_length", str(prompt_length),
        "--max_completion_length", str(completion_length), "--num_generations", str(k),
        "--per_device_train_batch_size", str(rows), "--gradient_accumulation_steps", str(k // rows),
        "--steps_per_generation", str(k // rows), "--max_steps", str(steps), "--beta", "0.05",
        "--gradient_checkpointing", "true", "--generation_kwargs", json.dumps({"min_new_tokens": completion_length}),
        "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--results_file", str(results),
        "--output_dir", str(out_dir / "trainer"), *(["--preset", preset] if preset else []), *device_args, *extra,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        if "OutOfMemoryError" in done.stderr or "out of memory" in done.stderr:
            return "out of memory"
        sys.stderr.write(done.stderr[-3000:])
        return f"failed (exit {done.returncode})"
    return {**json.loads(results.read_text()), "recorded_step": RECORDED_STEP if history else None}


def history_path(directory: str | None, workload: str, label: str) -> str | None:
    if directory is None:
        return None
    slug = "".join(c if c.isalnum() else "_" for c in f"{workload}_{label}".lower()).strip("_")
    return str(Path(directory) / f"history_{'_'.join(part for part in slug.split('_') if part)}.md")


def steady(result: dict, phase: str | None, stat: str) -> float | None:
    """Median over steps 2.. of a phase's stat (time_s or a peak), or of the whole step for phase None (time_s: TRL's
    `step_time`, its training steps' host time; wall_s: the profiler's, synchronized, the optimizer step included); a
    time leaves out the step whose allocator history was recorded."""
    def kept(values: list) -> list:
        recorded = result.get("recorded_step") if stat in ("time_s", "wall_s") else None
        values = [value for number, value in enumerate(values, 1) if number != recorded]
        return values[1:] or values

    steps = kept(result["steps"])
    if phase is None:
        if stat == "time_s":
            return statistics.median(kept(result["step_times_s"]))
        if stat == "wall_s":
            return statistics.median(step["time_s"] for step in steps)
        return max(max(record.get(stat, 0.0) for record in step["phases"].values()) for step in steps)
    values = [step["phases"][phase][stat] for step in steps if phase in step["phases"]]
    return statistics.median(values) if values else None


def between_steps(result: dict) -> float | None:
    """Allocated after each steady step's optimizer step (the last optimizer segment of each step), their median:
    what a method keeps from one step to the next beyond the weights and optimizer states."""
    ends = {}
    for segment in result.get("timeline", []):
        if segment.get("phase") == "optimizer" and "allocated_gib" in segment and segment.get("step") is not None:
            ends[segment["step"]] = segment["allocated_gib"]
    values = [ends[step] for step in sorted(ends)[1:] or sorted(ends)]
    return statistics.median(values) if values else None


# The phases in which the trainable parameters' gradients exist (the optimizer step sets them to None after it)
WITH_GRADIENTS = ("train", "optimizer")


def fixed_state(result: dict, phase: str) -> float | None:
    """The fixed state during `phase` (GiB): weights and optimizer states, and the gradients where they exist."""
    if "fixed_state_gib" not in result:
        return None
    return result["fixed_state_gib"] - (0.0 if phase in WITH_GRADIENTS else result["gradients_gib"])


def above_fixed(result: dict, phase: str | None, peak: str) -> float | None:
    """A phase's steady peak less its fixed state; for phase None, the largest of the phases'."""
    if "fixed_state_gib" not in result:
        return None
    if phase is None:
        phases = {name for step in result["steps"] for name in step["phases"]}
        values = [above_fixed(result, name, peak) for name in phases]
        return max(value for value in values if value is not None)
    value = steady(result, phase, peak)
    return None if value is None else value - fixed_state(result, phase)


def memory_cells(result: dict, stock, peak: str, reserved: str | None) -> list[str]:
    """Peak, fixed state (with gradients), the largest phase peak above its phase's fixed state and its ratio to
    stock's, peak reserved and its ratio, kept between steps."""
    def ratio(value, base):
        return f"{value / base:.2f}x" if base else ""

    fixed = result.get("fixed_state_gib")
    value = steady(result, None, peak)
    above = above_fixed(result, None, peak)
    base = None if isinstance(stock, str) else above_fixed(stock, None, peak)
    cells = [f"{value:.2f}", f"{fixed:.2f}" if fixed is not None else "",
             f"{above:.2f}" if above is not None else "", ratio(above, base) if above is not None else ""]
    if reserved:
        value = steady(result, None, reserved)
        base = None if isinstance(stock, str) else steady(stock, None, reserved)
        cells += [f"{value:.2f}", ratio(value, base)]
    else:
        cells += ["", ""]
    kept = between_steps(result)
    kept = kept - (fixed - result.get("gradients_gib", 0.0)) if kept is not None and fixed is not None else None
    return cells + [f"{kept:.2f}" if kept is not None else ""]


def phase_lines(name: str, label: str, result: dict | str, peak: str) -> list[str]:
    """One run's numbers as comment lines, printed as soon as it ends: its step, each scoring phase's time (s per
    step), and each phase's peak and that peak above the phase's fixed state (GiB)."""
    if isinstance(result, str):
        return [f"# {name}, {label}: {result}"]
    phases = ", ".join(f"{phase} {steady(result, phase, 'time_s') or 0.0:.3f}"
                       for phase in ("policy_logps", "reference_logps", "train"))  # fmt: skip
    peaks = ", ".join(f"{phase} {steady(result, phase, peak) or 0.0:.2f}"
                      for phase in ("generation", "policy_logps", "reference_logps", "train"))  # fmt: skip
    above = ", ".join(f"{phase} {above_fixed(result, phase, peak) or 0.0:.2f}"
                      for phase in ("generation", "policy_logps", "reference_logps", "train"))  # fmt: skip
    parts = ", ".join(f"{part.removesuffix('_gib').replace('_', ' ')} {result.get(part, 0.0):.2f}"
                      for part in ("weights_gib", "gradients_gib", "optimizer_states_gib"))  # fmt: skip
    wall, generation = steady(result, None, "wall_s"), steady(result, "generation", "time_s") or 0.0
    return [f"# {name}, {label}: step {steady(result, None, 'time_s'):.2f} (synchronized, the optimizer step "
            f"included: {wall:.2f}), generation {generation:.2f}, {phases}",
            f"# {name}, {label}, {peak.removesuffix('_gib').replace('_', ' ')} by phase (GiB): {peaks}",
            f"# {name}, {label}, above the fixed state by phase (GiB): {above}; fixed: {parts}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", choices=list(WORKLOADS), default="gpu")
    parser.add_argument("--ablations", nargs="*", default=None, choices=list(ABLATIONS),
                        help="also run ours with these settings (all of them when none is named)")
    parser.add_argument("--continuous_batching", action="store_true",
                        help="also stock with use_transformers_continuous_batching=True (its paged generation backend)")
    parser.add_argument("--output", default=None, help="Markdown file for the table (default: print only)")
    parser.add_argument("--untied", action="store_true", help="the LM head untied from the input embedding")
    parser.add_argument("--memory_history", default=None, metavar="DIR",
                        help="on CUDA: each run's step-2 allocator history by phase and site, to DIR/history_*.md "
                        "(the times then leave step 2 out)")
    parser.add_argument("--methods", nargs="+", choices=["stock", "ours"], default=["stock", "ours"],
                        help="the methods run, in this order (each run's numbers are printed as it ends: one a "
                        "time limit cuts leaves those before it)")
    args = parser.parse_args(argv)
    import torch

    on_gpu = torch.cuda.is_available()
    device_args = ["--bf16", "true"] if on_gpu else ["--bf16", "false"]
    if args.untied:
        device_args += ["--tie_word_embeddings", "false"]
    peak = "peak_allocated_gib" if on_gpu else "peak_rss_gib"
    reserved = "peak_reserved_gib" if on_gpu else None
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    recorded = f" (times: step 3 alone, step {RECORDED_STEP} records the allocator history)" * bool(args.memory_history)
    report = Report([
        f"# python experiments/bench_gpu.py {' '.join(argv if argv is not None else sys.argv[1:])}",
        f"# device {device}, torch {torch.__version__}; medians of steps 2-3 of 3{recorded}"
        f"; times in s, memory in GiB; the LM head {'untied' if args.untied else 'tied as the preset model'}",
        "# fixed state: weights of the policy and reference, gradients, optimizer states (the same for both methods); "
        "above fixed: the largest of the phases' peaks less the fixed state during that phase (gradients in training "
        "and the optimizer step alone); between steps: allocated after a step's optimizer step, less the fixed state "
        "but its gradients (freed by then)",
        "# step: TRL's step_time (its micro-batches' training steps, the optimizer step not included), as in the earlier "
        "tables; each run's line also gives the profiler's step, synchronized, the optimizer step included",
    ], args.output)
    head = [f"| workload | method | step | ratio | generation | ratio | train + log-probs | ratio | "
            f"{'peak allocated' if on_gpu else 'peak resident'} | fixed state | above fixed | ratio | peak reserved | "
            f"ratio | between steps |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, preset, p, c, k, *rows in WORKLOADS[args.workloads]:
        methods = {}
        for method in args.methods:
            methods[method] = (method, [])
            if method == "stock" and args.continuous_batching:
                methods["stock, continuous batching"] = ("stock", ["--use_transformers_continuous_batching", "true"])
            if method == "ours" and args.ablations is not None:
                methods.update({f"ours, {label}": ("ours", ABLATIONS[label]) for label in args.ablations or ABLATIONS})
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for label, (method, extra) in methods.items():
                results[label] = run(method, preset, p, c, k, extra, Path(tmp), device_args, *rows,
                                     history=history_path(args.memory_history, name, label))  # fmt: skip
                report.add(*phase_lines(name, label, results[label], peak))
        stock = results.get("stock", "not run")
        report.add("", *head)  # the workload's table, after its runs' lines
        for label, result in results.items():
            if isinstance(result, str):
                line = f"| {name} | {label} | {result} |" + " |" * 12
            else:
                cells = []
                for phase, stat in [(None, "time_s"), ("generation", "time_s"), ("scoring", "time_s")]:
                    if phase == "scoring":  # the training forward/backward and the two log-prob passes
                        value = sum(steady(result, ph, stat) or 0.0 for ph in ("train", "policy_logps",
                                                                               "reference_logps"))  # fmt: skip
                        base = None if isinstance(stock, str) else sum(
                            steady(stock, ph, stat) or 0.0 for ph in ("train", "policy_logps", "reference_logps"))
                    else:
                        value = steady(result, phase, stat)
                        base = None if isinstance(stock, str) else steady(stock, phase, stat)
                    cells += [f"{value:.2f}", f"{value / base:.2f}x" if base else ""]
                cells += memory_cells(result, stock, peak, reserved)
                line = f"| {name} | {label} | " + " | ".join(cells) + " |"
            report.add(line)
    return report.write()


if __name__ == "__main__":
    sys.exit(main())
