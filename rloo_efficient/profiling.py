"""Per-phase memory and time of an RLOO step, and the trainer mixin that records them."""

import contextlib
import functools
import json
import os
import platform
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
    is_accelerator,
    peak_rss_resettable,
    release_cached_memory,
    reset_peak_memory,
)


PHASES = ("generation", "policy_logps", "reference_logps", "reward", "train", "optimizer")


class PhaseProfiler:
    """
    Records, for each phase of each optimizer step, the peak memory and the time spent while that phase was the
    innermost one. Phases nest: stock TRL generates inside `training_step`, so while `generation` runs, `train` is
    paused, and `train`'s peak and time are those of its own segments only.

    Args:
        device (`torch.device`):
            The device whose memory is measured.
        empty_cache_policy (`str`):
            `"none"`, `"after_generation"` or `"every_phase"`: after which phases [`release_cached_memory`] runs.
    """

    def __init__(self, device: torch.device, empty_cache_policy: str = "none"):
        self.device = device
        self.empty_cache_policy = empty_cache_policy
        self.baseline_gib = current_memory_gib(device)  # memory right after the models were loaded
        self.steps: list[dict] = []  # one record per optimizer step
        self.release_boundaries: list[str] = []  # phases after which memory was released, in order (for tests)
        self.timeline: list[dict] = []  # one entry per closed segment: when, which phase, its peak, memory at its end
        self._t0 = time.perf_counter()
        self._stack: list[str] = []
        self._segment_start = 0.0
        self._current: dict[str, dict[str, float]] = defaultdict(dict)

    # -- phase boundaries ---------------------------------------------------------------------------------------
    def _close_segment(self) -> None:
        """Folds the peak and time since the last boundary into the innermost phase."""
        now = time.perf_counter()
        if self._stack:
            record = self._current[self._stack[-1]]
            stats = get_memory_stats(self.device)
            for name, value in stats.items():
                record[name] = max(record.get(name, 0.0), value)
            record["time_s"] = record.get("time_s", 0.0) + now - self._segment_start
            self.timeline.append({"start_s": self._segment_start - self._t0, "end_s": now - self._t0,
                                  "phase": self._stack[-1], "step": len(self.steps) + 1, **stats,
                                  **current_memory_stats(self.device)})  # fmt: skip
        else:
            reset_peak_memory(self.device)
        self._segment_start = time.perf_counter()

    def start(self, phase: str) -> None:
        self._close_segment()
        self._stack.append(phase)

    def stop(self, phase: str) -> None:
        if not self._stack or self._stack[-1] != phase:
            raise RuntimeError(f"Phase {phase!r} stopped while {self._stack} were running.")
        self._close_segment()
        self._stack.pop()
        if self.empty_cache_policy == "every_phase" or (
            self.empty_cache_policy == "after_generation" and phase == "generation"
        ):
            start = time.perf_counter()
            release_cached_memory(self.device)
            record = self._current[phase]
            record["release_s"] = record.get("release_s", 0.0) + time.perf_counter() - start
            self.release_boundaries.append(phase)
            reset_peak_memory(self.device)  # the release is not part of the next phase
            self._segment_start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    @property
    def current_phase(self) -> str | None:
        return self._stack[-1] if self._stack else None

    # -- steps ----------------------------------------------------------------------------------------------------
    def end_step(self, step: int) -> dict:
        """Closes the record of optimizer step `step` and returns it."""
        phases = {}
        for name, record in self._current.items():
            record = dict(record)
            if "peak_rss_gib" in record:
                record["peak_working_gib"] = record["peak_rss_gib"] - self.baseline_gib
            phases[name] = record
        entry = {"step": step, "phases": phases}
        self.steps.append(entry)
        self._current = defaultdict(dict)
        return entry

    def metrics_for(self, steps: list[dict]) -> dict[str, float]:
        """
        Flat log metrics over `steps`: `memory/<phase>/<stat>` is the largest peak among them (GiB),
        `time/<phase>_s` the mean time per step, `time/cache_release_s` the mean release time per step.
        """
        peaks: dict[str, float] = {}
        times: dict[str, float] = defaultdict(float)
        for entry in steps:
            for phase, record in entry["phases"].items():
                for stat, value in record.items():
                    if stat.endswith("_gib"):
                        key = f"memory/{phase}/{stat}"
                        peaks[key] = max(peaks.get(key, float("-inf")), value)
                    elif stat == "time_s":
                        times[f"time/{phase}_s"] += value
                    elif stat == "release_s":
                        times["time/cache_release_s"] += value
        n = max(len(steps), 1)
        return {**peaks, **{key: value / n for key, value in times.items()}}

    def summary(self) -> dict:
        """Whole-run peak per phase and stat, and the whole-run peak over all phases."""
        per_phase: dict[str, dict[str, float]] = defaultdict(dict)
        for entry in self.steps:
            for phase, record in entry["phases"].items():
                for stat, value in record.items():
                    if stat.endswith("_gib"):
                        per_phase[phase][stat] = max(per_phase[phase].get(stat, float("-inf")), value)
        overall = {}
        for stats in per_phase.values():
            for stat, value in stats.items():
                overall[stat] = max(overall.get(stat, float("-inf")), value)
        return {"per_phase": dict(per_phase), "overall": overall}


