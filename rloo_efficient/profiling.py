"""Per-phase memory and time of an RLOO step, and the trainer mixin that records them."""

import contextlib
import functools
import json
import os
import platform
import re
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import TrainerCallback

from .memory import (
    current_memory_gib,
    current_memory_stats,
    device_description,
    get_memory_stats,
    headline_peak_stat,
    is_accelerator,
    peak_rss_resettable,
    release_cached_memory,
    reset_peak_memory,
    synchronize,
)


PHASES = ("generation", "policy_logps", "reference_logps", "reward", "train", "optimizer")
PACKAGE_DIR = Path(__file__).resolve().parent


class _Aggregate:
    """The largest value of each peak stat per phase, and summed seconds, over the steps added to it."""

    def __init__(self):
        self.peaks: dict[str, dict[str, float]] = defaultdict(dict)  # phase -> stat -> GiB
        self.times: dict[str, float] = defaultdict(float)  # log key -> seconds, summed over the steps
        self.num_steps = 0

    def add(self, phases: dict[str, dict[str, float]]) -> None:
        for phase, record in phases.items():
            for stat, value in record.items():
                if stat.endswith("_gib"):
                    self.peaks[phase][stat] = max(self.peaks[phase].get(stat, float("-inf")), value)
                elif stat == "time_s":
                    self.times[f"time/{phase}_s"] += value
                elif stat == "release_s":
                    self.times["time/cache_release_s"] += value
        self.num_steps += 1

    def metrics(self) -> dict[str, float]:
        """`memory/<phase>/<stat>`: the largest peak (GiB); `time/<phase>_s`, `time/cache_release_s`: mean per step."""
        peaks = {f"memory/{phase}/{stat}": value
                 for phase, stats in self.peaks.items() for stat, value in stats.items()}  # fmt: skip
        n = max(self.num_steps, 1)
        return {**peaks, **{key: value / n for key, value in self.times.items()}}


