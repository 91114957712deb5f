"""
The generation phase of one prompt group (k rows of one P-token prompt, C new tokens): stock TRL's `generate` from
k copies vs ours (`generate_with_shared_prefill`): the shared prefill with the prompt's cache fanned out to the k
rows (`fan_out`), the same decoded from static buffers (`static`: `core.generation.static_decode`, its step captured
as a CUDA graph on a GPU; `static_eager`: not captured), and with the prompt's cache kept once per group
(`cache_once`; `static_once`: that decoded from static buffers). Reports the peak tensor memory above the loaded
model (on CPU the exact peak of live tensor bytes, from the profiler's allocation events; on an accelerator the
allocator's peak allocated) and time (median of --repeats after a burn-in, without the profiler), and checks that
both give the same completions from the same seed. No EOS: every row decodes C tokens, so both do the same decoding
work.

    python experiments/bench_generation.py --prompt_lengths 512 2048 --completion_length 64 --ks 2 4 8
    python experiments/bench_generation.py --preset qwen3-0.6b --prompt_lengths 3072 --completion_length 128 \
        --ks 8 --repeats 1 --release     # on a GPU: also each method right after the allocator's cache is emptied

`--per_token` adds each method's decoding time per token, `(time of C tokens - time of 1) / (C - 1)`, beside the time
the bytes each decoding step must read take at the device's bandwidth (the weights, and every row's keys and values
at the middle of the completion: k copies of the prompt's, as a fanned-out cache holds them; the bandwidth measured by
a device-to-device copy of 1 GiB on an accelerator, a host copy of 256 MiB on CPU): the floor a step could reach.

`--release` adds each method run right after `release_cached_memory` (what `empty_cache_policy` does at a phase
boundary), so that allocations the call makes cannot reuse cached blocks.
"""

import itertools
import statistics
import sys
import time

import torch
from bench_common import parser_for
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, GenerationConfig

from rloo_efficient.core.generation import static_decode
from rloo_efficient.core.generation.generate import generate_with_shared_prefill
from rloo_efficient.core.generation.prompt_cache import kv_token_bytes
from rloo_efficient.demo.workload import WorkloadConfig, build_model_dir
from rloo_efficient.profiling.memory import is_accelerator, release_cached_memory


MIB = 1024**2


METHODS = ("stock", "fan_out", "static", "static_eager", "cache_once", "static_once")


def generate(method, model, input_ids, attention_mask, config):
    if method == "stock":
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    once = method in ("cache_once", "static_once")
    devices = static_decode.CAPTURE_DEVICES
    if method == "static_eager":
        static_decode.CAPTURE_DEVICES = ()
    try:
        return generate_with_shared_prefill(model, input_ids, attention_mask, prompt_cache_once=once,
                                            static=method.startswith("static"), generation_config=config)[0]  # fmt: skip
    finally:
        static_decode.CAPTURE_DEVICES = devices


def peak_tensor_bytes(fn, device) -> int:
    """Peak bytes of live tensors while `fn` runs, above those live when it starts."""
    if is_accelerator(device):
        torch.accelerator.synchronize()
        torch.accelerator.reset_peak_memory_stats()
        start = torch.accelerator.memory_allocated()
        fn()
        torch.accelerator.synchronize()
        return torch.accelerator.max_memory_allocated() - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return max(itertools.accumulate((n for _, n in events), initial=0))


def measure(method, model, input_ids, attention_mask, config, repeats, release=False):
    device = input_ids.device
    torch.manual_seed(0)
    sequences = generate(method, model, input_ids, attention_mask, config)  # burn-in, and the completions compared
    peak_bytes = peak_tensor_bytes(lambda: generate(method, model, input_ids, attention_mask, config), device)
    times = []
    for _ in range(repeats):
        if release:
            release_cached_memory(device)
        start = time.perf_counter()
        generate(method, model, input_ids, attention_mask, config)
        if is_accelerator(device):
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return sequences, peak_bytes, statistics.median(times)


def copy_bandwidth(device) -> float:
    """Bytes per second a device-to-device copy moves (read and write both counted), the median of 5."""
    size = (1 << 30) if is_accelerator(device) else (256 << 20)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(5):
        if is_accelerator(device):
            torch.accelerator.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        if is_accelerator(device):
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * size / statistics.median(times)


