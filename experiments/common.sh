# Shared by run_baseline.sh and run_improved.sh: the environment and the default workload.
# The default workload: long prompts, 64-token completions, k = 2, 4, 8, on the offline tiny model.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
KS="${KS:-2 4 8}"
PROMPT_LENGTH="${PROMPT_LENGTH:-2048}"
COMPLETION_LENGTH="${COMPLETION_LENGTH:-64}"
MAX_STEPS="${MAX_STEPS:-3}"
# REWARD_MODEL=separate|hydra: score with a reward model shaped like the policy (its own results directory)
REWARD_MODEL="${REWARD_MODEL:-none}"
if [ "$REWARD_MODEL" = none ]; then
    RESULTS_DIR="${RESULTS_DIR:-results}"
else
    RESULTS_DIR="${RESULTS_DIR:-results/reward_model_$REWARD_MODEL}"
fi

if [ ! -f "$VENV/.rloo_efficient_installed" ]; then
    echo "[setup] no environment at $VENV: running setup_env.sh"
    VENV="$VENV" "$ROOT/setup_env.sh"
fi
PY="$VENV/bin/python"
export TOKENIZERS_PARALLELISM=false
# NPROC=N and/or ACCELERATE_CONFIG=file: each run on N processes. On GPUs through `accelerate launch` (data parallel,
# or the config's FSDP / DeepSpeed setup: experiments/accelerate_configs/); on CPU through torch.distributed.run
# (data parallel over gloo: accelerate launches a single process on CPU)
NPROC="${NPROC:-}"
ACCELERATE_CONFIG="${ACCELERATE_CONFIG:-}"
if [ -n "$ACCELERATE_CONFIG" ] || { [ -n "$NPROC" ] && "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; }; then
    LAUNCH=("$VENV/bin/accelerate" launch)
    [ -n "$NPROC" ] && LAUNCH+=(--num_processes "$NPROC")
    [ -n "$ACCELERATE_CONFIG" ] && LAUNCH+=(--config_file "$ACCELERATE_CONFIG")
elif [ -n "$NPROC" ]; then
    LAUNCH=("$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_port "${MASTER_PORT:-29511}")
else
    LAUNCH=("$PY")
fi

# run_one METHOD K [extra args...]: one training run through experiments/run_rloo.py
run_one() {
    local method="$1" k="$2"
    shift 2
    echo "[run] $method k=$k P=$PROMPT_LENGTH C=$COMPLETION_LENGTH steps=$MAX_STEPS reward_model=$REWARD_MODEL processes=${NPROC:-1}"
    "${LAUNCH[@]}" experiments/run_rloo.py --method "$method" \
        --prompt_length "$PROMPT_LENGTH" --max_completion_length "$COMPLETION_LENGTH" \
        --num_generations "$k" --per_device_train_batch_size "$k" --max_steps "$MAX_STEPS" \
        --logging_steps 1 --save_strategy no --report_to none --reward_model "$REWARD_MODEL" \
        --results_file "$RESULTS_DIR/${method}_P${PROMPT_LENGTH}_C${COMPLETION_LENGTH}_k${k}.json" "$@"
}

compare() {
    "$PY" experiments/compare.py --results_dir "$RESULTS_DIR"
}

plots() {
    if [ -f "$RESULTS_DIR/results.csv" ]; then
        "$PY" experiments/plot_results.py --csv "$RESULTS_DIR/results.csv"
    fi
}
