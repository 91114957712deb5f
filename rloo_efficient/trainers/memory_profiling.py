"""The trainer mixin that records each phase's memory and time ([`phase_profiler`]), and the files it writes."""

import contextlib
import functools
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from transformers import TrainerCallback

from ..core.once import WarnOnce
from ..profiling.memory import device_description, is_accelerator, peak_rss_resettable
from ..profiling.phase_profiler import PHASES, PhaseProfiler, max_over_ranks  # noqa: F401 (PHASES: part of this module's API)


SHARING_COUNTERS = ("packed_forward_tokens", "tree_tokens", "held_forward_tokens", "shared_prefill_tokens",
                    "reward_forward_tokens")
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # rloo_efficient/


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

    from .. import __version__  # here: the package imports this module before it defines its version

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


def json_ready(value):
    """`value` as JSON takes it: a dict key other than a string, number, bool or None (transformers' `sequence_bias`
    keys are token tuples) as its `repr`, a tuple as a list, any other value JSON cannot hold as its `repr`."""
    if isinstance(value, dict):
        return {key if key is None or isinstance(key, (str, int, float, bool)) else repr(key): json_ready(item)
                for key, item in value.items()}  # fmt: skip
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def write_json_atomic(path: str | os.PathLike, payload: dict) -> None:
    """Writes `payload` ([`json_ready`]) to `path` through a temporary file and a rename, so that a crash never leaves
    half a file, and a failed write leaves neither the temporary file nor a changed `path`."""
    path = Path(path)
    text = json.dumps(json_ready(payload), indent=2)  # before any file is opened
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_warnings = WarnOnce()  # the files that could not be written, once per process


def _warn_unwritten(name: str, error: BaseException) -> None:
    """One warning per file name and process: a report that could not be written does not stop training."""
    _warnings.warn(f"rloo_efficient: {name} could not be written ({type(error).__name__}: {error}); training goes on "
                   f"without it.", key=name, stacklevel=2)  # fmt: skip


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
    Adds per-phase memory and time profiling to a TRL group trainer (RLOO, GRPO) without changing what it computes.
    Mix it in before the trainer class: `class ProfiledRLOOTrainer(MemoryProfilingMixin, trl.RLOOTrainer)`.

    Phases: `generation` (`_generate`: tokenization, decoding, detokenization), `policy_logps` and
    `reference_logps` (the no-grad `_get_per_token_logps_and_entropies` calls of `_generate_and_score_completions`,
    named by the model they run), `reward` (`_calculate_rewards`), `train` (`training_step` less the phases
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
    # Profiling off for a trainer made without our `__init__` (a unit test's bare object): each wrapper is TRL's method
    _profiler: PhaseProfiler | None = None
    _scoring = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._profiler = None
        self._scoring = False  # within `_generate_and_score_completions`, whose no-grad passes are phases
        if getattr(self.args, "profile_memory", True):
            self._profiler = PhaseProfiler(self.accelerator.device, getattr(self.args, "empty_cache_policy", "none"))
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
        self._scoring = True
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._scoring = False

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        if self._profiler is None or not self._scoring or torch.is_grad_enabled():
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        # A scoring pass, named by the model it runs: GRPO runs the policy's (old log-probs) only when generation and
        # optimizer steps are out of step, and the reference's only with beta > 0
        name = "reference_logps" if self._is_reference_pass(model) else "policy_logps"
        with self._phase(name):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def _is_reference_pass(self, model) -> bool:
        """Whether a forward of `model` computes the reference's log-probs: the reference model itself, or the PEFT
        policy with its adapters off or TRL's "ref" adapter active (as TRL's `use_adapter` sets them)."""
        if self.ref_model is not None and model is self.ref_model:
            return True
        unwrapped = self.accelerator.unwrap_model(model)
        if not is_peft_model(unwrapped):
            return False
        return bool(getattr(unwrapped, "_adapters_disabled", False)) or unwrapped.active_adapter == "ref"

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
        try:
            self.memory_steps_path.parent.mkdir(parents=True, exist_ok=True)
            self.memory_steps_path.write_text("")
        except OSError as error:
            _warn_unwritten(self.memory_steps_path.name, error)

    def _end_profiled_step(self) -> None:
        if self._profiler.current_phase == "optimizer":
            self._profiler.stop("optimizer")
        entry = self._profiler.end_step(self.state.global_step)
        # Appended, never rewritten: a step costs one line of I/O however long the run (closing flushes it)
        try:
            with open(self.memory_steps_path, "a") as f:
                f.write(json.dumps(entry) + "\n")  # the profiler's own numbers
        except OSError as error:
            _warn_unwritten(self.memory_steps_path.name, error)

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
            # rloo_efficient's own trainers: tokens each sharing path forwarded (0 where it never engaged)
            "sharing_tokens": {name: getattr(self, name) for name in SHARING_COUNTERS if hasattr(self, name)},
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
            try:
                write_json_atomic(Path(self.args.output_dir) / self.memory_report_name, report)
            except (OSError, ValueError, TypeError) as error:  # (ValueError: a circular reference)
                _warn_unwritten(self.memory_report_name, error)