class PhaseProfiler:
    """
    Records, for each phase of each optimizer step, the peak memory and the time spent while that phase was the
    innermost one. Phases nest: stock TRL generates inside `training_step`, so while `generation` runs, `train` is
    paused, and `train`'s peak and time are those of its own segments only.

    Its memory does not grow with the run: [`end_step`] returns each step's record for the caller to store, and the
    profiler keeps only the records of the first `keep_first_steps` steps, running whole-run maxima for [`summary`],
    running aggregates since the last [`log_metrics`], and the phase segments of the first `keep_first_steps` steps
    and of the last ended one.

    Phases started with `evaluating=True` (the trainer evaluating) fold into a separate record, read and cleared by
    [`eval_metrics`]: they never enter a training step's record, the summary or the timeline.

    Args:
        device (`torch.device`):
            The device whose memory is measured.
        empty_cache_policy (`str`, *optional*, defaults to `"none"`):
            `"none"`, `"after_generation"` or `"every_phase"`: after which phases [`release_cached_memory`] runs.
        keep_first_steps (`int`, *optional*, defaults to `5`):
            How many of the first steps keep their record and phase segments, for the report's first steps and
            timeline.
    """

    keep_first_steps = 5

    def __init__(self, device: torch.device, empty_cache_policy: str = "none", keep_first_steps: int | None = None):
        self.device = device
        self.empty_cache_policy = empty_cache_policy
        if keep_first_steps is not None:
            self.keep_first_steps = keep_first_steps
        self.baseline_gib = current_memory_gib(device)  # memory right after the models were loaded
        self.num_steps = 0  # optimizer steps ended
        self.first_steps: list[dict] = []  # the records of the first `keep_first_steps` steps
        self.release_boundaries: list[str] = []  # phases after which memory was released, in order (for tests)
        self._run = _Aggregate()  # every step, for the summary
        self._since_log = _Aggregate()  # the steps since the last log_metrics()
        # Closed segments (when, which phase, its peak, memory at its end): of the first steps, of the last ended step,
        # and of the step in progress
        self._first_segments: list[dict] = []
        self._last_segments: list[dict] = []
        self._open_segments: list[dict] = []
        self._t0 = time.perf_counter()
        self._step_start = self._t0
        self._stack: list[tuple[str, bool]] = []  # (phase, evaluating)
        self._segment_start = 0.0
        self._current: dict[str, dict[str, float]] = defaultdict(dict)  # the training step in progress
        self._eval: dict[str, dict[str, float]] = defaultdict(dict)  # evaluation since the last eval_metrics()

    # -- phase boundaries ---------------------------------------------------------------------------------------
    def _close_segment(self) -> None:
        """Folds the peak and time since the last boundary into the innermost phase."""
        # On an accelerator the host runs ahead of the kernels it launched: wait for them, so that a phase's time is
        # its kernels' time and not their launch time (one synchronization per boundary, ~8 per step)
        synchronize(self.device)
        now = time.perf_counter()
        if self._stack:
            phase, evaluating = self._stack[-1]
            record = (self._eval if evaluating else self._current)[phase]
            stats = get_memory_stats(self.device)
            for name, value in stats.items():
                record[name] = max(record.get(name, 0.0), value)
            record["time_s"] = record.get("time_s", 0.0) + now - self._segment_start
            if not evaluating:  # `step` is set when the step ends
                self._open_segments.append({"start_s": self._segment_start - self._t0, "end_s": now - self._t0,
                                            "phase": phase, "step": None, **stats,
                                            **current_memory_stats(self.device)})  # fmt: skip
        else:
            reset_peak_memory(self.device)
        self._segment_start = time.perf_counter()

    def start(self, phase: str, evaluating: bool = False) -> None:
        self._close_segment()
        self._stack.append((phase, evaluating))

    def stop(self, phase: str) -> None:
        if not self._stack or self._stack[-1][0] != phase:
            raise RuntimeError(f"Phase {phase!r} stopped while {[name for name, _ in self._stack]} were running.")
        self._close_segment()
        _, evaluating = self._stack.pop()
        if self.empty_cache_policy == "every_phase" or (
            self.empty_cache_policy == "after_generation" and phase == "generation"
        ):
            start = time.perf_counter()
            release_cached_memory(self.device)
            record = (self._eval if evaluating else self._current)[phase]
            record["release_s"] = record.get("release_s", 0.0) + time.perf_counter() - start
            self.release_boundaries.append(phase)
            reset_peak_memory(self.device)  # the release is not part of the next phase
            self._segment_start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str, evaluating: bool = False):
        self.start(name, evaluating)
        try:
            yield
        finally:
            self.stop(name)

    @property
    def current_phase(self) -> str | None:
        return self._stack[-1][0] if self._stack else None

    # -- steps ----------------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Starts the wall clock of the next step's `time_s` (otherwise it runs from the end of the previous step)."""
        self._step_start = time.perf_counter()

    def end_step(self, step: int) -> dict:
        """
        Closes the record of optimizer step `step` and returns it: `{"step", "time_s" (wall seconds), "phases":
        {phase: {stat: value}}}`.
        """
        now = time.perf_counter()
        phases = {}
        for name, record in self._current.items():
            record = dict(record)
            if "peak_rss_gib" in record:
                record["peak_working_gib"] = record["peak_rss_gib"] - self.baseline_gib
            phases[name] = record
        entry = {"step": step, "time_s": now - self._step_start, "phases": phases}
        self._run.add(phases)
        self._since_log.add(phases)
        for segment in self._open_segments:
            segment["step"] = step
        self.num_steps += 1
        if self.num_steps <= self.keep_first_steps:
            self.first_steps.append(entry)
            self._first_segments.extend(self._open_segments)
        else:
            self._last_segments = self._open_segments
        self._open_segments = []
        self._current = defaultdict(dict)
        self._step_start = now
        return entry

    @property
    def timeline(self) -> list[dict]:
        """The phase segments of the first `keep_first_steps` steps, then those of the last ended step."""
        return [*self._first_segments, *self._last_segments]

    def log_metrics(self) -> dict[str, float]:
        """
        Flat log metrics over the steps ended since the last call: `memory/<phase>/<stat>` is the largest peak among
        them (GiB), `time/<phase>_s` the mean time per step, `time/cache_release_s` the mean release time per step.
        """
        metrics = self._since_log.metrics()
        self._since_log = _Aggregate()
        return metrics

    def eval_metrics(self) -> dict[str, float]:
        """
        The phases recorded with `evaluating=True` since the last call, as one record: `memory/<phase>/<stat>` their
        peak (GiB), `time/<phase>_s` their total seconds.
        """
        evaluation = _Aggregate()
        if self._eval:
            evaluation.add(self._eval)
        self._eval = defaultdict(dict)
        return evaluation.metrics()

    def summary(self) -> dict:
        """
        Whole-run peaks over every ended step: `peak_gib` (peak allocated on an accelerator, peak resident set on CPU;
        its name in `peak_stat`) overall and per phase (`per_phase_peak_gib`), and every stat per phase (`per_phase`)
        and overall (`overall`).
        """
        per_phase = {phase: dict(stats) for phase, stats in self._run.peaks.items()}
        overall: dict[str, float] = {}
        for stats in per_phase.values():
            for stat, value in stats.items():
                overall[stat] = max(overall.get(stat, float("-inf")), value)
        stat = headline_peak_stat(self.device)
        return {
            "peak_stat": stat,
            "peak_gib": overall.get(stat),
            "per_phase_peak_gib": {phase: stats[stat] for phase, stats in per_phase.items() if stat in stats},
            "per_phase": per_phase,
            "overall": overall,
        }