@functools.lru_cache(maxsize=None)
def environment_info(device: torch.device) -> dict:
    """Device, library versions and git commit: what a results file needs to describe itself."""
    import accelerate
    import transformers
    import trl

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "device": device_description(device),
        "device_type": device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "accelerate": accelerate.__version__,
        "git_commit": commit,
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

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._end_profiled_step()

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
    """

    memory_report_name = "memory_report.json"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._profiler = None
        if getattr(self.args, "profile_memory", True):
            self._profiler = PhaseProfiler(self.accelerator.device, getattr(self.args, "empty_cache_policy", "none"))
            self._logged_steps = 0  # profiler steps already folded into a log line
            self._scoring_pass = None  # index of the next no-grad log-prob pass within a scoring call
            self.add_callback(_StepBoundaryCallback(self))

    def _phase(self, name: str):
        return self._profiler.phase(name) if self._profiler is not None else contextlib.nullcontext()

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
        with self._phase("train"):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if self._profiler is not None and self._step % self.current_gradient_accumulation_steps == 0:
            # The last micro-batch of the accumulation: what follows, until on_step_end, is the optimizer step
            self._profiler.start("optimizer")
        return loss

    def _end_profiled_step(self) -> None:
        if self._profiler is None:
            return
        if self._profiler.current_phase == "optimizer":
            self._profiler.stop("optimizer")
        self._profiler.end_step(self.state.global_step)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._profiler is not None and self.model.training and "loss" in logs:
            new_steps = self._profiler.steps[self._logged_steps :]
            self._logged_steps = len(self._profiler.steps)
            logs.update(self._profiler.metrics_for(new_steps))
            if not is_accelerator(self._profiler.device):
                logs["memory/rss_after_load_gib"] = self._profiler.baseline_gib
            self.write_memory_report()
        super().log(logs, start_time)

    def memory_report(self) -> dict:
        """Every step's per-phase numbers, their whole-run summary, the environment and the config."""
        profiler = self._profiler
        config = {key: value for key, value in self.args.to_dict().items() if not key.startswith("_")}
        return {
            "trainer": f"{type(self).__module__}.{type(self).__qualname__}",
            "environment": environment_info(profiler.device),
            "units": "GiB and seconds",
            "memory_after_load_gib": profiler.baseline_gib,
            "empty_cache_policy": profiler.empty_cache_policy,
            "summary": profiler.summary(),
            "steps": profiler.steps,
            "timeline": profiler.timeline,
            "config": config,
        }

    def write_memory_report(self) -> None:
        if self._profiler is None or not self.accelerator.is_main_process:
            return
        write_json_atomic(Path(self.args.output_dir) / self.memory_report_name, self.memory_report())
