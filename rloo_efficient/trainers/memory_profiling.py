"""
Stock TRL trainers profiled per phase as ours are ([`profiled`]): the benchmarks' baseline. Our own trainers hold the
same part ([`profiling.trainer_profiling.TrainerProfiling`]) without this module; `MemoryProfilingMixin` is kept for
one release.
"""

import warnings

from ..profiling.trainer_profiling import PROFILING_OFF, TrainerProfiling


class _ProfiledStock:
    """
    The overrides that open [`TrainerProfiling`]'s phases in a stock trainer, each calling `super()`: `__init__` (the
    part and its callbacks), `_generate`, `_calculate_rewards`, `_generate_and_score_completions`,
    `_get_per_token_logps_and_entropies`, `training_step` (phase boundaries) and `log` (the part's metrics).
    """

    memory_profiling: TrainerProfiling = PROFILING_OFF  # a trainer made without `__init__`: each override is TRL's

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.memory_profiling = TrainerProfiling.from_args(self.args, self.accelerator, lambda: self.model.training,
                                                           self.ref_model, trainer_class=type(self))  # fmt: skip
        for callback in self.memory_profiling.callbacks:
            self.add_callback(callback)

    def _generate(self, prompts):
        with self.memory_profiling.phase("generation"):
            return super()._generate(prompts)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self.memory_profiling.phase("reward"):
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def _generate_and_score_completions(self, inputs):
        with self.memory_profiling.scoring():
            return super()._generate_and_score_completions(inputs)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        with self.memory_profiling.scoring_pass(model):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch):
        # The optimizer phase follows a window's last micro-batch, as transformers marks it (an epoch's short one too)
        with self.memory_profiling.micro_batch(lambda: self.accelerator.sync_gradients):
            return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.update(self.memory_profiling.logs(logs))  # in place, as TRL's own metrics: `evaluate()` returns them
        super().log(logs, start_time)


def profiled(trainer_class: type) -> type:
    """
    `trainer_class` (stock [`trl.RLOOTrainer`], [`trl.GRPOTrainer`] or a subclass) with the per-phase memory and time
    profiling of ours ([`TrainerProfiling`], as `trainer.memory_profiling`), and nothing else changed:

        ProfiledRLOOTrainer = profiled(trl.RLOOTrainer)

    Reads `profile_memory` and `empty_cache_policy` from `args` where present (stock `trl.RLOOConfig` has neither:
    profiling on, no release). Our own trainers are profiled already: they are refused.
    """
    _check_not_profiled(trainer_class)
    return type(f"Profiled{trainer_class.__name__}", (_ProfiledStock, trainer_class),
                {"__module__": __name__, "__doc__": f"{trainer_class.__name__}, profiled per phase."})  # fmt: skip


def _check_not_profiled(trainer_class: type) -> None:
    """Refuses a trainer class that holds its own part (ours): its phases would be opened twice."""
    if any("memory_profiling" in vars(cls) for cls in trainer_class.__mro__ if not issubclass(cls, _ProfiledStock)):
        raise TypeError(f"{trainer_class.__name__} is profiled already (rloo_efficient's trainers hold their own "
                        f"`memory_profiling`): use it as it is.")  # fmt: skip


def _moved_to_part(old: str, new: str) -> None:
    warnings.warn(f"trainer.{old} is deprecated: it is trainer.memory_profiling.{new} (trainer.{old} goes in the next "
                  f"release).", DeprecationWarning, stacklevel=3)  # fmt: skip


class ProfilingAccessors:
    """The trainer's methods of the former profiling mixin, each now its part's (`trainer.memory_profiling`,
    [`TrainerProfiling`]): kept on our trainers and the deprecated mixin for one release, each with a warning."""

    memory_report_name = TrainerProfiling.report_name
    memory_steps_name = TrainerProfiling.steps_name

    @property
    def memory_steps_path(self):
        _moved_to_part("memory_steps_path", "steps_path")
        return self.memory_profiling.steps_path

    def memory_step_records(self) -> list[dict]:
        _moved_to_part("memory_step_records()", "step_records()")
        return self.memory_profiling.step_records()

    def memory_report(self) -> dict:
        _moved_to_part("memory_report()", "report()")
        return self.memory_profiling.report()

    def write_memory_report(self) -> None:
        _moved_to_part("write_memory_report()", "write_report()")
        self.memory_profiling.write_report()


class MemoryProfilingMixin(ProfilingAccessors, _ProfiledStock):
    """
    Deprecated: `class Profiled(MemoryProfilingMixin, trl.RLOOTrainer)` is `profiled(trl.RLOOTrainer)`, whose part
    is `trainer.memory_profiling` ([`TrainerProfiling`]). The trainer's methods of the mixin, kept for one release,
    are the part's ([`ProfilingAccessors`]).
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _check_not_profiled(cls)
        warnings.warn("rloo_efficient.MemoryProfilingMixin is deprecated: profile a stock trainer with "
                      "rloo_efficient.profiled(trl.RLOOTrainer) (the part is `trainer.memory_profiling`); the mixin "
                      "goes in the next release.", DeprecationWarning, stacklevel=2)  # fmt: skip


# The names this module held before they moved, importable from here for one release
_MOVED = {
    "git_commit": "rloo_efficient.profiling.results", "environment_info": "rloo_efficient.profiling.results",
    "json_ready": "rloo_efficient.profiling.results", "write_json_atomic": "rloo_efficient.profiling.results",
    "PACKAGE_DIR": "rloo_efficient.profiling.results",
    "SHARING_COUNTERS": "rloo_efficient.profiling.trainer_profiling",
    "PHASES": "rloo_efficient.profiling.phase_profiler", "PhaseProfiler": "rloo_efficient.profiling.phase_profiler",
    "max_over_ranks": "rloo_efficient.profiling.phase_profiler",
}  # fmt: skip


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    warnings.warn(f"{__name__}.{name} moved to {_MOVED[name]}: import it from there ({__name__}.{name} goes in the "
                  f"next release).", DeprecationWarning, stacklevel=2)  # fmt: skip
    return getattr(importlib.import_module(_MOVED[name]), name)
