"""
What one chunk of a no-grad log-prob pass costs at one row per chunk: stock's forward of the padded row, ours packing
the row on its own (the per-micro-batch tree), and ours reading the row's prompt held by an earlier chunk's source
forward; each synchronized, median of 10 after a burn-in, and the top operators of the held chunk's forward by the
profiler (self device time on a GPU, self CPU time elsewhere). On an H200 at Qwen3-0.6B's shape the held path's
log-prob passes took 2x stock's (results/gpu.md): this finds where a chunk's time goes.

    python experiments/bench_held_overhead.py --preset qwen3-0.6b --prompt_length 3072 --completion_length 256
    python experiments/bench_held_overhead.py            # the tiny model, on any device
    python experiments/bench_held_overhead.py --op_counts   # also the operators each forward dispatches, per layer

Each operator dispatched is a launch or host work on a GPU, where a chunk's forward at this size is bound by them.
"""

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from rloo_efficient.core.forward.packing import pack_rows
from rloo_efficient.core.forward.scope import HeldScope, chunk_tables
from rloo_efficient.core.layers.install import install
from rloo_efficient.core.tree.holds import plan_holds
from rloo_efficient.core.tree.rows import row_groups
from rloo_efficient.demo.workload import WorkloadConfig, build_model_dir
from rloo_efficient.profiling.op_count import ModuleOpCounter, OpCounter


def timed(function, device) -> float:
    samples = []
    for _ in range(11):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--prompt_length", type=int, default=1024)
    parser.add_argument("--completion_length", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=None, help="the model's layers (default: the preset's)")
    parser.add_argument("--op_counts", action="store_true", help="also each forward's operators, per layer")
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    workload = WorkloadConfig(prompt_length=args.prompt_length, **({"preset": args.preset} if args.preset else {}),
                              **({"num_hidden_layers": args.layers} if args.layers else {}))
    model = AutoModelForCausalLM.from_pretrained(build_model_dir(workload), dtype=dtype).to(device).eval()
    add_fused_lm_head(model, outputs=("log_probs",))
    install(model)
    generator = np.random.default_rng(0)
    prompt = generator.integers(3, 200, args.prompt_length).tolist()
    completions = [generator.integers(3, 200, args.completion_length).tolist() for _ in range(args.k)]
    rows = row_groups([prompt] * args.k, [args.completion_length] * args.k, None, completions)
    ids = torch.tensor([prompt + c for c in completions], device=device)
    mask = torch.ones_like(ids)
    width = args.completion_length
    labels = ids.clone()
    labels[:, :-width] = -100
    chunks = [np.array([row]) for row in range(args.k)]
    plan = plan_holds(chunk_tables(rows, chunks), full=False)
    scope = HeldScope(plan, training=False)
    call = lambda **inputs: model(**inputs, fused_lm_head=True)  # noqa: E731
    with torch.no_grad():
        scope.forward_source(plan.chunks[0].source, call, ids.shape[1] - width, device, recurrent=False)

        def stock():
            model(input_ids=ids[1:2], attention_mask=mask[1:2], labels=labels[1:2], fused_lm_head=True)

        def own_tree():
            call(**pack_rows(ids[1:2], width, rows[1:2], recurrent=False).model_inputs())

        def held():
            call(**scope.pack(1, ids[1:2], width, rows[1:2], recurrent=False).model_inputs())

        def source():
            scope.forward_source(plan.chunks[0].source, call, ids.shape[1] - width, device, recurrent=False)

        print(f"# python experiments/bench_held_overhead.py {' '.join(argv if argv is not None else sys.argv[1:])}")
        print(f"# {args.preset or 'tiny llama'} ({dtype}), {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}"
              f"; P={args.prompt_length}, C={width}, one row per chunk; ms, median of 10")  # fmt: skip
        for name, function in (("stock's forward of the padded row", stock), ("ours, the row's own tree", own_tree),
                               ("ours, the row reading its held prompt", held),
                               ("ours, the prompt's source forward", source)):  # fmt: skip
            print(f"| {name} | {1e3 * timed(function, device):.2f} |", flush=True)
        if args.op_counts:
            decoder_layers = model.model.layers
            print(f"\n# operators dispatched by one forward: all of them, and inside each of its {len(decoder_layers)} "
                  "decoder layers (the first's includes what a forward builds once for all; the attention's part of a "
                  "layer is what differs)")  # fmt: skip
            print("| forward | operators | per layer: first, others | top operators, all layers |\n|---|---:|---:|---|")
            for name, function in (("stock's padded row", stock), ("ours, own tree", own_tree), ("ours, held", held),
                                   ("ours, the prompt's source", source)):  # fmt: skip
                with OpCounter() as ops, ModuleOpCounter(decoder_layers) as layer_ops:
                    function()
                top = ", ".join(f"{op.removeprefix('aten::')} {count}" for op, count in layer_ops.counts.most_common(8))
                others = sorted(set(layer_ops.calls[1:]))
                print(f"| {name} | {ops.total} | {layer_ops.calls[0]}, {'/'.join(map(str, others))} | {top} |")
            print()
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])  # fmt: skip
        with torch.profiler.profile(activities=activities) as profile:
            held()
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(profile.key_averages().table(sort_by=key, row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
