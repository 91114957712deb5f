"""
Prints the side-by-side table of stock TRL and rloo_efficient from the results files that experiments/run_rloo.py
wrote, and saves it as Markdown (results/comparison.md). Reads results only.

    python experiments/compare.py --results_dir results
"""

import argparse
import json
import statistics
import sys
from pathlib import Path


PHASES = ("generation", "policy_logps", "reference_logps", "reward", "train", "optimizer")


def load(results_dir: Path) -> dict:
    runs = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError:
            print(f"[compare] skipping unreadable {path}", file=sys.stderr)
            continue
        if "method" not in result or "k" not in result:
            continue
        key = (result["prompt_length"], result["completion_length"], result["k"], json.dumps(result["workload"], sort_keys=True))
        runs.setdefault(key, {})[result["method"]] = result
    return runs


def median_phase_time(result: dict, phase: str) -> float | None:
    times = [step["phases"][phase]["time_s"] for step in result.get("steps", []) if phase in step["phases"]]
    return statistics.median(times) if times else None


def table(runs: dict) -> str:
    lines = [
        "| P | C | k | phase | stock (GiB) | ours (GiB) | ours/stock |",
        "|---:|---:|---:|---|---:|---:|---:|",
    ]
    for (p, c, k, _), pair in sorted(runs.items()):
        if set(pair) != {"stock", "ours"}:
            continue
        stock, ours = pair["stock"], pair["ours"]

        def row(label, a, b, fmt="{:.3f}"):
            ratio = f"{b / a:.2f}x" if a else "n/a"
            lines.append(f"| {p} | {c} | {k} | {label} | {fmt.format(a)} | {fmt.format(b)} | {ratio} |")

        for phase in PHASES:
            if phase in stock["per_phase_peak_gib"] and phase in ours["per_phase_peak_gib"]:
                # Above what the loaded models hold, as the whole-run row: on CPU the peak RSS includes them
                a = stock["per_phase_peak_gib"][phase] - stock["memory_after_load_gib"]
                b = ours["per_phase_peak_gib"][phase] - ours["memory_after_load_gib"]
                row(f"{phase} peak", a, b)
        row("**whole run**", stock["working_gib"], ours["working_gib"])
        row("median step time (s)", stock["median_step_time_s"], ours["median_step_time_s"], "{:.2f}")
        generation = median_phase_time(stock, "generation"), median_phase_time(ours, "generation")
        if None not in generation:
            row("median generation time (s)", *generation, "{:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results_dir", default="results")
    parser.add_argument("--output", default=None, help="Markdown file (default: <results_dir>/comparison.md)")
    args = parser.parse_args(argv)
    results_dir = Path(args.results_dir)
    runs = load(results_dir)
    paired = [key for key, pair in runs.items() if set(pair) == {"stock", "ours"}]
    if not paired:
        print(f"[compare] no stock/ours pair on the same workload in {results_dir}: run ./run_baseline.sh and "
              f"./run_improved.sh first.")  # fmt: skip
        return 1 if not runs else 0
    any_run = next(iter(runs[paired[0]].values()))
    env = any_run["environment"]
    header = (f"Device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}, trl {env['trl']}; "
              f"commit {str(env['git_commit'])[:10]}. Memory in GiB above what the loaded models hold: peak allocated "
              f"on an accelerator, peak resident set on CPU, minus the same right after loading.")  # fmt: skip
    text = header + "\n\n" + table(runs)
    print(text)
    output = Path(args.output or results_dir / "comparison.md")
    output.write_text(text + "\n")
    print(f"\n[compare] table written to {output}")
    # The same runs as a tidy CSV, for experiments/plot_results.py and the notebook
    import csv

    from sweep import COLUMNS, tidy_rows  # noqa: PLC0415

    csv_path = results_dir / "results.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for key in paired:
            for method, result in runs[key].items():
                writer.writerows(tidy_rows(f"{method}_P{key[0]}_C{key[1]}_k{key[2]}", result))
    print(f"[compare] rows written to {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
