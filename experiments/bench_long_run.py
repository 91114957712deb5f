"""
Does profiling scale with the run? Trains our method for --max_steps on the default offline workload with short
prompts (experiments/run_rloo.py, in its own process), then reports what could grow with it: the size of
memory_report.json and of memory_steps.jsonl, the JSONL's line count, and the median step time over the first and the
last --window steps (a profiler that rewrote its whole history at every log would slow the run down as it goes).

    python experiments/bench_long_run.py --max_steps 1000

Arguments after `--` go to experiments/run_rloo.py.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


RUN_ARGS = ["--method", "ours", "--prompt_length", "64", "--max_completion_length", "16", "--num_generations", "2",
            "--per_device_train_batch_size", "2", "--logging_steps", "10", "--save_strategy", "no", "--report_to",
            "none", "--disable_tqdm", "true"]  # fmt: skip


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=1000)
    parser.add_argument("--window", type=int, default=100, help="steps in each of the first and the last windows")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.max_steps < 2 * args.window:
        parser.error("--max_steps must hold two windows of --window steps")

    with tempfile.TemporaryDirectory() as tmp:
        output_dir = Path(tmp) / "out"
        run_args = [*RUN_ARGS, "--max_steps", str(args.max_steps), "--output_dir", str(output_dir), "--results_file",
                    str(Path(tmp) / "result.json"), *extra]  # fmt: skip
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, str(Path(__file__).with_name("run_rloo.py")), *run_args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
            return proc.returncode
        report_path, steps_path = output_dir / "memory_report.json", output_dir / "memory_steps.jsonl"
        report = json.loads(report_path.read_text())
        sizes = report_path.stat().st_size, steps_path.stat().st_size
        with open(steps_path) as f:
            steps = [json.loads(line) for line in f]

    # Wall seconds per optimizer step, from each step's record; medians, so step 1's one-time costs weigh nothing
    first = statistics.median(entry["time_s"] for entry in steps[: args.window])
    last = statistics.median(entry["time_s"] for entry in steps[-args.window :])
    environment = report["environment"]
    print(f"# python experiments/bench_long_run.py {' '.join(argv)}")
    print(f"# which runs: python experiments/run_rloo.py {' '.join(run_args)}")
    print(f"# {environment['device']}, torch {environment['torch']}, trl {environment['trl']}, commit "
          f"{str(environment['git_commit'])[:10]}")
    print("| quantity | value |")
    print("|---|---:|")
    print(f"| optimizer steps (report's num_steps) | {report['num_steps']} |")
    print(f"| memory_report.json (bytes) | {sizes[0]} |")
    print(f"| memory_steps.jsonl (bytes) | {sizes[1]} |")
    print(f"| memory_steps.jsonl (lines) | {len(steps)} |")
    print(f"| timeline segments in the report | {len(report['timeline'])} |")
    print(f"| median step time, steps 1-{args.window} (s) | {first:.4f} |")
    print(f"| median step time, last {args.window} steps (s) | {last:.4f} |")
    print(f"| last / first | {last / first:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
