"""
Runs stock `trl.RLOOTrainer` (or `trl.GRPOTrainer`, with `--trainer grpo`) or ours on one workload and writes a
self-describing results file: per-phase peak memory, step times, the whole-run peak, config, versions, device and git
commit.

    python experiments/run_rloo.py --method ours --prompt_length 2048 --max_completion_length 64 \
        --num_generations 8 --per_device_train_batch_size 8 --max_steps 3
    python experiments/run_rloo.py --trainer grpo --method stock ...

Every `RLOOConfig` / `GRPOConfig` (TRL's plus ours) and `WorkloadConfig` field is a flag: `--help` lists them. With
`--model_name_or_path` / `--dataset_name` it trains a Hub model on a Hub dataset instead of the offline workload.
"""

import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import trl
from trl import TrlParser

from rloo_efficient import GroupSharingMixin, GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer, profiled
from rloo_efficient.demo.workload import (
    WorkloadConfig,
    build_dataset,
    build_model_dir,
    build_processing_class,
    build_reward_adapter_dir,
    build_reward_model_dir,
    vowel_reward,
)
from rloo_efficient.profiling.phase_profiler import PhaseProfiler
from rloo_efficient.profiling.results import environment_info, json_ready, write_json_atomic


# What may differ between two runs of the same workload (`--skip_existing`): where they write, and what they record
# beside the results file
WHERE_KEYS = ("output_dir", "logging_dir", "run_name", "results_file", "skip_existing", "memory_history", "live_bytes",
              "live_bytes_top")


class ProfiledStockRLOOTrainer(profiled(trl.RLOOTrainer)):
    """Stock TRL's trainer with the same per-phase profiling as ours, and nothing else."""


class ProfiledStockGRPOTrainer(profiled(trl.GRPOTrainer)):
    """Stock TRL's GRPO trainer with the same per-phase profiling as ours, and nothing else."""


# --trainer -> (our trainer, our config, profiled stock trainer)
TRAINERS = {"rloo": (RLOOTrainer, RLOOConfig, ProfiledStockRLOOTrainer),
            "grpo": (GRPOTrainer, GRPOConfig, ProfiledStockGRPOTrainer)}  # fmt: skip


@dataclass
class ExperimentArgs:
    method: str = field(default="ours", metadata={"help": "Which trainer runs.", "choices": ["stock", "ours"]})
    trainer: str = field(default="rloo", metadata={"help": "TRL's RLOO or GRPO trainer.", "choices": list(TRAINERS)})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A Hub model or local path instead of the offline tiny model."}
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "A Hub dataset with a `prompt` column instead of the offline prompts."}
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of --dataset_name."})
    results_file: str | None = field(
        default=None, metadata={"help": "Where the results JSON goes (default: results/<method>_<workload>.json)."}
    )
    reward_model: str = field(
        default="none",
        metadata={"help": "Score with a reward model shaped like the policy instead of the vowel rule: 'separate' (its "
                  "own model) or 'hydra' (a LoRA policy and a reward LoRA adapter on its base; stock TRL loads the "
                  "adapter as a second model).", "choices": ["none", "separate", "hydra"]},
    )
    memory_history: str | None = field(
        default=None,
        metadata={"help": "On CUDA: record the allocator's history of optimizer step 2 and write each phase's peak and "
                  "the blocks live then, by allocation site, to this Markdown file (experiments/memory_history.py)."},
    )
    lora: bool = field(
        default=False, metadata={"help": "Train a LoRA adapter (r 16, alpha 32, every linear layer) on the policy."}
    )
    live_bytes: str | None = field(
        default=None,
        metadata={"help": "Count live tensor bytes through optimizer step 2 and write each phase's peak and largest "
                  "tensors to this JSON file (experiments/memory_history.py: the CPU stand-in for device memory)."},
    )
    live_bytes_top: int = field(default=10, metadata={"help": "How many of the largest tensors --live_bytes names."})
    emulate_device_path: bool = field(
        default=False,
        metadata={"help": "On CPU, take the device path's choices (experiments/device_proxy.py): graph capture "
                  "emulated for static decoding and the scoring passes, TRL's compact fused head."},
    )
    skip_existing: bool = field(
        default=False, metadata={"help": "Do nothing when the results file for this workload already exists."}
    )


def workload_name(workload: WorkloadConfig, config, exp: ExperimentArgs) -> str:
    model = Path(exp.model_name_or_path).name if exp.model_name_or_path else f"tiny-{workload.arch}-h{workload.hidden_size}"
    data = Path(exp.dataset_name).name if exp.dataset_name else f"P{workload.prompt_length}"
    reward = "" if exp.reward_model == "none" else f"_rm-{exp.reward_model}"
    trainer = "" if exp.trainer == "rloo" else f"_{exp.trainer}"
    return f"{model}_{data}_C{config.max_completion_length}_k{config.num_generations}{reward}{trainer}"


