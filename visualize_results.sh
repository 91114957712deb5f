#!/usr/bin/env bash
# Plots (PNG, next to the CSV) and the summary table from a results CSV: results/results.csv from
# ./run_improved.sh by default, or the CSV you name (for example results/sweep.csv from experiments/sweep.py).
source "$(dirname "$0")/experiments/common.sh"
CSV="${1:-$RESULTS_DIR/results.csv}"
if [ ! -f "$CSV" ]; then
    echo "No $CSV: run ./run_baseline.sh and ./run_improved.sh (or experiments/sweep.py) first." >&2
    exit 1
fi
"$PY" experiments/plot_results.py --csv "$CSV"
# The notebook, run on this CSV into a copy beside it (or open experiments/memory_report.ipynb in your Jupyter)
echo "Notebook: RLOO_RESULTS_CSV=$CSV $VENV/bin/jupyter execute experiments/memory_report.ipynb \\"
echo "    --output memory_report_run   (writes experiments/memory_report_run.ipynb)"
