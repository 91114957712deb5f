"""What the stock-vs-ours benchmarks share: one run of `run_rloo.py` in its own process."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent


def run_workload(method: str, arguments: list[str], directory: Path, name: str, threads: int | None = None) -> dict:
    """Runs `run_rloo.py --method <method> <arguments>` in a fresh process (its peak resident set is the run's own),
    logging every step and saving nothing, and returns the results file it writes. A failed run stops the benchmark
    with the end of its stderr. `threads`: the process's compute threads (runs side by side must not oversubscribe
    the cores: each would be several times slower)."""
    results = directory / f"{name}.json"
    command = [
        sys.executable, str(HERE / "run_rloo.py"), "--method", method, *arguments,
        "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
        "--results_file", str(results), "--output_dir", str(directory / "out" / name),
    ]  # fmt: skip
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{name} failed (exit {done.returncode})")
    return json.loads(results.read_text())


def alternate(run, repeats: int, methods=("stock", "ours")) -> dict[str, list]:
    """Each method's results over `repeats` rounds, `run(method, repeat)` called stock then ours in every round: a drift
    of the machine (another job, a clock) hits both alike."""
    samples = {method: [] for method in methods}
    for repeat in range(repeats):
        for method in methods:
            samples[method].append(run(method, repeat))
    return samples


class Report:
    """A benchmark's Markdown table: the header (the command, what the numbers are, the table's head) printed at once,
    each row printed as it comes, and the whole written to `output` (a path, or None: printed only) at the end."""

    def __init__(self, header: list[str], output: str | None = None):
        self.lines, self.output = list(header), output
        print("\n".join(self.lines), flush=True)

    def add(self, *lines: str) -> None:
        self.lines += lines
        print("\n".join(lines), flush=True)

    def write(self) -> int:
        if self.output:
            Path(self.output).write_text("\n".join(self.lines) + "\n")
        return 0


def parser_for(doc: str, *, prompt_lengths=None, prompt_length=None, completion_length=None, ks=None, k=None,
               repeats=None, output: bool = False) -> argparse.ArgumentParser:  # fmt: skip
    """A benchmark's argument parser (its docstring as the help), with the workload-shape arguments whose default is
    given: prompt lengths, completion length, k's, repeats, and `--output` for the table's Markdown file."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default, many in (("prompt_lengths", prompt_lengths, True), ("prompt_length", prompt_length, False),
                                ("completion_length", completion_length, False), ("ks", ks, True), ("k", k, False),
                                ("repeats", repeats, False)):  # fmt: skip
        if default is not None:
            parser.add_argument(f"--{name}", type=int, default=default, **({"nargs": "+"} if many else {}))
    if output:
        parser.add_argument("--output", default=None, help="Markdown file for the table (default: print only)")
    return parser
