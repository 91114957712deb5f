"""
The check to run first on a new machine, a GPU one above all: `python -m rloo_efficient.doctor`.

1. The versions that matter, and the device (its compute capability on a GPU).
2. Each fused attention kernel's first-use check ([`attention.checks.check_kernel`]) for every dtype and every use
   (prompt-causal, a prompt's keys read by its completions, decoding; with and without prompt padding), with the head
   layouts of common models, under TRL's default bf16 autocast: which kernel each configuration gets, and whether it
   matches the float64 reference.
3. A short stock-vs-ours run on a small synthetic model on this device: in float32, where ours must give stock's
   completions and metrics, with whole groups per micro-batch and with one row per micro-batch (each prompt held
   across its group's micro-batches); on a GPU also in TRL's default precision (bf16 autocast), for step time and
   peak memory.
   The float32 runs train with SGD, whose update is linear in the gradient: AdamW's first steps are sign-like, and
   turn a gradient that nearly cancels (the summation order's rounding then a large part of it) into full-size
   updates, which the next step's metrics show (2026-11-26, H200: a step-2 gradient 2,000 times smaller than step
   1's took both runs 0.3% apart at step 3; stock with eager attention against stock took them as far apart). Where
   the float32 run disagrees, stock runs again with eager attention: the gap between two stock runs that differ only
   in their summation order says how much of the disagreement the workload's own conditioning explains.

Exit status 1 when a fused kernel fails its check, when ours falls back to the math path or to stock's forward
during the runs, or when the float32 run disagrees with stock; 0 otherwise. Without CUDA it checks the CPU kernel,
runs on the CPU, and says what it skips.
"""

import argparse
import contextlib
import gc
import math
import platform
import statistics
import sys
import tempfile
import time
import warnings
from importlib import metadata

import torch

from .core.attention import checks as kernel_checks
from .profiling.memory import get_memory_stats, is_accelerator, release_cached_memory, reset_peak_memory, synchronize


# (query heads, key/value heads, head_dim) of common models: Llama-3.2-1B, Qwen3-1.7B/8B, Gemma-2/3's 256, Gemma 4's
# 512-dim global layers (past flash: the efficient kernel) and DeepSeek-V3's latent attention (192-dim keys; its
# 128-dim values padded to them), those two with fewer heads than the real models (the check's time grows with them)
HEAD_LAYOUTS = ((32, 8, 64), (16, 8, 128), (8, 4, 256), (8, 2, 512), (8, 8, 192))
# (use, masked): prompt-causal, and under a sliding window; a prompt read by its completions, whole, padded or under a
# sliding window; decoding; and the packed forward's variable-length calls (its nodes, causal, with or without a
# window; a tree level read by its subtrees)
USES = (("causal", None), ("causal window", None), ("prefix", None), ("prefix", "by key"), ("prefix", "by query"),
        ("decode", None), ("decode", "by key"), ("varlen causal", None), ("varlen causal window", None),
        ("varlen", None))  # fmt: skip
PACKAGES = ("torch", "transformers", "trl", "accelerate", "peft", "deepspeed", "rloo_efficient")
METRICS = ("loss", "reward", "kl", "grad_norm", "entropy")
# float32 on both sides, TF32 off: the runs differ only in summation order (~1e-6 relative per step)
RTOL, ATOL = 1e-3, 1e-4


def versions() -> list[str]:
    lines = [f"python {platform.python_version()}"]
    for package in PACKAGES:
        try:
            lines.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{package} not installed")
    if torch.version.cuda:
        lines.append(f"CUDA {torch.version.cuda} (torch's build)")
    return lines


