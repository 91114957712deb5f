"""
A trainer's per-phase memory and time profiling ([`TrainerProfiling`]): the part a trainer holds, whose phases its
overrides of TRL's methods open, whose callback marks the optimizer steps, and which writes the run's files.
"""

import contextlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from transformers import TrainerCallback

from ..core.once import WarnOnce
from .memory import is_accelerator
from .phase_profiler import PhaseProfiler, max_over_ranks
from .results import environment_info, write_json_atomic


# The token counters of rloo_efficient's own trainers that the report records, where the counts object has them
SHARING_COUNTERS = ("packed_forward_tokens", "tree_tokens", "held_forward_tokens", "shared_prefill_tokens",
                    "reward_forward_tokens")  # fmt: skip

_warnings = WarnOnce()  # the files that could not be written, once per process


def _warn_unwritten(name: str, error: BaseException) -> None:
    """One warning per file name and process: a report that could not be written does not stop training."""
    _warnings.warn(f"rloo_efficient: {name} could not be written ({type(error).__name__}: {error}); training goes on "
                   f"without it.", key=name, stacklevel=2)  # fmt: skip


def is_reference_pass(model, reference_model, unwrap: Callable) -> bool:
    """Whether a forward of `model` computes the reference's log-probs: `reference_model` itself, or the PEFT policy
    (`unwrap(model)`) with no adapter enabled or TRL's "ref" adapter active (as TRL's `use_adapter` sets them)."""
    if reference_model is not None and model is reference_model:
        return True
    unwrapped = unwrap(model)
    if not is_peft_model(unwrapped):
        return False
    return not unwrapped.has_active_enabled_adapter or unwrapped.active_adapter == "ref"


class StepBoundaries(TrainerCallback):
    """The optimizer steps' boundaries, and the report's writes, as the Trainer's events: [`TrainerProfiling`]'s public
    methods only."""

    def __init__(self, profiling: "TrainerProfiling"):
        self.profiling = profiling

    def on_train_begin(self, args, state, control, **kwargs):
        self.profiling.train_begins(state.global_step)  # (a resumed run's: its checkpoint's)

    def on_step_begin(self, args, state, control, **kwargs):
        self.profiling.step_begins()

    def on_step_end(self, args, state, control, **kwargs):
        self.profiling.step_ends(state.global_step)

    def on_save(self, args, state, control, **kwargs):
        self.profiling.write_report()

    def on_train_end(self, args, state, control, **kwargs):
        self.profiling.write_report()


