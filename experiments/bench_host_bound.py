"""
What a small micro-batch costs the host, stock TRL vs ours, per phase. At one or two rows per micro-batch a GPU runs
each forward faster than the host can hand it the operators (results/gpu.md: Qwen3-0.6B's shape on an H200), so a
step's time there is the host's: the operators it dispatches and the Python around them. This measures that on CPU:
a deep, narrow model (28 layers, hidden 64) on short sequences, so that each forward's time is its dispatch.

Ours runs its GPU path: the variable-length calls flash runs on CUDA (the held prompt's keys folded into each row's
call) instead of CPU's padded buckets. Their kernel is a stand-in here (zeros, one allocation: what a launch costs the
host; the values are not flash's, so no completion is scored), counted as one operator; stock's SDPA runs as it is.
Every completion is `--completion_length` tokens (no EOS), so both run the same shapes.

Per phase, for each micro-batch (the reference pass's chunks; training's micro-batches): the operators dispatched
that run a kernel (views and bare allocations left out), all of them, and the time; the step's time. Median over the
steps after the first and the repeats, stock and ours alternating in one process.

    python experiments/bench_host_bound.py --rows 1 2 --repeats 3 --output results/host_bound.md
    python experiments/bench_host_bound.py --rows 2 --ours_args="--held_prefix_budget_gib 0"  # nothing held
"""

import argparse
import collections
import contextlib
import shlex
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_rloo  # noqa: E402

from rloo_efficient.core.attention import checks as kernel_checks  # noqa: E402
from rloo_efficient.core.attention.kernels import KernelState  # noqa: E402
from rloo_efficient.core.tree import layout as layouts  # noqa: E402
from rloo_efficient.profiling import phase_profiler  # noqa: E402
from rloo_efficient.profiling.op_count import OpCounter  # noqa: E402


PHASES = ("reference_logps", "train")
ROWS = 16  # per generation batch: 2 prompts x k = 8


class PhaseOps(OpCounter):
    """Operators per innermost profiled phase; none while `paused` (inside a stand-in kernel)."""

    def __init__(self):
        super().__init__()
        self.phase = ["other"]
        self.by_phase = collections.defaultdict(OpCounter)
        self.paused = 0

    def add(self, name: str, launching: bool = True) -> None:
        counter = self.by_phase[self.phase[-1]]
        counter.counts[name] += 1
        if not launching:
            counter.metadata[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = func._overloadpacket.__name__
            self.add(f"aten::{name}", not (func.is_view or name in ("empty", "empty_like", "empty_strided",
                                                                       "new_empty", "new_empty_strided")))  # fmt: skip
        return func(*args, **(kwargs or {}))


COUNTER: PhaseOps | None = None


def gpu_path() -> None:
    """Our layouts carry the variable-length calls, whose kernel is a one-operator stand-in."""
    layouts.VARLEN_DEVICES = ("cpu",)
    kernel_checks.varlen_kernel = lambda query: "stand-in"
    kernel_checks._usable = lambda config: True  # (its first-use check compares values: the stand-in has none)

    def counted(name, function):
        def call(*args, **kwargs):
            if COUNTER is None:
                return function(*args, **kwargs)
            COUNTER.add(name)
            COUNTER.paused += 1
            try:
                return function(*args, **kwargs)
            finally:
                COUNTER.paused -= 1

        return call

    def forward(kernel, query, key, value, cu_q, cu_k, max_q, max_k, causal, scale, window=None, config=()):
        lse = query.new_zeros(query.shape[1], query.shape[0], dtype=torch.float32)
        return torch.zeros_like(query), lse, KernelState(kernel, config, (cu_q, cu_k), window=window)

    def backward(state, grad_out, query, key, value, out, lse, causal, scale):
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)

    kernel_checks.varlen_forward = counted("aten::_flash_attention_forward", forward)
    kernel_checks.varlen_backward = counted("aten::_flash_attention_backward", backward)
    profiled = phase_profiler.PhaseProfiler.phase

    @contextlib.contextmanager
    def phase(self, name, evaluating=False):
        if COUNTER is not None:
            COUNTER.phase.append(name)
        try:
            with profiled(self, name, evaluating):
                yield
        finally:
            if COUNTER is not None:
                COUNTER.phase.pop()

    phase_profiler.PhaseProfiler.phase = phase