def max_over_ranks(summaries: list[dict]) -> dict:
    """One [`PhaseProfiler.summary`] from every process's: each peak the largest over the processes."""
    merged = json.loads(json.dumps(summaries[0]))
    for other in summaries[1:]:
        for key in ("per_phase_peak_gib", "overall"):
            for stat, value in other.get(key, {}).items():
                merged[key][stat] = max(merged[key].get(stat, value), value)
        for phase, stats in other.get("per_phase", {}).items():
            for stat, value in stats.items():
                merged["per_phase"].setdefault(phase, {})
                merged["per_phase"][phase][stat] = max(merged["per_phase"][phase].get(stat, value), value)
        if other.get("peak_gib") is not None:
            merged["peak_gib"] = max(merged.get("peak_gib") or other["peak_gib"], other["peak_gib"])
    return merged


def git_commit(package_dir: Path = PACKAGE_DIR) -> str | None:
    """
    The commit of the rloo_efficient checkout holding `package_dir`, or `None`. Only a git work tree whose top level
    is the package's parent and holds rloo_efficient's own pyproject.toml counts: an installed copy (in a virtualenv
    inside some project's repository, say) would otherwise report that project's commit.
    """
    root = package_dir.parent
    try:
        pyproject = (root / "pyproject.toml").read_text()
    except OSError:
        return None
    # A line match rather than tomllib (Python >= 3.11): we support 3.10
    if not re.search(r'^name\s*=\s*"rloo_efficient"\s*$', pyproject, re.MULTILINE):
        return None

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=package_dir)
        return out.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return None
        return git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return None


@functools.lru_cache(maxsize=None)
def environment_info(device: torch.device) -> dict:
    """Device, library versions and git commit: what a results file needs to describe itself."""
    import accelerate
    import transformers
    import trl

    from . import __version__  # here: the package imports this module before it defines its version

    return {
        "device": device_description(device),
        "device_type": device.type,
        "python": platform.python_version(),
        "rloo_efficient": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "accelerate": accelerate.__version__,
        "git_commit": git_commit(),
        "peak_rss_resettable": None if is_accelerator(device) else peak_rss_resettable(),
    }


