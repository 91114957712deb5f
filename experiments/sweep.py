"""
Stock trl.RLOOTrainer and rloo_efficient over k and prompt lengths, each run in its own process (so one's memory
cannot leak into the other's peak), same workload and seed. Writes one tidy CSV, a row per (run, step, phase,
metric), appended after every finished run: an interrupted sweep keeps what finished, and a rerun skips it.

    python experiments/sweep.py --ks 2 4 8 --prompt_lengths 512 2048 --csv results/sweep.csv

Arguments after `--` go to every run (experiments/run_rloo.py --help lists them).
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


COLUMNS = ["run_id", "method", "k", "prompt_length", "completion_length", "step", "phase", "metric", "value",
           "device", "torch", "transformers", "trl", "git_commit", "time_of_run"]  # fmt: skip


def run_id(method: str, prompt_length: int, completion_length: int, k: int, extra: list[str]) -> str:
    suffix = ("_" + "_".join(a.lstrip("-") for a in extra)) if extra else ""
    return f"{method}_P{prompt_length}_C{completion_length}_k{k}{suffix}"


def finished_runs(csv_path: Path) -> set[str]:
    if not csv_path.exists():
        return set()
    with open(csv_path, newline="") as f:
        return {row["run_id"] for row in csv.DictReader(f)}


def tidy_rows(rid: str, result: dict) -> list[dict]:
    env = result["environment"]
    base = {"run_id": rid, "method": result["method"], "k": result["k"], "prompt_length": result["prompt_length"],
            "completion_length": result["completion_length"], "device": env["device"], "torch": env["torch"],
            "transformers": env["transformers"], "trl": env["trl"], "git_commit": env["git_commit"],
            "time_of_run": result["time_of_run"]}  # fmt: skip
    rows = []
    after_load = result["memory_after_load_gib"]
    for entry in result["steps"]:
        for phase, record in entry["phases"].items():
            for metric, value in record.items():
                rows.append({**base, "step": entry["step"], "phase": phase, "metric": metric, "value": value})
    for index, time_s in enumerate(result["step_times_s"], start=1):
        rows.append({**base, "step": index, "phase": "step", "metric": "step_time_s", "value": time_s})
    rows.append({**base, "step": 0, "phase": "run", "metric": "memory_after_load_gib", "value": after_load})
    rows.append({**base, "step": 0, "phase": "run", "metric": "working_gib", "value": result["working_gib"]})
    rows.append({**base, "step": 0, "phase": "run", "metric": "peak_gib", "value": result["peak_gib"]})
    for phase, value in result["per_phase_peak_gib"].items():  # the whole run's peak_gib of each phase
        rows.append({**base, "step": 0, "phase": phase, "metric": "peak_gib", "value": value})
    # The memory timeline of the run: one row per field of each phase segment, `step` = segment index
    for index, segment in enumerate(result.get("timeline", [])):
        for metric, value in segment.items():
            if metric not in ("phase", "step"):
                rows.append({**base, "step": index, "phase": segment["phase"], "metric": f"timeline/{metric}",
                             "value": value})  # fmt: skip
    return rows


def append_rows(csv_path: Path, rows: list[dict]) -> None:
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    new = not csv_path.exists()
    with open(csv_path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerows(rows)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--prompt_lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["stock", "ours"], choices=["stock", "ours"])
    parser.add_argument("--csv", default="results/sweep.csv")
    parser.add_argument("--rerun", action="store_true", help="run again the runs the CSV already holds")
    args = parser.parse_args(argv)
    for value in [*args.ks, *args.prompt_lengths, args.completion_length, args.max_steps]:
        if value < 1:
            parser.error("k, prompt lengths, completion length and steps must be positive")

    csv_path = Path(args.csv)
    done = set() if args.rerun else finished_runs(csv_path)
    plan = [(p, k, m) for p in args.prompt_lengths for k in args.ks for m in args.methods]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        for index, (p, k, method) in enumerate(plan, start=1):
            rid = run_id(method, p, args.completion_length, k, extra)
            if rid in done:
                print(f"[sweep {index}/{len(plan)}] {rid}: in {csv_path} already, skipped", flush=True)
                continue
            start = time.perf_counter()
            print(f"[sweep {index}/{len(plan)}] {rid}: running...", flush=True)
            out = Path(tmp) / f"{rid}.json"
            cmd = [sys.executable, str(Path(__file__).with_name("run_rloo.py")), "--method", method,
                   "--prompt_length", str(p), "--max_completion_length", str(args.completion_length),
                   "--num_generations", str(k), "--per_device_train_batch_size", str(k), "--max_steps",
                   str(args.max_steps), "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
                   "--disable_tqdm", "true", "--results_file", str(out), "--output_dir", str(Path(tmp) / "out"),
                   *extra]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
                print(f"[sweep] {rid} failed (exit {proc.returncode}); finished runs are in {csv_path}", file=sys.stderr)
                return proc.returncode
            result = json.loads(out.read_text())
            append_rows(csv_path, tidy_rows(rid, result))
            print(f"[sweep {index}/{len(plan)}] {rid}: working {result['working_gib']:.3f} GiB, median step "
                  f"{result['median_step_time_s']:.2f}s ({time.perf_counter() - start:.0f}s)", flush=True)  # fmt: skip
    print(f"[sweep] rows in {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
