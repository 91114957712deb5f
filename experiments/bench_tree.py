"""
Stock TRL vs ours on the shapes RL users run, where a micro-batch's prefix tree, not its groups, is the limit:

- reasoning: 512-token prompts, completions of varied length up to 2,048 tokens (EOS made less likely: a mean of
  about 650), k = 8, one group per micro-batch;
- system prompt: a 2,048-token system prompt shared by every prompt, 200-token tasks, k = 8, 4 tasks a step in one
  micro-batch;
- gradient accumulation: GRPO's defaults, 1,024-token prompts, k = 8, micro-batches of 4 rows, 8 accumulation steps
  (4 groups a step, each split over 2 micro-batches by stock's row shuffle; ours keeps them whole).

Each run is its own process (tiny llama, hidden 128, 2 layers, float32, CPU), stock and ours alternate. Per phase it
reports the tokens the policy and reference forwards were given (stock's padded rows; ours packed), ours against its
prefix trees' real tokens (each shared run once), the phase's peak memory above the loaded models and its time
(median over steps 2-3 and repeats), and the whole run's working memory and step time.

    python experiments/bench_tree.py --repeats 3 --output results/tree.md
    python experiments/bench_tree.py --threshold          # the measurement behind tree.MIN_SAVED_TOKENS
    python experiments/bench_tree.py --buckets            # and behind tree.runs.BUCKET_RATIO
    python experiments/bench_tree.py --kernels --preset qwen3-0.6b   # variable-length calls vs buckets (on a GPU)
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_common import Report, alternate, run_workload


EOS = 2  # the workload's tokenizer
COMMON = ["--hidden_size", "128", "--num_hidden_layers", "2", "--max_steps", "3"]
WORKLOADS = {
    "reasoning": ["--trainer", "rloo", "--prompt_length", "512", "--max_completion_length", "2048",
                  "--num_generations", "8", "--per_device_train_batch_size", "8", "--num_prompts", "8",
                  "--generation_kwargs", f'{{"sequence_bias": [[[{EOS}], -1.0]]}}'],
    "system_prompt": ["--trainer", "rloo", "--system_prompt_length", "2048", "--prompt_length", "200",
                      "--max_completion_length", "128", "--num_generations", "8", "--per_device_train_batch_size", "32",
                      "--num_prompts", "16"],
    "gradient_accumulation": ["--trainer", "grpo", "--prompt_length", "1024", "--max_completion_length", "128",
                              "--num_generations", "8", "--per_device_train_batch_size", "4",
                              "--gradient_accumulation_steps", "8", "--num_prompts", "16"],
}  # fmt: skip
PHASES = ("generation", "reference_logps", "policy_logps", "train")


def phase_times(result: dict) -> dict[str, float]:
    """Each phase's median time over the steps after the first (seconds per step)."""
    steps = result["steps"][1:] or result["steps"]
    return {phase: statistics.median(step["phases"][phase]["time_s"] for step in steps if phase in step["phases"])
            for phase in PHASES if any(phase in step["phases"] for step in steps)}  # fmt: skip


def table(name: str, samples: dict[str, list[dict]]) -> list[str]:
    stock, ours = samples["stock"][0], samples["ours"][0]  # token counts are the same in every repeat
    lines = []
    times = {method: [phase_times(result) for result in results] for method, results in samples.items()}
    for phase in PHASES:
        if phase not in times["stock"][0]:
            continue
        stock_tokens = stock["language_model_tokens"].get(phase, 0)
        ours_tokens = ours["language_model_tokens"].get(phase, 0)
        tree = ours["tree_tokens"].get(phase)
        peak = {method: statistics.median(r["per_phase_peak_gib"][phase] - r["memory_after_load_gib"] for r in results)
                for method, results in samples.items()}  # fmt: skip
        time = {method: statistics.median(t[phase] for t in ts) for method, ts in times.items()}
        ratio = statistics.median(o[phase] / s[phase] for o, s in zip(times["ours"], times["stock"], strict=True))
        lines.append(
            f"| {name} | {phase} | {stock_tokens:,} | {ours_tokens:,} | "
            f"{'' if tree is None else f'{tree:,}'} | {'' if tree is None else f'{ours_tokens / tree:.2f}x'} | "
            f"{peak['stock']:.3f} | {peak['ours']:.3f} | {time['stock']:.2f} | {time['ours']:.2f} | {ratio:.2f}x |"
        )  # fmt: skip
    working = {m: statistics.median(r["working_gib"] for r in rs) for m, rs in samples.items()}
    step = {m: statistics.median(r["median_step_time_s"] for r in rs) for m, rs in samples.items()}
    lines.append(f"| {name} | whole step | | | | | {working['stock']:.3f} | {working['ours']:.3f} | "
                 f"{step['stock']:.2f} | {step['ours']:.2f} | {step['ours'] / step['stock']:.2f}x |")  # fmt: skip
    return lines


