#!/usr/bin/env bash
# One device session's checks, in one call (the device tool's run), each under its own time limit so that a slow one
# leaves the others their time; every output goes to $OUT (or results/gpu_session/<today>/ without it, beside the
# committed tables rather than over them). On the device machine,
# from the project root, after installing the carried wheels (README "On a GPU"):
#
#     bash experiments/gpu_session.sh            # the first call: issue 58's rows, most wanted first (9.5 minutes)
#     STEPS="$(bash experiments/gpu_session.sh --list)" ...   # every step: ~63 minutes of limits, several calls
#     STEPS="doctor tree_kernels" bash experiments/gpu_session.sh   # the steps named
#
# The first call's steps (issue 58, device memory): the 0.6B trainer at one row per micro-batch and at k=8, ours then
# stock in one run each with step 2's allocator history by phase (each phase's peak allocated and reserved, and the
# blocks live at the peak by allocation site: experiments/memory_history.py; each run's numbers printed as it ends, so
# that a cut leaves ours', the row still missing: the one-row step was cut after stock's run at 160 s in the fifth
# session), then the 1.7B trainer at P=16384.
#
# Issue 51's steps, after those (each a row of issue 51's "done when" still open after the fourth session,
# results/gpu.md; a step cut by its limit leaves the others their time): the prompt kept once against fanned out under
# graph replay below the one size measured (88 MB per layer and step: core/generation/prompt_cache.py
# REPLAYED_BREAK_EVEN_BYTES), the 0.6B trainer (peak above the fixed state, reserved, step) beside releasing the cache
# after generation (reserved memory above stock's), the 0.6B trainer at one row per micro-batch beside nothing held
# (training holds peaked 4.33 GiB above the fixed state against stock's 1.48), the prompt kept once at 1.7B and
# P=16384, then the 1.7B trainer, and last one chunk's forward at one row (a one-row tree is one attention call per
# layer since 2026-11-28: its operators and time against stock's padded row).
#
# 0. where a chunk's time goes when prompts are held across micro-batches at one row per micro-batch (slower than stock
#    on the H200 at Qwen3-0.6B's shape: results/gpu.md), and the trainer at one and two rows per micro-batch, held and
#    not (on the CPU stand-in for a host-bound GPU, training held dispatched more operators at two rows:
#    results/host_bound.md);
# 1. the doctor (versions, every kernel check incl. the variable-length calls, stock vs ours on a small model);
# 2. the tree's attention as flash's variable-length calls against padded length buckets (time, log-prob difference)
#    at Qwen3-0.6B's shape: the measurement behind the CUDA kernel choice (core/tree/layout.py VARLEN_DEVICES);
# 3. the trainer at 0.6B, k = 8: stock, ours (empty_cache_policy "auto": none on a GPU) and ours releasing the cache
#    after each generation (the earlier default, suspected of the ~1.2 s ours' generation phase spent there);
# 4. the agent workload's generation turn by turn (tool turns continuing each row's cache) at Qwen3-0.6B's shape;
# 5. the decoding cost on this GPU across prompt lengths (core/generation/prompt_cache.py BREAK_EVEN_BYTES);
# 6. the trainer on the 1.7B workloads (never measured yet);
# 7. decoding from static buffers (static_decoding, on by default on CUDA since 2026-11-27) against generate's loop:
#    generation alone (and, at 1.7B and P=16384, with the prompt kept once: its decoding cost under a graph, where no
#    launches are left for the kept-once attention's extra operators to cost), then the trainer;
# 8. the trainer at one row per micro-batch with completions longer than the prompts (P=512, C=1024): the no-grad
#    passes' one-row chunks replayed from CUDA graphs (graph_scoring_passes, since 2026-11-29) against eager;
# 9. issue 58's last row: Qwen3-8B LoRA (r 16) at P=8192, C=1024, k=8, each method's largest micro-batch and its step
#    (experiments/bench_gpu_capacity.py), ours and stock in steps of their own (each its own call: the first builds
#    the 8B model's 16 GB directory).
set -uo pipefail
OUT="${OUT:-results/gpu_session/$(date -u +%Y-%m-%d)}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
FIRST="history_rows1 history_0.6b bench_gpu_1.7b"
REST="capacity_8b_ours capacity_8b_stock static_once_sweep bench_gpu_0.6b bench_gpu_rows1 static_once_1.7b held_overhead doctor bench_gpu_long_rows1 static_once_0.6b bench_gpu_rows2 static_generation tree_kernels agent decode_cost_k8"
if [[ "${1:-}" == "--list" ]]; then echo "$FIRST $REST"; exit 0; fi
STEPS="${STEPS:-$FIRST}"
mkdir -p "$OUT"
run() {  # run LIMIT NAME COMMAND...: the command's output in $OUT/NAME.txt, its exit status reported
    local limit="$1" name="$2"
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    echo "== $name (limit ${limit}s, at $SECONDS s): $*"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "== $name: exit $?"
    grep -E "^\||FAILED|passed|^#" "$OUT/$name.txt" | tail -30
}
run 200 history_rows1 python3 experiments/bench_gpu.py --workloads 0.6b-rows1 --methods ours stock \
    --memory_history "$OUT"
