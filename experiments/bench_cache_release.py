"""
The effect and cost of `empty_cache_policy` on one workload: each policy runs --repeats times, each run in its own
process (a fresh heap, so one run's cache cannot lower another's peak). Prints medians of whole-run working memory
(peak minus after-load), step time and time spent releasing per step.

    python experiments/bench_cache_release.py --repeats 3 -- --prompt_length 2048 --num_generations 8
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


POLICIES = ("none", "after_generation", "every_phase")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--method", default="ours", choices=["ours"])
    parser.add_argument("run_args", nargs="*", help="passed to experiments/run_rloo.py (after --)")
    args = parser.parse_args(argv)
    run_args = args.run_args or ["--prompt_length", "2048", "--max_completion_length", "64", "--num_generations", "8",
                                 "--per_device_train_batch_size", "8", "--max_steps", "3"]  # fmt: skip
    common = ["--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]
    rows = {policy: [] for policy in POLICIES}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for policy in POLICIES:  # interleaved, so drift on a shared machine hits every policy alike
                out = Path(tmp) / f"{policy}_{repeat}.json"
                cmd = [sys.executable, "experiments/run_rloo.py", "--method", args.method, "--empty_cache_policy",
                       policy, "--results_file", str(out), "--output_dir", str(Path(tmp) / "out"), *common, *run_args]  # fmt: skip
                subprocess.run(cmd, check=True, capture_output=True)
                result = json.loads(out.read_text())
                release = [sum(p.get("release_s", 0.0) for p in s["phases"].values()) for s in result["steps"]]
                rows[policy].append((result["working_gib"], result["median_step_time_s"], statistics.mean(release)))
                print(f"[bench_cache_release] repeat {repeat} {policy}: working {result['working_gib']:.3f} GiB, "
                      f"step {result['median_step_time_s']:.2f}s", file=sys.stderr)  # fmt: skip
    print(f"# python experiments/bench_cache_release.py --repeats {args.repeats} -- {' '.join(run_args)}")
    print("| empty_cache_policy | working memory (GiB) | vs none | step time (s) | vs none | release time per step (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    base_mem = statistics.median(r[0] for r in rows["none"])
    base_time = statistics.median(r[1] for r in rows["none"])
    for policy in POLICIES:
        mem = statistics.median(r[0] for r in rows[policy])
        step = statistics.median(r[1] for r in rows[policy])
        release = statistics.median(r[2] for r in rows[policy]) * 1000
        print(f"| {policy} | {mem:.3f} | {mem / base_mem:.2f}x | {step:.2f} | {step / base_time:.2f}x | {release:.1f} |")


if __name__ == "__main__":
    main()