def count_forwards(trainer) -> dict:
    """
    Counters per phase, filled while the trainer runs: the language-model tokens the policy and the reference model
    forward (what their embedding layer is given, padding included: what each forward computes; the packed forwards
    give it no padding), the images their vision tower encodes (one per image; Qwen's patch rows counted by their
    grid), and for ours the tokens its packed forwards held against their prefix trees' real tokens (each shared run
    once; held prompts' source forwards included), as its own counters count them. Hooks that only count.
    """
    import functools

    counts = {"language_model_tokens": {}, "images_encoded": {}, "packed_tokens": {}, "tree_tokens": {}}

    def add(kind: str, number: int) -> None:
        phase = trainer.memory_profiling.current_phase
        counts[kind][phase or "other"] = counts[kind].get(phase or "other", 0) + number

    if isinstance(trainer, GroupSharingMixin):  # ours: the trainer's own counters, each increase in its phase
        kinds = {"packed_forward_tokens": "packed_tokens", "tree_tokens": "tree_tokens"}
        own = trainer._counts

        class PhaseCounts(type(own)):
            def __setattr__(self, name, value):
                if name in kinds and value > getattr(self, name):  # (a reset to 0 adds nothing)
                    add(kinds[name], value - getattr(self, name))
                super().__setattr__(name, value)

        own.__class__ = PhaseCounts  # the packed passes hold this object: its class counts for them

    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        inner = trainer.accelerator.unwrap_model(model)
        inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        inner.get_input_embeddings().register_forward_pre_hook(
            lambda module, args: add("language_model_tokens", args[0].numel()))  # fmt: skip
        base = getattr(inner, "model", None)
        if base is None or not hasattr(base, "get_image_features"):
            continue

        def counted(pixel_values, *args, _encode=base.get_image_features, **kwargs):
            grid = kwargs.get("image_grid_thw", args[0] if args else None)
            qwen = pixel_values.dim() == 2 and isinstance(grid, torch.Tensor)
            add("images_encoded", len(grid) if qwen else pixel_values.shape[0])
            return _encode(pixel_values, *args, **kwargs)

        base.get_image_features = functools.wraps(base.get_image_features)(counted)  # generate reads its signature
    return counts


def fixed_state_gib(trainer) -> dict[str, float]:
    """What a step holds whatever the method (GiB): the policy's and reference's weights, the trainable parameters'
    gradients (present through each step's backward and optimizer step) and the optimizer's states. The working
    memory of a phase is its peak above their sum."""
    def nbytes(tensors) -> float:
        return sum(t.numel() * t.element_size() for t in tensors) / 1024**3

    policy = trainer.accelerator.unwrap_model(trainer.model)
    reference = getattr(trainer, "ref_model", None)
    states = [value for state in trainer.optimizer.state.values() for value in state.values()
              if isinstance(value, torch.Tensor)] if trainer.optimizer is not None else []  # fmt: skip
    parts = {
        "weights_gib": nbytes(policy.parameters()) + (nbytes(reference.parameters()) if reference is not None else 0),
        "gradients_gib": nbytes(p for p in policy.parameters() if p.requires_grad),
        "optimizer_states_gib": nbytes(states),
    }
    return {**parts, "fixed_state_gib": sum(parts.values())}


def run_settings(exp: ExperimentArgs, workload: WorkloadConfig, config, args) -> dict:
    """What makes a run the run it is, as its results file records it: the experiment's settings, the workload, and
    the trainer's config (`args`: ours, or stock's made from it), but for where the run writes ([`WHERE_KEYS`])."""
    settings = {
        "experiment": {key: value for key, value in asdict(exp).items() if key not in WHERE_KEYS},
        "workload": None if exp.model_name_or_path else asdict(workload),
        "config": {key: value for key, value in args.to_dict().items()
                   if key in type(config).__dataclass_fields__ and key not in WHERE_KEYS},
    }
    return json.loads(json.dumps(json_ready(settings)))  # as the results file reads back