def threshold(argv) -> int:
    """Time one packed forward and backward of a tree whose shared node (run `L` tokens, 2 branches) is kept against
    the same rows with it copied into each branch, for `L` around the threshold: where keeping it stops costing."""
    import time

    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from rloo_efficient.core.forward.packing import pack_rows
    from rloo_efficient.core.layers.install import install
    from rloo_efficient.core.tree.rows import row_groups
    from rloo_efficient.demo.workload import WorkloadConfig, build_model_dir

    model = AutoModelForCausalLM.from_pretrained(build_model_dir(WorkloadConfig(prompt_length=512)))
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install(model)
    print(f"# python experiments/bench_tree.py {' '.join(argv)}")
    print("# 8 rows: a run shared by all (L tokens), then 2 task runs of 200 tokens shared by 4 rows each, then 64-token"
          " completions; the first run kept (a tree level) or copied; forward+backward seconds, median of 7")
    print("| L | saved tokens | kept (s) | copied (s) | kept / copied |")
    print("|---:|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    for length in (4, 8, 16, 32, 64, 128, 256):
        shared = torch.randint(3, 250, (length,), generator=generator).tolist()
        tasks = [torch.randint(3, 250, (200,), generator=generator).tolist() for _ in range(2)]
        prompts = [shared + tasks[row // 4] for row in range(8)]
        completions = [torch.randint(3, 250, (64,), generator=generator).tolist() for _ in range(8)]
        ids = torch.tensor([p + c for p, c in zip(prompts, completions, strict=True)])
        rows = row_groups(prompts, [64] * 8, None, completions)
        seconds = {}
        for name, min_saved in (("kept", 1), ("copied", 7 * length + 1)):
            packed = pack_rows(ids, 64, rows, min_saved=min_saved)
            samples = []
            for _ in range(8):
                start = time.perf_counter()
                out = model(**packed.model_inputs(), fused_lm_head=True)
                packed.unpack(out.log_probs).sum().backward()
                samples.append(time.perf_counter() - start)
            seconds[name] = statistics.median(samples[1:])
        print(f"| {length} | {7 * length} | {seconds['kept']:.4f} | {seconds['copied']:.4f} | "
              f"{seconds['kept'] / seconds['copied']:.2f} |", flush=True)  # fmt: skip
    return 0


def buckets(argv) -> int:
    """Time one packed forward and backward of the reasoning shape (a 512-token prompt, 8 completions of very different
    lengths) with the nodes' self-attention bucketed by length within factors of 1.5, 2 and 4, or in one padded call."""
    import time

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from rloo_efficient.core.forward.packing import pack_rows
    from rloo_efficient.core.layers.install import install
    from rloo_efficient.core.tree.layout import LAYOUT_KWARG, tree_layout
    from rloo_efficient.core.tree.rows import row_groups
    from rloo_efficient.demo.workload import WorkloadConfig, build_model_dir

    model = AutoModelForCausalLM.from_pretrained(build_model_dir(WorkloadConfig(prompt_length=512)))
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install(model)
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.geometric(1 / 650, 8), 2048).tolist()
    prompt = rng.integers(3, 250, 512).tolist()
    completions = [rng.integers(3, 250, n).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.tensor([prompt + c + [0] * (width - len(c)) for c in completions])
    packed = pack_rows(ids, width, row_groups([prompt] * 8, lengths, None, completions))
    print(f"# python experiments/bench_tree.py {' '.join(argv)}")
    print(f"# completions of {lengths} tokens after a 512-token prompt; forward+backward seconds, median of 5")
    print("| bucket ratio | self-attention calls per layer | seconds |")
    print("|---:|---:|---:|")
    for ratio in (1.5, 2.0, 4.0, 1e9):
        layout = tree_layout(packed.tree, ids.device, ratio=ratio)[0]
        inputs = {**packed.model_inputs(), LAYOUT_KWARG: layout}
        samples = []
        for _ in range(6):
            start = time.perf_counter()
            out = model(**inputs, fused_lm_head=True)
            packed.unpack(out.log_probs).sum().backward()
            samples.append(time.perf_counter() - start)
        print(f"| {ratio:g} | {len(layout.buckets)} | {statistics.median(samples[1:]):.3f} |", flush=True)
    return 0


def kernels(argv, preset: str | None) -> int:
    """Time one packed forward and backward of the reasoning tree (a 512-token prompt, 8 completions of very different
    lengths), the system-prompt tree (2,048 tokens, 4 tasks of 200, 8 completions of 128 each) and a short prompt (32
    tokens) read by 8 long completions, with the attention's
    parts as variable-length calls (flash's, on CUDA) against padded length buckets, on this machine's device; and
    how far apart their log-probs are (the same attention, other summation orders)."""
    import time

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from rloo_efficient.core.forward.packing import pack_rows
    from rloo_efficient.core.layers.install import install
    from rloo_efficient.core.tree import layout as layouts
    from rloo_efficient.core.tree.layout import LAYOUT_KWARG
    from rloo_efficient.core.tree.rows import row_groups
    from rloo_efficient.demo.workload import WorkloadConfig, build_model_dir

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(preset=preset) if preset else dict(prompt_length=512)
    model = AutoModelForCausalLM.from_pretrained(build_model_dir(WorkloadConfig(**shape)), dtype="auto").to(device)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install(model)
    rng = np.random.default_rng(0)
    tokens = lambda n: rng.integers(3, min(model.config.vocab_size, 30000), n).tolist()  # noqa: E731
    shapes = {}
    lengths = np.minimum(rng.geometric(1 / 650, 8), 2048).tolist()
    shapes["reasoning"] = ([tokens(512)] * 8, [tokens(n) for n in lengths])
    system = tokens(2048)
    tasks = [system + tokens(200) for _ in range(4)]
    shapes["system prompt"] = ([tasks[row // 8] for row in range(32)], [tokens(128) for _ in range(32)])
    # A short prompt read by long completions: a level call with few keys per sequence and many queries
    shapes["short prompt"] = ([tokens(32)] * 8, [tokens(n) for n in np.minimum(rng.geometric(1 / 1500, 8), 2048)])

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    print(f"# python experiments/bench_tree.py {' '.join(argv)}")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"# {preset or 'tiny llama'} ({model.dtype}), {name}, torch {torch.__version__}; forward+backward seconds, "
          "median of 5 after one; peak: tensors (GiB)")  # fmt: skip
    print("| tree | tokens | attention calls | seconds | ratio | peak | max abs log-prob difference |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, (prompts, completions) in shapes.items():
        width = max(len(c) for c in completions)
        ids = torch.tensor([p + c + [0] * (width - len(c)) for p, c in zip(prompts, completions, strict=True)])
        rows = row_groups(prompts, [len(c) for c in completions], None, completions)
        packed = pack_rows(ids.to(device), width, rows)
        results = {}
        for method in ("buckets", "variable-length"):
            varlen = method == "variable-length"
            if varlen and device.type != "cuda":
                print(f"| {name} | {packed.num_tokens} | variable-length: no such kernel on {device.type} | | | | |")
                continue
            original = layouts.VARLEN_DEVICES
            layouts.VARLEN_DEVICES = original if varlen else ()
            try:
                layout = layouts.tree_layout(packed.tree, device)[0]
            finally:
                layouts.VARLEN_DEVICES = original
            inputs = {**packed.model_inputs(), LAYOUT_KWARG: layout}
            samples = []
            for _ in range(6):
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                synchronize()
                start = time.perf_counter()
                log_probs = packed.unpack(model(**inputs, fused_lm_head=True).log_probs)
                log_probs.sum().backward()
                synchronize()
                samples.append(time.perf_counter() - start)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            calls = (f"nodes: 1, levels: {len(layout.packed_parts)}" if varlen else
                     f"nodes: {len(layout.buckets)}, levels: {len(layout.parts)}")  # fmt: skip
            results[method] = (statistics.median(samples[1:]), log_probs.detach().float())
            base = results["buckets"]
            difference = (log_probs.detach().float() - base[1]).abs().max().item()
            print(f"| {name} | {packed.num_tokens} | {method} ({calls}) | {results[method][0]:.4f} | "
                  f"{results[method][0] / base[0]:.2f} | {peak:.2f} | {difference:.2e} |", flush=True)  # fmt: skip
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", default=None, help="Markdown file for the table (default: print only)")
    parser.add_argument("--threshold", action="store_true", help="Measure the node threshold instead.")
    parser.add_argument("--buckets", action="store_true", help="Measure the length buckets' factor instead.")
    parser.add_argument("--kernels", action="store_true",
                        help="Time the tree's attention as variable-length calls against length buckets instead.")
    parser.add_argument("--preset", default=None, help="--kernels: a model shape of rloo_efficient.demo.workload.PRESETS")
    args = parser.parse_args(argv)
    if args.kernels:
        return kernels(argv, args.preset)
    if args.threshold:
        return threshold(argv)
    if args.buckets:
        return buckets(argv)
    report = Report([
        f"# python experiments/bench_tree.py {' '.join(argv)}",
        "# tokens: given to the policy and reference forwards over the run; tree: ours' prefix trees' real tokens; "
        "peak: above the loaded models (GiB); time: per step, median of steps 2-3 (s); medians over repeats",
        "| workload | phase | tokens stock | tokens ours | tree | ours / tree | peak stock | peak ours | time stock | "
        "time ours | time ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ], args.output)  # fmt: skip
    for name in args.workloads:
        with tempfile.TemporaryDirectory() as tmp:
            samples = alternate(lambda method, repeat: run_workload(method, [*WORKLOADS[name], *COMMON], Path(tmp),
                                                                    f"{method}_{name}_{repeat}"), args.repeats)  # fmt: skip
        report.add(*table(name, samples))
    return report.write()


if __name__ == "__main__":
    sys.exit(main())