class TrainerProfiling:
    """
    Per-phase memory and time profiling of a TRL group trainer (RLOO, GRPO), without changing what it computes: the
    part our trainers hold (and [`trainers.memory_profiling.profiled`] stock ones), as `trainer.memory_profiling`.
    The trainer's overrides of TRL's methods open its phases; [`callbacks`] mark the optimizer steps.

    Phases, and the TRL method whose call opens each: `generation` (`_generate`: tokenization, decoding,
    detokenization; [`phase`]), `policy_logps` and `reference_logps` (the no-grad `_get_per_token_logps_and_entropies`
    calls within `_generate_and_score_completions`, named by the model they run; [`scoring`], [`scoring_pass`]),
    `reward` (`_calculate_rewards`; [`phase`]), `train` (`training_step` less the phases above: forward, backward,
    advantage bookkeeping; [`micro_batch`]) and `optimizer` (gradient clipping, `optimizer.step()`, scheduler and
    `zero_grad`: from the accumulation's last micro-batch to the step's end).

    What it writes to `output_dir` (main process only), at a cost per step that does not grow with the run:
    - `memory_steps.jsonl`: one line per optimizer step (its `step`, wall `time_s` and per-phase `phases`), appended
      as the step ends. Started afresh by each `train()` call; a run resumed from a checkpoint keeps the steps up to
      the checkpoint's, as the Trainer's own log history does, and its report covers them too.
    - `memory_report.json`: the whole-run summary, environment, config, the first steps' records and the bounded
      timeline (see [`PhaseProfiler`]), the number of steps and the JSONL's name; rewritten atomically at every
      checkpoint save and at the end of training.

    The phases that run while the model is in eval mode (`trainer.evaluate()`, or evaluation during training) are
    kept out of the training steps: [`logs`] gives them with the eval metrics, as `eval_memory/<phase>/<stat>` (peak
    over the evaluation) and `eval_time/<phase>_s` (total seconds), and they are not in the files above.

    Args:
        accelerator (`accelerate.Accelerator`):
            The device measured (`device`), the processes whose files and report are written (`process_index`,
            `num_processes`, `is_main_process`), and `unwrap_model`.
        output_dir (`str` or `os.PathLike`):
            Where `memory_steps.jsonl` and `memory_report.json` go.
        empty_cache_policy (`str`, *optional*, defaults to `"none"`):
            After which phases cached memory is released, as [`PhaseProfiler`] takes it.
        training (`Callable[[], bool]`, *optional*):
            Whether the trainer is training now (its model in train mode); otherwise a phase is an evaluation's.
        reference_model (`torch.nn.Module`, *optional*):
            The trainer's reference model: its log-prob passes are `reference_logps`.
        counts (*optional*):
            An object holding the token counters of [`SHARING_COUNTERS`] (our trainers' `Counts`), read into the report
            as `sharing_tokens`; `None` for a stock trainer.
        config (`Callable[[], dict]`, *optional*):
            The run's config for the report (the trainer's `args.to_dict`); its private keys are left out.
        trainer_name (`str`, *optional*):
            The trainer's class, for the report.
        enabled (`bool`, *optional*, defaults to `True`):
            `False`: profiling off (nothing else is read): each phase is a null context, [`logs`] gives nothing and no
            file is written. [`PROFILING_OFF`] is such a part.
    """

    report_name = "memory_report.json"
    steps_name = "memory_steps.jsonl"

    def __init__(self, accelerator, output_dir, empty_cache_policy: str = "none", *,
                 training: Callable[[], bool] = lambda: True, reference_model=None, counts=None,
                 config: Callable[[], dict] = dict, trainer_name: str | None = None, enabled: bool = True):  # fmt: skip
        self.accelerator, self.output_dir = accelerator, output_dir
        self.training, self.reference_model, self.counts = training, reference_model, counts
        self.config, self.trainer_name = config, trainer_name
        self.profiler = PhaseProfiler(accelerator.device, empty_cache_policy) if enabled else None
        self._scoring = False  # within `_generate_and_score_completions`, whose no-grad passes are phases

    @classmethod
    def from_args(cls, args, accelerator, training: Callable[[], bool], reference_model=None, counts=None,
                  trainer_class: type | None = None) -> "TrainerProfiling":  # fmt: skip
        """
        The part `args` asks for: [`PROFILING_OFF`] where its `profile_memory` is False; a stock TRL config has neither
        `profile_memory` nor `empty_cache_policy` (profiling on, no release). Made once the models are loaded: the
        memory then is the run's baseline.
        """
        if not getattr(args, "profile_memory", True):
            return PROFILING_OFF
        name = f"{trainer_class.__module__}.{trainer_class.__qualname__}" if trainer_class is not None else None
        return cls(accelerator, args.output_dir, getattr(args, "empty_cache_policy", "none"), training=training,
                   reference_model=reference_model, counts=counts, config=args.to_dict, trainer_name=name)  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.profiler is not None

    @property
    def callbacks(self) -> list[TrainerCallback]:
        """The callbacks the trainer adds (none where profiling is off)."""
        return [StepBoundaries(self)] if self.enabled else []

    @property
    def current_phase(self) -> str | None:
        """The innermost phase running now (None: none, or profiling off)."""
        return self.profiler.current_phase if self.enabled else None

    # -- phases: what the trainer's overrides of TRL's methods open ------------------------------------------------
    def phase(self, name: str, training: bool | None = None):
        """Phase `name`, an evaluation's unless `training` (by default: whether the trainer is training now)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return self.profiler.phase(name, not (self.training() if training is None else training))

    @contextlib.contextmanager
    def scoring(self):
        """While TRL's `_generate_and_score_completions` runs: its no-grad log-prob passes are phases
        ([`scoring_pass`])."""
        if not self.enabled:  # (nothing set: PROFILING_OFF is shared)
            yield
            return
        self._scoring = True
        try:
            yield
        finally:
            self._scoring = False

    def scoring_pass(self, model):
        """
        A log-prob pass of `model`: within [`scoring`] and without grad, the phase named by the model it runs
        (`reference_logps` or `policy_logps`; GRPO runs the policy's, old log-probs, only when generation and optimizer
        steps are out of step, and the reference's only with beta > 0); otherwise nothing.
        """
        if not self.enabled or not self._scoring or torch.is_grad_enabled():
            return contextlib.nullcontext()
        reference = is_reference_pass(model, self.reference_model, self.accelerator.unwrap_model)
        return self.phase("reference_logps" if reference else "policy_logps")

    @contextlib.contextmanager
    def micro_batch(self, ends_step: Callable[[], bool]):
        """
        TRL's `training_step` of one micro-batch, as the phase `train` (always training: the model can still be in eval
        mode on entry, and `training_step` puts it in train mode). Where `ends_step()` after it (the accumulation's
        last micro-batch), what follows until [`step_ends`] is the phase `optimizer`.
        """
        if not self.enabled:
            yield
            return
        with self.phase("train", training=True):
            yield
        if ends_step():
            self.profiler.start("optimizer")

    # -- steps: what the callback marks ----------------------------------------------------------------------------
    @property
    def steps_path(self) -> Path:
        """`memory_steps.jsonl`; with several processes each writes its own, `memory_steps.rank<r>.jsonl`."""
        name = self.steps_name
        if self.accelerator.num_processes > 1:
            name = name.replace(".jsonl", f".rank{self.accelerator.process_index}.jsonl")
        return Path(self.output_dir) / name

    @property
    def report_path(self) -> Path:
        return Path(self.output_dir) / self.report_name

    def train_begins(self, resumed_step: int = 0) -> None:
        """Starts the steps file afresh; resuming after optimizer step `resumed_step`, with the records of the steps up
        to it that the file holds (those of a run stopped later are left out: they run again), which the report's
        summary then covers too."""
        kept = self._records_up_to(resumed_step) if resumed_step > 0 else []
        try:
            self.steps_path.parent.mkdir(parents=True, exist_ok=True)
            self.steps_path.write_text("".join(json.dumps(entry) + "\n" for entry in kept))
        except OSError as error:
            _warn_unwritten(self.steps_path.name, error)
            kept = []
        self.profiler.restore(kept)

    def _records_up_to(self, step: int) -> list[dict]:
        """The steps file's records of steps 1 to `step`, in order; none where the file is missing or unreadable, and
        none from a malformed line on (a run killed mid-write)."""
        records = []
        try:
            with open(self.steps_path) as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                    except json.JSONDecodeError:
                        break
                    if (isinstance(entry, dict) and isinstance(entry.get("step"), int) and entry["step"] <= step
                            and isinstance(entry.get("phases"), dict)):  # fmt: skip
                        records.append(entry)
        except OSError:
            return []
        return records

    def step_begins(self) -> None:
        self.profiler.begin_step()

    def step_ends(self, step: int) -> None:
        """Closes optimizer step `step` (its `optimizer` phase too) and appends its record to the steps file."""
        if self.profiler.current_phase == "optimizer":
            self.profiler.stop("optimizer")
        entry = self.profiler.end_step(step)
        # Appended, never rewritten: a step costs one line of I/O however long the run (closing flushes it)
        try:
            with open(self.steps_path, "a") as f:
                f.write(json.dumps(entry) + "\n")  # the profiler's own numbers
        except OSError as error:
            _warn_unwritten(self.steps_path.name, error)

    def step_records(self) -> list[dict]:
        """Every step's record of the last `train()` call on this process (a resumed one's from step 1), read back
        from its steps file."""
        with open(self.steps_path) as f:
            return [json.loads(line) for line in f]

    # -- what the trainer logs and writes --------------------------------------------------------------------------
    def logs(self, logged: Mapping) -> dict[str, float]:
        """
        The metrics to merge into the trainer's log `logged`. Training, at a log with the loss: those of the steps ended
        since the last such log (`memory/<phase>/<stat>`, `time/<phase>_s`, `time/cache_release_s`, and on CPU
        `memory/rss_after_load_gib`). Evaluating: the evaluation's phases, prefixed `eval_` as TRL prefixes its own
        metrics in eval mode whatever the evaluation's prefix.
        """
        if not self.enabled:
            return {}
        if not self.training():
            return {f"eval_{key}": value for key, value in self.profiler.eval_metrics().items()}
        if "loss" not in logged:
            return {}
        metrics = self.profiler.log_metrics()
        if not is_accelerator(self.profiler.device):
            metrics["memory/rss_after_load_gib"] = self.profiler.baseline_gib
        return metrics

    def report(self) -> dict:
        """
        The whole-run summary, the environment and the config, with the records of the first steps and the bounded
        timeline; every step's record is in `steps_file` (relative to `output_dir`), see [`step_records`].
        """
        profiler = self.profiler
        config = {key: value for key, value in self.config().items() if not key.startswith("_")}
        counts = self.counts
        return {
            "trainer": self.trainer_name,
            "rank": self.accelerator.process_index,
            "world_size": self.accelerator.num_processes,
            "environment": environment_info(profiler.device),
            "units": "GiB and seconds",
            "memory_after_load_gib": profiler.baseline_gib,
            "empty_cache_policy": profiler.empty_cache_policy,
            "summary": profiler.summary(),
            "num_steps": profiler.num_steps,
            "steps_file": self.steps_name,
            "first_steps": profiler.first_steps,
            "timeline": profiler.timeline,
            "config": config,
            # rloo_efficient's own trainers: tokens each sharing path forwarded (0 where it never engaged)
            "sharing_tokens": {name: getattr(counts, name) for name in SHARING_COUNTERS if hasattr(counts, name)},
        }

    def write_report(self, path: str | Path | None = None) -> None:
        """
        Writes the [`report`] to `path` (by default `memory_report.json` in `output_dir`) from the main process,
        atomically. With several processes, every process must call it (the callbacks do, at checkpoints and at the
        end): the summary becomes the maximum over the processes' peaks, and `per_rank` holds each process's own.
        """
        if not self.enabled:
            return
        report = self.report()
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            summaries = gather_object([report["summary"]])
            report["per_rank"] = summaries
            report["summary"] = max_over_ranks(summaries)
        if self.accelerator.is_main_process:
            path = self.report_path if path is None else Path(path)
            try:
                write_json_atomic(path, report)
            except (OSError, ValueError, TypeError) as error:  # (ValueError: a circular reference)
                _warn_unwritten(path.name, error)


# Profiling off: the part of a trainer made with `profile_memory=False`, or without its `__init__` (a unit test's bare
# object), and that nothing writes to
PROFILING_OFF = TrainerProfiling(None, None, enabled=False)