def step_bytes(model, rows: int, prompt_length: int, completion_length: int) -> int:
    """What one decoding step reads at least: every parameter, and each row's keys and values at the middle of its
    completion (a fanned-out cache: every row its own copy of the prompt's)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    token = kv_token_bytes(model.config.get_text_config(decoder=True), model.dtype.itemsize)
    return weights + rows * (prompt_length + completion_length // 2) * token


def main(argv=None):
    parser = parser_for(__doc__, prompt_lengths=[512, 2048], completion_length=64, ks=[2, 4, 8], repeats=3)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="stock is always run")
    parser.add_argument("--preset", default=None, help="a model shape of rloo_efficient.demo.workload.PRESETS")
    parser.add_argument("--release", action="store_true", help="also time each method after emptying the cache")
    parser.add_argument("--per_token", action="store_true", help="also each method's decoding time per token, "
                        "beside what the bytes a step reads take at the device's bandwidth")  # fmt: skip
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the model's dtype (auto: the saved one)")
    args = parser.parse_args(argv)
    args.methods = ["stock", *(m for m in args.methods if m != "stock")]

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = build_model_dir(WorkloadConfig(preset=args.preset))  # the default tiny model, or a preset's shape
    model = AutoModelForCausalLM.from_pretrained(path, dtype=args.dtype).to(device).eval()
    vocab = model.config.vocab_size
    config = GenerationConfig(max_new_tokens=args.completion_length, min_new_tokens=args.completion_length,
                              do_sample=True, pad_token_id=0, eos_token_id=None)  # fmt: skip

    print(f"# {' '.join(['python', 'experiments/bench_generation.py', *(argv if argv is not None else sys.argv[1:])])}")
    print(f"# device {device}, torch {torch.__version__}, model {path} ({model.dtype}); time: median of "
          f"{args.repeats} after a burn-in; tensor peak: above the loaded model")  # fmt: skip
    print("| P | C | k | method | same completions as stock | tensor peak (MiB) | ratio | time (s) | ratio |")
    print("|---:|---:|---:|---|:---:|---:|---:|---:|---:|")
    c = args.completion_length
    for p, k in itertools.product(args.prompt_lengths, args.ks):
        generator = torch.Generator().manual_seed(p * 100 + k)
        prompt = torch.randint(3, vocab, (p,), generator=generator)
        input_ids = prompt.expand(k, -1).contiguous().to(device)
        attention_mask = torch.ones_like(input_ids)
        results = {m: measure(m, model, input_ids, attention_mask, config, args.repeats) for m in args.methods}
        if args.release:
            results.update({f"{m}, cache emptied": measure(m, model, input_ids, attention_mask, config, args.repeats,
                                                           release=True) for m in args.methods})  # fmt: skip
        seq_s, mem_s, t_s = results["stock"]
        for method, (seq, mem, t) in results.items():
            same = "yes" if torch.equal(seq, seq_s) else "NO"
            print(f"| {p} | {c} | {k} | {method} | {same} | {mem / MIB:.1f} | {mem / mem_s:.3f} | {t:.3f} | "
                  f"{t / t_s:.3f} |", flush=True)  # fmt: skip
        if args.per_token and c > 1:
            one = GenerationConfig(max_new_tokens=1, do_sample=True, pad_token_id=0, eos_token_id=None)
            floor = step_bytes(model, k, p, c) / copy_bandwidth(device)
            print(f"\n# P={p}, k={k}: decoding per token, (time of {c} tokens - time of 1) / {c - 1}; the floor: "
                  f"{step_bytes(model, k, p, c) / 1e6:.1f} MB a step reads at the copy bandwidth")  # fmt: skip
            print("| method | ms per token | floor (ms) | ratio to the floor |\n|---|---:|---:|---:|")
            for method in args.methods:
                first = measure(method, model, input_ids, attention_mask, one, args.repeats)[2]
                per_token = (results[method][2] - first) / (c - 1)
                print(f"| {method} | {per_token * 1e3:.3f} | {floor * 1e3:.3f} | {per_token / floor:.1f} |",
                      flush=True)  # fmt: skip
            print()

if __name__ == "__main__":
    main()
