#!/usr/bin/env bash
# The main job: rloo_efficient on the default workload (k = $KS, long prompts), beside stock TRL on the same
# workload. Baseline results that are missing are produced first; then the side-by-side table.
# Extra arguments go to every run (experiments/run_rloo.py --help lists them). Results: results/{stock,ours}_*.json.
source "$(dirname "$0")/experiments/common.sh"
for k in $KS; do
    run_one stock "$k" --skip_existing true "$@"
    run_one ours "$k" "$@"
done
compare
plots
