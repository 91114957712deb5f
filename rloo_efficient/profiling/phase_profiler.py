"""The per-phase record of an RLOO run: peak memory and time of each phase of each optimizer step, bounded in size."""

import contextlib
import json
import time
from collections import defaultdict

import torch

from .memory import (
    current_memory_gib,
    current_memory_stats,
    get_memory_stats,
    headline_peak_stat,
    is_accelerator,
    release_cached_memory,
    reset_peak_memory,
    synchronize,
)


PHASES = ("generation", "policy_logps", "reference_logps", "reward", "train", "optimizer")


def resolved_policy(policy: str, device: torch.device) -> str:
    """An `empty_cache_policy` as `device` runs it: `"auto"` is `"after_generation"` on CPU (`malloc_trim` hands
    decoding's freed pages back for a few ms) and `"none"` on an accelerator (its caching allocator would allocate
    them again in the next generation: 1.13-1.16x a `generate` call's time on an H200)."""
    if policy != "auto":
        return policy
    return "none" if is_accelerator(device) else "after_generation"


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
            `"none"`, `"after_generation"` or `"every_phase"`: after which phases [`release_cached_memory`] runs;
            `"auto"` as [`resolved_policy`] reads it for `device`.
        keep_first_steps (`int`, *optional*, defaults to `5`):
            How many of the first steps keep their record and phase segments, for the report's first steps and
            timeline.
    """

    keep_first_steps = 5

    def __init__(self, device: torch.device, empty_cache_policy: str = "none", keep_first_steps: int | None = None):
        self.device = device
        self.empty_cache_policy = resolved_policy(empty_cache_policy, device)
        if keep_first_steps is not None:
            self.keep_first_steps = keep_first_steps
        self.baseline_gib = current_memory_gib(device)  # memory right after the models were loaded
        self.release_boundaries: list[str] = []  # phases after which memory was released, in order (for tests)
        self.restore([])  # the run's record, empty
        self._t0 = time.perf_counter()
        self._step_start = self._t0
        self._stack: list[tuple[str, bool]] = []  # (phase, evaluating)
        self._segment_start = 0.0
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

    def restore(self, entries: list[dict]) -> None:
        """Starts the run's record anew (a `train()` call's) from the records [`end_step`] returned for its earlier
        steps (a resumed run's, or none): they count as ended steps in the summary, the step count and the first
        steps, not in the timeline (their segments are gone) or the logs."""
        self.num_steps = 0  # optimizer steps ended
        self.first_steps: list[dict] = []  # the records of the first `keep_first_steps` steps
        self._run = _Aggregate()  # every step, for the summary
        self._since_log = _Aggregate()  # the steps since the last log_metrics()
        # Closed segments (when, which phase, its peak, memory at its end): of the first steps, of the last ended step,
        # and of the step in progress
        self._first_segments: list[dict] = []
        self._last_segments: list[dict] = []
        self._open_segments: list[dict] = []
        self._current: dict[str, dict[str, float]] = defaultdict(dict)  # the training step in progress
        for entry in entries:
            self._run.add(entry["phases"])
            self.num_steps += 1
            if self.num_steps <= self.keep_first_steps:
                self.first_steps.append(entry)

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