def parse(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available() and not any(arg.startswith("--bf16") for arg in argv):
        argv += ["--bf16", "false"]  # TRL defaults to bf16, which fails on a machine without an accelerator
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1 and "--use_cpu" not in argv:
        argv += ["--use_cpu", "true"]  # without it, transformers runs each CPU process on its own (no gloo group)
    # The config's dataclass depends on the trainer: read --trainer first
    trainer = argv[argv.index("--trainer") + 1] if "--trainer" in argv[:-1] else "rloo"
    config_class = TRAINERS[trainer][1] if trainer in TRAINERS else RLOOConfig  # an unknown one: the parser says so
    parser = TrlParser((ExperimentArgs, WorkloadConfig, config_class))
    return parser.parse_args_and_config(args=argv)


def main(argv=None) -> dict:
    exp, workload, config = parse(argv)[:3]
    workload.check_fits(config.max_completion_length)  # before any model is loaded
    if exp.reward_model != "none" and exp.model_name_or_path:
        raise ValueError("--reward_model builds a reward model shaped like the offline workload's policy; with "
                         "--model_name_or_path, pass your own reward model in a script of yours.")  # fmt: skip
    name = workload_name(workload, config, exp)
    results_file = Path(exp.results_file or f"results/{exp.method}_{name}.json")
    if config.output_dir in (None, "trainer_output") or config.output_dir.endswith("trainer_output"):
        config.output_dir = str(Path("outputs") / f"{exp.method}_{name}")
    args = config if exp.method == "ours" else config.to_stock()
    run = run_settings(exp, workload, config, args)
    if exp.skip_existing and results_file.exists():
        existing = json.loads(results_file.read_text())
        if {key: existing.get(key) for key in run} == run:
            print(f"[run_rloo] {results_file} holds this workload already: skipping {exp.method} {name}")
            return existing
        print(f"[run_rloo] {results_file} is for another workload: running {exp.method} {name} again")

    if exp.model_name_or_path:
        model, tokenizer = exp.model_name_or_path, None
    else:
        model, tokenizer = build_model_dir(workload), build_processing_class(workload)
    if exp.dataset_name:
        from datasets import load_dataset

        dataset = load_dataset(exp.dataset_name, split=exp.dataset_split)
    else:
        dataset = build_dataset(workload)

    if exp.emulate_device_path:
        from device_proxy import emulate_device_path

        emulate_device_path()
    ours, _, stock = TRAINERS[exp.trainer]
    trainer_class = ours if exp.method == "ours" else stock
    reward_funcs, extra = vowel_reward, {}
    if exp.reward_model != "none":
        from peft import LoraConfig

        separate = exp.reward_model == "separate"
        reward_funcs = [build_reward_model_dir(workload) if separate else build_reward_adapter_dir(workload)]
        if not separate:  # Hydra: a LoRA policy, and its reward adapter on the same base
            extra["peft_config"] = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    if exp.lora:
        from peft import LoraConfig

        if "peft_config" in extra:
            raise ValueError("--lora trains a LoRA policy; --reward_model hydra already does.")
        extra["peft_config"] = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    trainer = trainer_class(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset, **extra,
                            processing_class=tokenizer)  # fmt: skip
    forwarded = count_forwards(trainer)
    if exp.memory_history and torch.cuda.is_available():
        from memory_history import RECORDED_STEP, record_step

        record_step(PhaseProfiler, RECORDED_STEP, exp.memory_history)
    if exp.live_bytes:
        from memory_history import RECORDED_STEP, record_live_bytes

        record_live_bytes(PhaseProfiler, RECORDED_STEP, exp.live_bytes, top=exp.live_bytes_top)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    # Leave the process group (TRL's Trainer does not); the exit below is what avoids the abort at teardown
    trainer.accelerator.end_training()

    if not trainer.accelerator.is_main_process:
        return {}  # one process writes the results; its report holds every process's peaks (their maximum)
    if trainer.accelerator.num_processes > 1:
        report = json.loads(trainer.memory_profiling.report_path.read_text())
    else:
        report = trainer.memory_profiling.report()
    step_times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
    summary = report["summary"]
    results = {
        "method": exp.method,
        "trainer": exp.trainer,
        "workload_name": name,
        "reward_model": exp.reward_model,
        "command": " ".join(["python", *sys.argv]) if argv is None else " ".join(["python", "experiments/run_rloo.py", *argv]),
        "k": config.num_generations,
        "prompt_length": workload.prompt_length,
        "completion_length": config.max_completion_length,
        "environment": environment_info(trainer.accelerator.device),
        "world_size": trainer.accelerator.num_processes,
        "time_of_run": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "peak_stat": summary["peak_stat"],  # what peak_gib measures on this device
        "memory_after_load_gib": report["memory_after_load_gib"],
        "peak_gib": summary["peak_gib"],
        "working_gib": summary["peak_gib"] - report["memory_after_load_gib"],
        **fixed_state_gib(trainer),
        "per_phase_peak_gib": summary["per_phase_peak_gib"],
        "step_times_s": step_times,
        # The first step pays one-time costs (allocator warm-up, lazy init): the median leaves it out when it can
        "median_step_time_s": statistics.median(step_times[1:] or step_times) if step_times else None,
        "train_wall_s": wall,
        **forwarded,  # language-model tokens and images the policy and reference forwarded, over the whole run
        "steps": trainer.memory_profiling.step_records(),  # every step (of the main process): these runs are short
        "timeline": report["timeline"],
        **run,
    }
    write_json_atomic(results_file, results)
    print(f"[run_rloo] {exp.method} {name}: peak {results['peak_gib']:.3f} GiB ({results['peak_stat']}), working "
          f"{results['working_gib']:.3f} GiB, median step {results['median_step_time_s']:.2f}s -> {results_file}")  # fmt: skip
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Results written, process group left: skip the interpreter's teardown, where a thread left behind in the CPU
        # (gloo) processes aborts one run in about seven ("terminate called without an active exception", torch 2.13)
        logging.shutdown()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
