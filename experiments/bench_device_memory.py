"""
Device memory, counted on a CPU: stock TRL vs rloo_efficient, each phase's peak of live tensor bytes above its fixed
state (`rloo_efficient.profiling.live_bytes.LiveBytes`: what a GPU's allocator calls allocated), with the device path's
choices taken where a CPU can run them (experiments/device_proxy.py: static decoding and the scoring passes' graphs with
capture emulated, TRL's compact fused head, the prompt kept once while decoding), under bf16 autocast as TRL trains on
a GPU (float32 weights).

The shape: Qwen3's widths and full vocabulary with a few layers (`--layers`). With two layer counts (`--layers 4 2`),
each peak is also given at the model's own depth (`--depth`, 28 for Qwen3-0.6B): every term that grows with the layers
(weight copies, keys and values, held gradients, checkpoint inputs) scaled from the two runs' difference. Each run is
its own process, two optimizer steps; the second is counted (the first captures graphs and creates the optimizer's
states). The fixed state of a phase is what exists in it whatever the method: the weights and the optimizer's states
(not counted: they existed before the step), and in training and the optimizer step the gradients.

    python experiments/bench_device_memory.py                            # Qwen3-0.6B's widths, P=3072 C=256 k=8
    python experiments/bench_device_memory.py --rows 8 1 --layers 4 2 --output results/device_memory.md
    python experiments/bench_device_memory.py --preset qwen3-4b --prompt_length 8192 --completion_length 1024 --rows 1
    python experiments/bench_device_memory.py --preset qwen3-8b --lora ...   # LoRA r 16 on every linear layer
    python experiments/bench_device_memory.py --rows 1 --ours held_prefix_budget_gib=0   # ours holding no prompt

The large shapes take hours on a CPU: `--workdir DIR` keeps each run's records there and reuses a run whose records
are there (an interrupted benchmark goes on where it stopped), and `--jobs 2` runs stock and ours side by side, the
cores split between them.
"""

import contextlib
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_common import Report, parser_for, run_workload


PHASES = ("generation", "policy_logps", "reference_logps", "reward", "train", "optimizer")
WITH_GRADIENTS = ("train", "optimizer")
GIB = 1024**3


def run(method: str, args, rows: int, layers: int, directory: Path) -> dict:
    """One run's live-bytes record and results file; a run whose both files are in `directory` is not run again."""
    shape = f"{args.preset}_P{args.prompt_length}_C{args.completion_length}_k{args.k}"  # a workdir may hold several
    name = f"{method}_{shape}_rows{rows}_layers{layers}{'_lora' * args.lora}{'_untied' * args.untied}"
    if method == "ours" and args.ours:
        name += "_" + "_".join(setting.replace("=", "-") for setting in args.ours)
    live, results = directory / f"{name}_live.json", directory / f"{name}.json"
    if not (live.exists() and results.exists()):
        threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
        run_workload(method, arguments(method, args, rows, layers, live), directory, name, threads)
    return {"live": json.loads(live.read_text()), "results": json.loads(results.read_text())}