def run(method: str, rows: int, args) -> dict:
    global COUNTER
    steps = ROWS // rows
    extra = shlex.split(args.ours_args) if method == "ours" else []
    argv = ["--method", method, "--trainer", "grpo", "--arch", "qwen3", "--num_hidden_layers", str(args.layers),
            "--hidden_size", "64", "--intermediate_size", "64", "--prompt_length", str(args.prompt_length),
            "--num_generations", "8", "--num_prompts", "16", "--max_completion_length", str(args.completion_length),
            "--generation_kwargs", f'{{"min_new_tokens": {args.completion_length}}}', "--max_steps", str(args.steps),
            "--beta", "0.05", "--bf16", "false", "--per_device_train_batch_size", str(rows),
            "--gradient_accumulation_steps", str(steps), "--steps_per_generation", str(steps),
            "--save_strategy", "no", "--report_to", "none", "--logging_steps", "1",
            "--disable_tqdm", "true", *extra]  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        COUNTER = PhaseOps()
        try:
            with COUNTER:
                result = run_rloo.main([*argv, "--output_dir", out, "--results_file", f"{out}/results.json"])
        finally:
            counted, COUNTER = COUNTER, None
    later = result["steps"][1:]
    micro_batches = {"reference_logps": steps * args.steps, "train": steps * args.steps}
    phases = {}
    for phase in PHASES:
        ops = counted.by_phase[phase]
        per = micro_batches[phase]
        time_ms = 1e3 * statistics.median(s["phases"][phase]["time_s"] for s in later) / steps
        phases[phase] = {"launching": ops.launching / per, "all": ops.total / per, "ops": ops, "per": per,
                         "time_ms": time_ms}  # fmt: skip
    phases["step"] = {"time_ms": 1e3 * result["median_step_time_s"]}
    return phases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument("--completion_length", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=0, help="also the operators ours dispatches more, per micro-batch")
    parser.add_argument("--output", default=None)
    parser.add_argument("--ours_args", default="", help="more arguments for ours' run (e.g. '--held_prefix_budget_gib "
                                                        "0': nothing held across micro-batches)")  # fmt: skip
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    gpu_path()
    lines = [f"# python experiments/bench_host_bound.py {shlex.join(argv if argv is not None else sys.argv[1:])}",
             f"# GRPO, tiny Qwen3 ({args.layers} layers, hidden 64), P={args.prompt_length}, "
             f"C={args.completion_length}, "
             f"k=8, 2 prompts per step, beta 0.05, float32, CPU (torch threads 1); per micro-batch: operators that run "
             f"a kernel, all operators, ms (median of steps 2-{args.steps} over {args.repeats} repeats)",
             "| rows | phase | stock launching | ours launching | ratio | stock all | ours all | stock ms | ours ms "
             "| ratio |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    print("\n".join(lines), flush=True)
    for rows in args.rows:
        samples = {"stock": [], "ours": []}
        for _ in range(args.repeats):
            for method in samples:
                samples[method].append(run(method, rows, args))
        for phase in (*PHASES, "step"):
            value = lambda method, key: statistics.median(s[phase][key] for s in samples[method])  # noqa: E731
            time = f"{value('stock', 'time_ms'):.1f} | {value('ours', 'time_ms'):.1f} | " \
                   f"{value('ours', 'time_ms') / value('stock', 'time_ms'):.2f}x"  # fmt: skip
            if phase == "step":
                line = f"| {rows} | step | | | | | | {time} |"
            else:
                stock, ours = value("stock", "launching"), value("ours", "launching")
                line = (f"| {rows} | {phase} | {stock:.0f} | {ours:.0f} | {ours / stock:.2f}x | "
                        f"{value('stock', 'all'):.0f} | {value('ours', 'all'):.0f} | {time} |")  # fmt: skip
            lines.append(line)
            print(line, flush=True)
        for phase in PHASES if args.top else ():
            stock, ours = samples["stock"][0][phase], samples["ours"][0][phase]
            more = collections.Counter({name: count / ours["per"] for name, count in ours["ops"].counts.items()})
            more.subtract({name: count / stock["per"] for name, count in stock["ops"].counts.items()})
            print(f"# {phase}, ours - stock per micro-batch: " + ", ".join(
                f"{name.removeprefix('aten::')} {count:+.1f}" for name, count in more.most_common(args.top)))
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
