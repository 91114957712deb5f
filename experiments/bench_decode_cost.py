"""
What reading a prompt once per group costs and saves in one decoding step of one attention layer, on this device: the
constants of [`rloo_efficient.core.generation.prompt_cache`] (`BREAK_EVEN_BYTES`).

Each row's query over [its prompt | its own t tokens], two ways:
- fanned out: one attention call over the row's copy of the prompt and its own keys (as stock's cache holds them);
- kept once: the split attention ([`core.attention.backend.split_attention`]): the group's rows against the prompt
  stored once, each row against its own keys, merged by log-sum-exp.

The split costs a second call and the merge; it saves reading the fanned-out copies of the prompt's keys and values.
The last line gives the bytes saved per layer and step between which kept once turns faster (the break-even the cost
model uses for this device type).

    python experiments/bench_decode_cost.py                       # Qwen3-0.6B's attention shape, k=8, one group
    python experiments/bench_decode_cost.py --dtype float32 --heads 4 --kv_heads 2 --head_dim 32
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from rloo_efficient.core.attention.backend import SplitLayout, split_attention
from rloo_efficient.core.attention.checks import attention_forward


def timed(fn, device, seconds: float = 0.3) -> float:
    """Median seconds per call over batches of calls filling about `seconds` (after a warm-up)."""
    for _ in range(5):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds / 3:
        fn()
        calls += 1
    sync()
    batch = max(1, calls)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / batch)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt_lengths", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--own", type=int, default=128, help="tokens each row has decoded so far")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    groups, rows = args.groups, args.groups * args.k
    heads, kv_heads, dim, own = args.heads, args.kv_heads, args.head_dim, args.own
    scale = dim**-0.5
    width = torch.finfo(dtype).bits // 8
    print(f"# python experiments/bench_decode_cost.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{dtype}, {heads}/{kv_heads} heads, head_dim {dim}, {groups} group(s) of {args.k}, {own} own tokens; "
          "per layer and decoding step, median")  # fmt: skip
    print("| prompt | fanned out (us) | kept once (us) | kept / fanned | bytes saved (MB) |")
    print("|---:|---:|---:|---:|---:|")
    saved, gains = [], []
    for length in args.prompt_lengths:
        make = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
        query = make(rows, 1, heads, dim).transpose(1, 2)  # token-major, as the model hands it over
        prompt_key, prompt_value = make(groups, kv_heads, length, dim), make(groups, kv_heads, length, dim)
        key, value = make(rows, kv_heads, own, dim), make(rows, kv_heads, own, dim)
        index = torch.arange(groups, device=device).repeat_interleave(args.k)
        fanned_key = torch.cat([prompt_key[index], key], 2)
        fanned_value = torch.cat([prompt_value[index], value], 2)
        split = SplitLayout(groups, args.k, args.k, None, None, None)
        fanned = timed(lambda: F.scaled_dot_product_attention(query, fanned_key, fanned_value, scale=scale,
                                                                enable_gqa=True), device)  # fmt: skip
        attention_forward(query, key, value, None, False, scale)  # the first-use checks, outside the timing
        kept = timed(lambda: split_attention(query, prompt_key, prompt_value, key, value, split, scale), device)
        bytes_saved = (rows - groups) * length * kv_heads * dim * 2 * width
        saved.append(bytes_saved)
        gains.append(fanned - kept)
        print(f"| {length} | {fanned * 1e6:.1f} | {kept * 1e6:.1f} | {kept / fanned:.2f} | {bytes_saved / 1e6:.2f} |",
              flush=True)  # fmt: skip
    # Where kept once turns faster: between the last length where it is slower and the next one
    slower = [bytes_saved for bytes_saved, gain in zip(saved, gains) if gain < 0]
    faster = [bytes_saved for bytes_saved in saved if not slower or bytes_saved > max(slower)]
    below = f"{max(slower) / 1e6:.2f}" if slower else "-"
    above = f"{min(faster) / 1e6:.2f}" if faster else "-"
    print(f"# kept once is slower up to {below} MB saved per layer and step, faster from {above} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