def device_lines(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return [f"device {device.type}: no CUDA device, so the GPU kernels' checks and the bf16 run are skipped; the "
                "CPU kernel is checked and the runs use the CPU"]  # fmt: skip
    properties = torch.cuda.get_device_properties(device)
    return [f"device {properties.name}, compute capability {properties.major}.{properties.minor}, "
            f"{properties.total_memory / 2**30:.1f} GiB"]  # fmt: skip


def check_kernels(device: torch.device) -> tuple[list[str], int]:
    """One line per dtype, head layout and use: the kernel chosen and its check's result. Returns (lines, failures)."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32) + ((torch.float64,) if device.type == "cpu" else ())
    lines, failures = [], 0
    for dtype in dtypes:
        for heads, kv_heads, dim in HEAD_LAYOUTS:
            for use, masked in USES:
                config = kernel_checks.configuration(device, dtype, heads, kv_heads, dim, masked, use)
                kernel = config[0]
                if use.startswith("varlen") and kernel is None:
                    result = "no variable-length kernel: the nodes in padded length buckets"
                elif use == "causal window" and kernel != "cuda_flash":
                    result = "no windowed kernel: chunks with a mask per query (the prefix line masked by query)"
                elif kernel == "math":
                    result = "no fused kernel for this device and dtype (math path)"
                else:
                    # Under TRL's default autocast, which a correct check must not depend on
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        reason = kernel_checks.check_kernel(config)
                    failures += reason is not None
                    result = "ok" if reason is None else f"FAILED: {reason}"
                lines.append(f"{kernel_checks.describe(config)}: {result}")
    return lines, failures


def train(method: str, device: torch.device, bf16: bool, directory: str, quick: bool, optim: str = "sgd",
          attention: str | None = None, rows: int | None = None, liger: bool = False,
          torch_compile: bool = False) -> dict:  # fmt: skip
    """One short run of stock TRL or ours on the synthetic workload; its metrics, completions, time and peak.
    `attention`: the attention implementation the model loads with (default: transformers' choice). `rows`: rows per
    micro-batch, accumulation filling the generation batch (each group then spans micro-batches: its prompt held).
    `liger`: `use_liger_kernel=True` (Liger's RMSNorm, SwiGLU and rotary kernels, patched in as training starts).
    `torch_compile`: `torch_compile=True` (the Trainer compiles the policy's forward)."""
    import trl
    from transformers import PrinterCallback

    from . import RLOOConfig, RLOOTrainer
    from .demo.workload import WorkloadConfig, build_dataset, build_model_dir, build_tokenizer, vowel_reward

    # Prompts of different lengths (the padded prefix path); 4 query heads on 2 key/value heads of head_dim 64
    workload = WorkloadConfig(arch="qwen3", hidden_size=128 if quick else 512, num_hidden_layers=2,
                              num_attention_heads=4 if quick else 8, num_key_value_heads=2, head_dim=64,
                              intermediate_size=256 if quick else 1024, prompt_length=128 if quick else 1024,
                              prompt_length_min=96 if quick else 768, num_prompts=16, max_position_embeddings=2048,
                              model_cache_dir=directory)  # fmt: skip
    # SGD at 0.1, as AdamW at 0.01, moves the weights enough that a wrong gradient shows in the next steps' metrics
    settings = dict(output_dir=f"{directory}/{method}", per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=8 if quick else 64, max_steps=3, logging_steps=1, beta=0.05,
                    optim=optim, learning_rate=1e-1 if optim == "sgd" else 1e-2, steps_per_generation=2,
                    report_to=[], save_strategy="no", seed=0, bf16=bf16, disable_tqdm=True,
                    use_cpu=device.type == "cpu", use_liger_kernel=liger, torch_compile=torch_compile,
                    model_init_kwargs={"attn_implementation": attention} if attention else None)  # fmt: skip
    if rows is not None:  # the same 8 rows (2 groups) a step, in micro-batches of `rows`
        settings.update(per_device_train_batch_size=rows, gradient_accumulation_steps=8 // rows,
                        steps_per_generation=8 // rows, max_steps=2)  # fmt: skip
    args = trl.RLOOConfig(**settings) if method == "stock" else RLOOConfig(**settings, profile_memory=False)
    trainer_class = trl.RLOOTrainer if method == "stock" else RLOOTrainer
    gc.collect()
    if is_accelerator(device):  # the other run's cached blocks released, a new peak window
        release_cached_memory(device)
        reset_peak_memory(device)
    trainer = trainer_class(model=build_model_dir(workload), reward_funcs=vowel_reward, args=args,
                            train_dataset=build_dataset(workload), processing_class=build_tokenizer())  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the report below says what matters
    steps = []
    original = trainer.training_step

    def timed(*step_args, **step_kwargs):
        synchronize(device)
        start = time.perf_counter()
        loss = original(*step_args, **step_kwargs)
        synchronize(device)
        steps.append(time.perf_counter() - start)
        return loss

    trainer.training_step = timed
    trainer.train()
    result = {
        "metrics": [{key: entry.get(key) for key in METRICS} for entry in trainer.state.log_history if "loss" in entry],
        "completions": list(trainer._logs["completion"]),
        "step_time_s": statistics.median(steps[1:] or steps),  # the first step pays one-time costs
        "peak_gib": get_memory_stats(device, reset=False)["peak_allocated_gib"] if is_accelerator(device) else None,
        "packed_tokens": getattr(trainer, "packed_forward_tokens", None),
        "held_tokens": getattr(trainer, "held_forward_tokens", None),
    }
    del trainer
    return result


def compare(stock: dict, ours: dict) -> tuple[float, str | None]:
    """(largest relative difference of the metrics, what disagrees beyond RTOL/ATOL or None). The relative difference
    counts only metrics larger than ATOL: a loss of 1e-5 that differs by 3e-5 is within the tolerance, and its ratio
    would say nothing."""
    worst, problem = 0.0, None
    if stock["completions"] != ours["completions"]:
        differ = sum(a != b for a, b in zip(stock["completions"], ours["completions"], strict=True))
        problem = f"{differ} of {len(stock['completions'])} completions differ"
    for step, (a, b) in enumerate(zip(stock["metrics"], ours["metrics"], strict=True)):
        for key in METRICS:
            if a[key] is None or b[key] is None or (isinstance(a[key], float) and math.isnan(a[key])):
                continue
            difference = abs(a[key] - b[key])
            if abs(a[key]) > ATOL:
                worst = max(worst, difference / abs(a[key]))
            if difference > ATOL + RTOL * abs(a[key]) and problem is None:
                problem = f"step {step + 1} {key}: stock {a[key]:.6g}, ours {b[key]:.6g}"
    return worst, problem


@contextlib.contextmanager
def recorded_fallbacks():
    """The warnings rloo_efficient gives when a fused kernel or a shared path is not used."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found: list[str] = []
        yield found
    # (A note that micro-batches keep TRL's row shuffle is no fallback: every forward is still ours)
    found.extend(sorted({str(w.message) for w in caught if str(w.message).startswith("rloo_efficient:")
                         and "follow TRL's row shuffle" not in str(w.message)}))  # fmt: skip


def run_pair(device: torch.device, bf16: bool, quick: bool, lines: list[str], optim: str = "sgd",
             rows: int | None = None, liger: bool = False, torch_compile: bool = False) -> int:  # fmt: skip
    """Stock then ours in one precision; appends the report to `lines`, returns the number of failures. `rows`: rows
    per micro-batch (ours must then hold each prompt across its group's micro-batches). With `torch_compile`, a
    difference is set beside compile's own: stock compiled against stock not."""
    label = "bf16 autocast (TRL's default)" if bf16 else "float32"
    if optim != "sgd":
        label += f", {optim}"
    if rows is not None:
        label += f", {rows} row per micro-batch"
    if liger:
        label += ", Liger kernels"
    if torch_compile:
        label += ", torch_compile"
    options = dict(rows=rows, liger=liger, torch_compile=torch_compile)
    with tempfile.TemporaryDirectory() as directory:
        stock = train("stock", device, bf16, directory, quick, optim, **options)
        with recorded_fallbacks() as fallbacks:
            ours = train("ours", device, bf16, directory, quick, optim, **options)
    worst, problem = compare(stock, ours)
    failures = 0
    lines.append(f"{label}: step time stock {stock['step_time_s']:.3f} s, ours {ours['step_time_s']:.3f} s "
                 f"({ours['step_time_s'] / stock['step_time_s']:.2f}x)")  # fmt: skip
    if stock["peak_gib"] is not None:
        lines.append(f"{label}: peak allocated stock {stock['peak_gib']:.3f} GiB, ours {ours['peak_gib']:.3f} GiB "
                     f"({ours['peak_gib'] / stock['peak_gib']:.2f}x)")  # fmt: skip
    if not ours["packed_tokens"]:
        failures += 1
        lines.append(f"{label}: FAILED: ours did not pack any forward")
    if rows is not None:
        failures += not ours["held_tokens"]
        lines.append(f"{label}: prompts held across micro-batches: {ours['held_tokens'] or 0} tokens forwarded once "
                     f"for all{'' if ours['held_tokens'] else ' (FAILED: none held)'}")  # fmt: skip
    if bf16:  # bf16 roundings differ with the order of the sums: completions may part ways, which is not a failure
        lines.append(f"{label}: metrics' largest relative difference {worst:.1e} (not compared: bf16)")
    else:
        failures += problem is not None
        lines.append(f"{label}: {'same completions and metrics as stock' if problem is None else 'FAILED: ' + problem}"
                     f" (largest relative difference {worst:.1e})")  # fmt: skip
        if problem is not None:  # every step's metrics, to tell a difference that grows from one that appears
            for step, (a, b) in enumerate(zip(stock["metrics"], ours["metrics"], strict=True)):
                pairs = ", ".join(f"{key} {a[key]:.6g} / {b[key]:.6g}" for key in METRICS
                                  if isinstance(a[key], float) and isinstance(b[key], float))  # fmt: skip
                lines.append(f"{label}:   step {step + 1} (stock / ours): {pairs}")
            # The noise floor: stock against itself with eager attention (another summation order, same math), or
            # under torch_compile not compiled (what compiling changes of stock's own numbers)
            floor_options = {**options, "torch_compile": False} if torch_compile else {**options, "attention": "eager"}
            with tempfile.TemporaryDirectory() as directory:
                other = train("stock", device, bf16, directory, quick, optim, **floor_options)
            floor, floor_problem = compare(stock, other)
            lines.append(f"{label}: stock {'not compiled' if torch_compile else 'with eager attention'} against "
                         f"stock: largest relative difference {floor:.1e}"
                         f"{'' if floor_problem is None else f' ({floor_problem})'}; ours against stock: "
                         f"{worst:.1e}")  # fmt: skip
    for message in fallbacks:
        failures += 1
        lines.append(f"{label}: FAILED: {message}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rloo_efficient.doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--skip_runs", action="store_true", help="Check the kernels only.")
    parser.add_argument("--quick", action="store_true", help="A smaller model and shorter runs (the CPU default).")
    parser.add_argument("--skip_kernels", action="store_true", help="Skip the kernels' checks.")
    parser.add_argument("--optim", default="sgd",
                        help="The float32 runs' optimizer (adamw_torch: the ill-conditioned check of earlier versions).")
    parser.add_argument("--liger", action="store_true",
                        help="Also stock vs ours with use_liger_kernel=True (needs liger-kernel and a GPU).")
    parser.add_argument("--torch_compile", action="store_true",
                        help="Also stock vs ours with torch_compile=True (minutes of compiling on a CPU).")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    quick = args.quick or device.type == "cpu"
    print("\n".join(["== versions", *versions(), "", "== device", *device_lines(device), ""]), flush=True)
    lines, failures = check_kernels(device) if not args.skip_kernels else (["skipped (--skip_kernels)"], 0)
    print("\n".join(["== attention kernels (first-use check against float64, under bf16 autocast)", *lines, ""]),
          flush=True)  # fmt: skip
    if args.skip_runs:
        print("== stock vs ours: skipped (--skip_runs)")
    else:
        print("== stock vs ours on a small synthetic model (3 steps)", flush=True)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # a float32 comparison
        lines = []
        failures += run_pair(device, False, quick, lines, args.optim)
        failures += run_pair(device, False, quick, lines, args.optim, rows=1)
        if args.liger:
            failures += run_pair(device, False, quick, lines, args.optim, liger=True)
        if args.torch_compile:
            failures += run_pair(device, False, quick, lines, args.optim, torch_compile=True)
        if device.type == "cuda":
            failures += run_pair(device, True, quick, lines)
        else:
            lines.append("bf16 autocast (TRL's default): skipped on CPU (the float32 run above compares the numbers)")
        print("\n".join(lines), flush=True)
    print(f"\n{'all checks passed' if not failures else f'{failures} check(s) FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