run 140 history_0.6b python3 experiments/bench_gpu.py --workloads 0.6b-k8 --methods ours stock --memory_history "$OUT"
run 90 static_once_0.6b python3 experiments/bench_generation.py --preset qwen3-0.6b --prompt_lengths 3072 \
    --completion_length 256 --ks 8 --methods static static_once --repeats 1 --per_token
run 120 static_once_sweep python3 experiments/bench_generation.py --preset qwen3-0.6b --prompt_lengths 512 1024 2048 \
    --completion_length 128 --ks 4 8 --methods static static_once --repeats 1 --per_token
run 220 bench_gpu_0.6b python3 experiments/bench_gpu.py --workloads 0.6b-k8 --continuous_batching \
    --ablations empty_cache_policy=after_generation \
    --output "$OUT/bench_gpu_0.6b.md"
run 180 bench_gpu_rows1 python3 experiments/bench_gpu.py --workloads 0.6b-rows1 --ablations held_prefix_budget_gib=0 \
    --output "$OUT/bench_gpu_rows1.md"
run 180 static_once_1.7b python3 experiments/bench_generation.py --preset qwen3-1.7b --prompt_lengths 16384 \
    --completion_length 128 --ks 8 --methods static static_once --repeats 1 --per_token
run 230 bench_gpu_1.7b python3 experiments/bench_gpu.py --workloads 1.7b-k8 --output "$OUT/bench_gpu_1.7b.md"
run 560 capacity_8b_ours python3 experiments/bench_gpu_capacity.py --methods ours --output "$OUT/capacity_8b_ours.md"
run 560 capacity_8b_stock python3 experiments/bench_gpu_capacity.py --methods stock --output "$OUT/capacity_8b_stock.md"
run 60 held_overhead python3 experiments/bench_held_overhead.py --op_counts --preset qwen3-0.6b --prompt_length 3072 \
    --completion_length 256
run 240 bench_gpu_long_rows1 python3 experiments/bench_gpu.py --workloads 0.6b-long-rows1 \
    --ablations graph_scoring_passes=False --output "$OUT/bench_gpu_long_rows1.md"
run 300 bench_gpu_rows2 python3 experiments/bench_gpu.py --workloads 0.6b-rows2 --ablations held_prefix_budget_gib=0 \
    --output "$OUT/bench_gpu_rows2.md"
run 150 static_generation python3 experiments/bench_generation.py --preset qwen3-0.6b --prompt_lengths 3072 \
    --completion_length 256 --ks 8 --methods fan_out static static_eager --repeats 1 --per_token
run 300 doctor python3 -m rloo_efficient.doctor --liger --torch_compile
run 90 tree_kernels python3 experiments/bench_tree.py --kernels --preset qwen3-0.6b
run 120 agent python3 experiments/bench_agent.py --preset qwen3-0.6b --output "$OUT/agent_0.6b.md"
run 60 decode_cost_k8 python3 experiments/bench_decode_cost.py --prompt_lengths 256 1024 4096 16384 --k 8
