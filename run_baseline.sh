#!/usr/bin/env bash
# Stock trl.RLOOTrainer on the default workload (k = $KS, long prompts), with per-phase memory profiling.
# Extra arguments go to every run (experiments/run_rloo.py --help lists them). Results: results/stock_*.json.
source "$(dirname "$0")/experiments/common.sh"
for k in $KS; do
    run_one stock "$k" "$@"
done
compare
