#!/usr/bin/env bash
# One device session's checks, in one call (the device tool's run), each under its own time limit so that a slow one
# leaves the others their time; every output goes to $OUT (or results/gpu_session/ without it). On the device machine,
# from the project root, after installing the carried wheels (README "On a GPU"):
#
#     bash experiments/gpu_session.sh            # ~10 minutes on an H200
#
# 1. the doctor (versions, every kernel check, stock vs ours on a small model);
# 2. the decoding cost on this GPU across prompt lengths and batch sizes (core/prefix_cache.py BREAK_EVEN_BYTES);
# 3. generate alone: stock, the prompt fanned out, kept once (bf16, Qwen3-0.6B's shape);
# 4. the trainer on the 1.7B workloads (the 0.6B ones are in results/gpu.md);
# 5. the agent workload's generation turn by turn (tool turns continuing each row's cache) at Qwen3-0.6B's shape.
set -uo pipefail
OUT="${OUT:-results/gpu_session}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
run() {  # run LIMIT NAME COMMAND...: the command's output in $OUT/NAME.txt, its exit status reported
    local limit="$1" name="$2"
    shift 2
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "== $name: exit $?"
    grep -E "^\||FAILED|passed|^#" "$OUT/$name.txt" | tail -30
}
run 90 doctor python3 -m rloo_efficient.doctor
run 60 decode_cost_k8 python3 experiments/bench_decode_cost.py --prompt_lengths 256 1024 4096 16384 --k 8
run 60 decode_cost_g8 python3 experiments/bench_decode_cost.py --prompt_lengths 256 1024 4096 --k 8 --groups 8
run 100 generation python3 experiments/bench_generation.py --preset qwen3-0.6b --prompt_lengths 1024 4096 \
    --completion_length 128 --ks 8 16 --repeats 1
run 240 bench_gpu_1.7b python3 experiments/bench_gpu.py --workloads 1.7b --output "$OUT/bench_gpu_1.7b.md"
run 150 agent python3 experiments/bench_agent.py --preset qwen3-0.6b --output "$OUT/agent_0.6b.md"