def arguments(method: str, args, rows: int, layers: int, live: Path) -> list[str]:
    """`run_rloo.py`'s arguments for one run, its live-bytes record written to `live`."""
    k = args.k
    return [
        "--preset", args.preset, "--preset_layers", str(layers), "--prompt_length", str(args.prompt_length),
        "--max_completion_length", str(args.completion_length), "--num_generations", str(k),
        "--per_device_train_batch_size", str(rows), "--gradient_accumulation_steps", str(k // rows),
        "--steps_per_generation", str(k // rows), "--max_steps", "2", "--beta", "0.05",
        "--gradient_checkpointing", "true", "--generation_kwargs", json.dumps({"min_new_tokens": args.completion_length}),
        "--bf16", "true", "--use_cpu", "true", "--emulate_device_path", "true", "--live_bytes", str(live),
        "--live_bytes_top", str(args.top),
        *(["--share_prompt_kv_cache", "true"] if method == "ours" else []),
        *(["--lora", "true"] if args.lora else []),
        *(["--tie_word_embeddings", "false"] if args.untied else []),
        *(part for key, _, value in (setting.partition("=") for setting in args.ours if method == "ours")
          for part in (f"--{key}", value)),
    ]  # fmt: skip


def above_fixed(record: dict, phase: str) -> float | None:
    """A phase's peak of live bytes above its fixed state (GiB); None where the phase did not run."""
    phase_record = record["live"]["phases"].get(phase)
    if phase_record is None:
        return None
    gradients = record["results"]["gradients_gib"] if phase in WITH_GRADIENTS else 0.0
    return phase_record["peak_bytes"] / GIB - gradients


def scaled(values: dict[int, float | None], depth: int) -> float | None:
    """A value at `depth` layers, linear in the layers through the two measured counts; None where it falls with the
    layers by more than a MiB (a training peak before the layers' gradients exist: the fixed state counts them, more with
    more layers)."""
    if len(values) < 2 or any(value is None for value in values.values()):
        return None
    (l1, v1), (l2, v2) = sorted(values.items())[:2]
    return v1 + (v2 - v1) / (l2 - l1) * (depth - l1) if v2 >= v1 - 2**-10 else None


def largest_at_depth(at_depth_by_phase: dict[str, dict[str, float | None]], method: str) -> float | None:
    """`method`'s largest phase peak scaled to depth ([`scaled`]); None where one of its phases did not scale."""
    values = [at_depth[method] for at_depth in at_depth_by_phase.values()]
    return None if None in values else max(values)


def main(argv=None) -> int:
    parser = parser_for(__doc__, prompt_length=3072, completion_length=256, k=8, output=True)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 1], help="rows per micro-batch (k: one group)")
    parser.add_argument("--layers", type=int, nargs="+", default=[4], help="layer counts run (two: scaled to --depth)")
    parser.add_argument("--depth", type=int, default=None, help="the model's own layers (default: the preset's)")
    parser.add_argument("--lora", action="store_true", help="LoRA r 16 on every linear layer (a LoRA run)")
    parser.add_argument("--untied", action="store_true",
                        help="the LM head untied from the input embedding (Qwen3 up to 4B ties them; 8B does not)")
    parser.add_argument("--ours", nargs="*", default=[], metavar="KEY=VALUE",
                        help="ours' settings beside the defaults (e.g. held_prefix_budget_gib=0: no prompt held)")
    parser.add_argument("--top", type=int, default=10,
                        help="the largest tensors named per phase (a run reused from --workdir keeps its own count)")
    parser.add_argument("--workdir", default=None, help="keep each run's records here; reuse those already here")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (the cores split between them)")
    args = parser.parse_args(argv)
    from rloo_efficient.demo.workload import PRESETS

    depth = args.depth or PRESETS[args.preset]["num_hidden_layers"]
    command = " ".join(["python experiments/bench_device_memory.py", *(argv if argv is not None else sys.argv[1:])])
    layer_cells = " | ".join(f"{layers} layers" for layers in args.layers)
    scale = len(args.layers) >= 2
    report = Report([
        f"# {command}",
        f"# {args.preset} widths ({'untied' if args.untied else 'the LM head tied as the model'}'s), "
        f"P={args.prompt_length} C={args.completion_length} k={args.k}, bf16 autocast on CPU, "
        "device path emulated; peak live tensor bytes above each phase's fixed state (GiB), optimizer step 2 of 2",
        f"| rows per micro-batch | phase | stock, {layer_cells} | ours, {layer_cells} | ratio"
        + (f" | stock at {depth} | ours at {depth} | ratio at {depth} |" if scale else " |"),
        "|---|---|" + "---:|" * (2 * len(args.layers) + 1) + ("---:|---:|---:|" if scale else ""),
    ], args.output)
    largest = []
    for rows in args.rows:
        keys = [(method, layers) for layers in args.layers for method in ("stock", "ours")]
        kept = Path(args.workdir) if args.workdir else None
        with (contextlib.nullcontext(kept) if kept else tempfile.TemporaryDirectory()) as directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # each run is its own process
                futures = {key: pool.submit(run, key[0], args, rows, key[1], Path(directory)) for key in keys}
                records = {key: future.result() for key, future in futures.items()}
        at_depth_by_phase = {}
        for phase in (*PHASES, "step"):
            def value(method, layers, phase=phase):
                if phase != "step":
                    return above_fixed(records[(method, layers)], phase)
                values = [above_fixed(records[(method, layers)], name) for name in PHASES]
                return max(v for v in values if v is not None)

            measured = {method: {layers: value(method, layers) for layers in args.layers} for method in ("stock", "ours")}
            if all(v is None for per in measured.values() for v in per.values()):
                continue
            first = args.layers[0]
            cells = [f"{measured[m][layers]:.3f}" if measured[m][layers] is not None else ""
                     for m in ("stock", "ours") for layers in args.layers]  # fmt: skip
            base, ours = measured["stock"][first], measured["ours"][first]
            cells.append(f"{ours / base:.2f}x" if base and ours is not None else "")
            if scale:
                at_depth = {m: scaled(measured[m], depth) for m in ("stock", "ours")}
                if phase == "step":  # (the largest phase at depth, which may not be the largest at the counts run)
                    at_depth = {m: largest_at_depth(at_depth_by_phase, m) for m in ("stock", "ours")}
                else:
                    at_depth_by_phase[phase] = at_depth
                cells += [f"{at_depth[m]:.3f}" if at_depth[m] is not None else "" for m in ("stock", "ours")]
                cells.append(f"{at_depth['ours'] / at_depth['stock']:.2f}x" if at_depth["stock"] and at_depth["ours"]
                             is not None else "")  # fmt: skip
            report.add(f"| {rows} | {phase} | " + " | ".join(cells) + " |")
        for method in ("stock", "ours"):
            record = records[(method, args.layers[0])]
            for phase in PHASES:
                phase_record = record["live"]["phases"].get(phase)
                if phase_record is None:
                    continue
                largest.append(f"# {rows} rows, {method}, {phase} ({args.layers[0]} layers), peak "
                               f"{phase_record['peak_bytes'] / GIB:.3f} GiB; the largest tensors then:")  # fmt: skip
                largest += [f"#   {t['bytes'] / 2**20:9.1f} MiB {t['dtype']:>8} {str(tuple(t['shape'])):<24} "
                            f"{t['op']:<22} {t['site']}" for t in phase_record["largest"][: args.top]]  # fmt: skip
    report.add(*largest)
    return report.write()


if __name__ == "__main__":
    sys.exit(main())
