"""What the stock-vs-ours benchmarks share: one run of `run_rloo.py` in its own process."""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_workload(method: str, arguments: list[str], directory: Path, name: str) -> dict:
    """Runs `run_rloo.py --method <method> <arguments>` in a fresh process (its peak resident set is the run's own),
    logging every step and saving nothing, and returns the results file it writes. A failed run stops the benchmark
    with the end of its stderr."""
    results = directory / f"{name}.json"
    command = [
        sys.executable, str(HERE / "run_rloo.py"), "--method", method, *arguments,
        "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
        "--results_file", str(results), "--output_dir", str(directory / "out"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{name} failed (exit {done.returncode})")
    return json.loads(results.read_text())