def write_json_atomic(path: str | os.PathLike, payload: dict) -> None:
    """Writes `payload` to `path` through a temporary file and a rename, so a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(tmp, path)


class _StepBoundaryCallback(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._start_memory_steps_file()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer._profiler.begin_step()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._end_profiled_step()

    def on_save(self, args, state, control, **kwargs):
        self.trainer.write_memory_report()

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.write_memory_report()


class MemoryProfilingMixin:
    """
    Adds per-phase memory and time profiling to a TRL RLOO trainer without changing what it computes. Mix it in
    before the trainer class: `class ProfiledRLOOTrainer(MemoryProfilingMixin, trl.RLOOTrainer)`.

    Phases: `generation` (`_generate`: tokenization, decoding, detokenization), `policy_logps` and
    `reference_logps` (the two no-grad `_get_per_token_logps_and_entropies` calls of
    `_generate_and_score_completions`), `reward` (`_calculate_rewards`), `train` (`training_step` less the phases
    above: forward, backward, advantage bookkeeping) and `optimizer` (gradient clipping, `optimizer.step()`,
    scheduler and `zero_grad`). Reads `profile_memory` and `empty_cache_policy` from `args` when present (stock
    `trl.RLOOConfig` has neither: profiling on, no release).

    What it writes to `output_dir` (main process only), at a cost per step that does not grow with the run:
    - `memory_steps.jsonl`: one line per optimizer step (its `step`, wall `time_s` and per-phase `phases`), appended
      as the step ends. Started afresh by each `train()` call (a resumed run holds the steps from the resume on).
    - `memory_report.json`: the whole-run summary, environment, config, the first steps' records and the bounded
      timeline (see [`PhaseProfiler`]), the number of steps and the JSONL's name; rewritten atomically at every
      checkpoint save and at the end of training.

    The phases that run while the model is in eval mode (`trainer.evaluate()`, or evaluation during training) are
    kept out of the training steps: they are logged with the eval metrics, as `eval_memory/<phase>/<stat>` (peak
    over the evaluation) and `eval_time/<phase>_s` (total seconds), and are not in the files above.
    """

    memory_report_name = "memory_report.json"
    memory_steps_name = "memory_steps.jsonl"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._profiler = None
        if getattr(self.args, "profile_memory", True):
            self._profiler = PhaseProfiler(self.accelerator.device, getattr(self.args, "empty_cache_policy", "none"))
            self._scoring_pass = None  # index of the next no-grad log-prob pass within a scoring call
            self.add_callback(_StepBoundaryCallback(self))

    def _phase(self, name: str, evaluating: bool | None = None):
        """Profiles phase `name` as an evaluation's when `evaluating` (by default: when the model is in eval mode)."""
        if self._profiler is None:
            return contextlib.nullcontext()
        return self._profiler.phase(name, not self.model.training if evaluating is None else evaluating)

    def _generate(self, prompts):
        with self._phase("generation"):
            return super()._generate(prompts)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self._phase("reward"):
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def _generate_and_score_completions(self, inputs):
        self._scoring_pass = 0
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._scoring_pass = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if self._profiler is None or self._scoring_pass is None or torch.is_grad_enabled():
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        # Stock TRL scores with the policy first, then (beta != 0) with the reference
        name = "policy_logps" if self._scoring_pass == 0 else "reference_logps"
        self._scoring_pass += 1
        with self._phase(name):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch):
        # Always training: the model can still be in eval mode on entry (Trainer.training_step calls model.train())
        with self._phase("train", evaluating=False):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if self._profiler is not None and self._step % self.current_gradient_accumulation_steps == 0:
            # The last micro-batch of the accumulation: what follows, until on_step_end, is the optimizer step
            self._profiler.start("optimizer")
        return loss

    @property
    def memory_steps_path(self) -> Path:
        """`memory_steps.jsonl`; with several processes each writes its own, `memory_steps.rank<r>.jsonl`."""
        name = self.memory_steps_name
        if self.accelerator.num_processes > 1:
            name = name.replace(".jsonl", f".rank{self.accelerator.process_index}.jsonl")
        return Path(self.args.output_dir) / name

    def _start_memory_steps_file(self) -> None:
        self.memory_steps_path.parent.mkdir(parents=True, exist_ok=True)
        self.memory_steps_path.write_text("")

    def _end_profiled_step(self) -> None:
        if self._profiler.current_phase == "optimizer":
            self._profiler.stop("optimizer")
        entry = self._profiler.end_step(self.state.global_step)
        # Appended, never rewritten: a step costs one line of I/O however long the run (closing flushes it)
        with open(self.memory_steps_path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def memory_step_records(self) -> list[dict]:
        """Every step's record of the last `train()` call on this process, read back from its steps file."""
        with open(self.memory_steps_path) as f:
            return [json.loads(line) for line in f]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._profiler is not None and self.model.training and "loss" in logs:
            logs.update(self._profiler.log_metrics())
            if not is_accelerator(self._profiler.device):
                logs["memory/rss_after_load_gib"] = self._profiler.baseline_gib
        elif self._profiler is not None and not self.model.training:
            # TRL prefixes its own metrics in eval mode with "eval_" whatever the evaluation's prefix: so do we
            logs.update({f"eval_{key}": value for key, value in self._profiler.eval_metrics().items()})
        super().log(logs, start_time)

    def memory_report(self) -> dict:
        """
        The whole-run summary, the environment and the config, with the records of the first steps and the bounded
        timeline; every step's record is in `steps_file` (relative to `output_dir`), see [`memory_step_records`].
        """
        profiler = self._profiler
        config = {key: value for key, value in self.args.to_dict().items() if not key.startswith("_")}
        return {
            "trainer": f"{type(self).__module__}.{type(self).__qualname__}",
            "rank": self.accelerator.process_index,
            "world_size": self.accelerator.num_processes,
            "environment": environment_info(profiler.device),
            "units": "GiB and seconds",
            "memory_after_load_gib": profiler.baseline_gib,
            "empty_cache_policy": profiler.empty_cache_policy,
            "summary": profiler.summary(),
            "num_steps": profiler.num_steps,
            "steps_file": self.memory_steps_name,
            "first_steps": profiler.first_steps,
            "timeline": profiler.timeline,
            "config": config,
        }

    def write_memory_report(self) -> None:
        """
        Writes `memory_report.json` from the main process, atomically. With several processes, every process must call
        it (the callbacks do, at checkpoints and at the end): the summary becomes the maximum over the processes' peaks,
        and `per_rank` holds each process's own summary.
        """
        if self._profiler is None:
            return
        report = self.memory_report()
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            summaries = gather_object([report["summary"]])
            report["per_rank"] = summaries
            report["summary"] = max_over_ranks(summaries)
        if self.accelerator.is_main_process:
            write_json_atomic(Path(self.args.output_dir) / self.memory_report_name, report)
