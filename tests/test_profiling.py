"""
Per-phase memory metrics reach the logs, memory_steps.jsonl and memory_report.json; evaluation stays out of the
training steps; the profiler's memory is bounded; cache release happens at the right boundaries.
"""

import json
import subprocess

import pytest
import torch
from transformers import TrainerCallback

import rloo_efficient
import rloo_efficient.profiling.phase_profiler as phase_profiler
from rloo_efficient import RLOOTrainer
from rloo_efficient.core.once import WarnOnce
from rloo_efficient.demo.workload import build_dataset, build_model_dir, build_tokenizer, vowel_reward
from rloo_efficient.profiling.phase_profiler import PHASES, PhaseProfiler
from rloo_efficient.profiling.results import git_commit
from rloo_efficient.profiling.trainer_profiling import SHARING_COUNTERS

from .conftest import assert_metrics_close, per_micro_batch, run, step_metrics, tiny_workload, training_args


class _FileWatcher(TrainerCallback):
    """What memory_steps.jsonl and memory_report.json hold when each event fires (added after the trainer's own)."""

    def __init__(self, output_dir):
        self.steps_file = output_dir / "memory_steps.jsonl"
        self.report_file = output_dir / "memory_report.json"
        self.lines_at_step_end, self.report_steps_at_log, self.report_steps_at_save = [], [], []

    def _report_steps(self):
        return json.loads(self.report_file.read_text())["num_steps"] if self.report_file.exists() else None

    def on_step_end(self, args, state, control, **kwargs):
        self.lines_at_step_end.append(len(self.steps_file.read_text().splitlines()))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.report_steps_at_log.append(self._report_steps())

    def on_save(self, args, state, control, **kwargs):
        self.report_steps_at_save.append(self._report_steps())


@pytest.fixture(scope="module")
def profiled_run(workload, tmp_path_factory):
    """Two steps, each logged, evaluated (between the steps, too) and checkpointed."""
    cfg, path, dataset = workload
    output_dir = tmp_path_factory.mktemp("profiled")
    (output_dir / "memory_steps.jsonl").write_text(json.dumps({"step": 9, "phases": {}}) + "\n")  # a previous run's
    # One prompt x 4 generations: a single eval batch keeps each evaluation to one generation
    args = training_args(output_dir, max_steps=2, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4,
                         save_strategy="steps", save_steps=1)  # fmt: skip
    trainer = RLOOTrainer(model=path, reward_funcs=vowel_reward, args=args, train_dataset=dataset,
                          eval_dataset=dataset.select(range(1)), processing_class=build_tokenizer())  # fmt: skip
    trainer.watcher = _FileWatcher(output_dir)
    trainer.add_callback(trainer.watcher)  # after the profiler's callback: it sees what that one wrote
    trainer.train()
    trainer.packed_in_training = trainer.packed_forward_tokens
    trainer.evaluated = trainer.evaluate()  # (returns what it logs, ours included)
    return trainer


def test_every_phase_reaches_the_logs(profiled_run):
    logged = [entry for entry in profiled_run.state.log_history if "loss" in entry]
    first = logged[0]  # step 1 generates, scores, trains and steps the optimizer
    for phase in PHASES:
        assert first[f"memory/{phase}/peak_rss_gib"] > 0, phase
        assert f"memory/{phase}/peak_working_gib" in first
        assert first[f"time/{phase}_s"] >= 0
    assert first["memory/rss_after_load_gib"] > 0
    # Step 2 reuses the buffered generation (steps_per_generation=2): no generation or scoring phase
    assert "memory/generation/peak_rss_gib" not in logged[1] and "memory/train/peak_rss_gib" in logged[1]


def test_every_step_is_appended_to_the_steps_file_as_it_ends(profiled_run):
    assert profiled_run.watcher.lines_at_step_end == [1, 2]
    records = profiled_run.memory_profiling.step_records()
    assert [entry["step"] for entry in records] == [1, 2]
    assert set(records[0]["phases"]) == set(PHASES)


def test_memory_report_is_written_at_checkpoints_and_at_the_end_not_at_logs(profiled_run):
    watcher = profiled_run.watcher
    # Step 2's log comes before its checkpoint: the report it sees is step 1's checkpoint's
    assert watcher.report_steps_at_log == [None, 1]
    assert watcher.report_steps_at_save == [1, 2]
    report = json.loads(watcher.report_file.read_text())
    assert report["num_steps"] == 2 and report["steps_file"] == "memory_steps.jsonl"
    assert report["first_steps"] == profiled_run.memory_profiling.step_records()
    assert report["environment"]["torch"] == torch.__version__ and report["environment"]["trl"]
    assert report["environment"]["rloo_efficient"] == rloo_efficient.__version__
    assert report["config"]["num_generations"] == 4 and report["config"]["share_prompt_prefix"] is True
    assert report["trainer"] == "rloo_efficient.trainers.rloo.RLOOTrainer"
    assert set(report["sharing_tokens"]) == set(SHARING_COUNTERS) == {
        "packed_forward_tokens", "tree_tokens", "held_forward_tokens", "shared_prefill_tokens",
        "reward_forward_tokens"}  # (docs/logging.md's)  # fmt: skip
    assert report["sharing_tokens"]["packed_forward_tokens"] == profiled_run.packed_in_training > 0
    summary = report["summary"]
    every_peak = [record["peak_rss_gib"] for entry in report["first_steps"] for record in entry["phases"].values()]
    assert summary["peak_stat"] == "peak_rss_gib" and summary["peak_gib"] == max(every_peak)
    assert summary["overall"]["peak_rss_gib"] == summary["peak_gib"]


def test_evaluation_stays_out_of_the_training_steps(profiled_run):
    # Step 2 reuses step 1's buffered generation: the evaluation run between them generated and scored, yet step 2
    # holds only its own phases
    step_2 = profiled_run.memory_profiling.step_records()[1]
    assert set(step_2["phases"]) == {"train", "optimizer"}
    assert [segment["phase"] for segment in profiled_run.memory_profiling.report()["timeline"] if segment["step"] == 2] == [
        "train", "optimizer"]  # fmt: skip
    evaluations = [entry for entry in profiled_run.state.log_history if "eval_loss" in entry]
    assert len(evaluations) == 3 and evaluations[-1] == {**profiled_run.evaluated, "step": 2}
    for entry in evaluations:  # each evaluation's own phases, logged with it
        assert entry["eval_memory/generation/peak_rss_gib"] > 0 and entry["eval_time/generation_s"] > 0
        assert not any(key.startswith(("memory/", "time/")) for key in entry)
        assert "eval_memory/train/peak_rss_gib" not in entry


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("none", []),
        ("after_generation", ["generation"]),
        ("auto", ["generation"]),  # the default, on CPU
        # Scoring, then step 1's train and optimizer; step 2 only trains and steps
        ("every_phase", ["generation", "policy_logps", "reference_logps", "reward", "train", "optimizer", "train", "optimizer"]),
    ],
)
def test_cache_release_boundaries(workload, tmp_path, monkeypatch, policy, expected):
    cfg, path, dataset = workload
    released = []
    monkeypatch.setattr(phase_profiler, "release_cached_memory", lambda device: released.append(device))
    trainer = run(RLOOTrainer, path, training_args(tmp_path, max_steps=2, empty_cache_policy=policy), dataset)
    assert trainer.memory_profiling.profiler.release_boundaries == expected
    assert len(released) == len(expected)  # the release itself ran once per boundary
    release_logged = [entry.get("time/cache_release_s") for entry in trainer.state.log_history if "loss" in entry]
    assert (release_logged[0] is not None) == bool(expected)


@pytest.mark.parametrize("device, expected", [("cpu", "after_generation"), ("cuda", "none"), ("xpu", "none")])
def test_auto_cache_release_by_device(device, expected):
    assert phase_profiler.resolved_policy("auto", torch.device(device)) == expected
    assert phase_profiler.resolved_policy("every_phase", torch.device(device)) == "every_phase"


def test_a_logged_phase_time_is_the_mean_per_step_and_its_peak_the_most():
    """Over a logging interval (`logging_steps` > 1) `time/<phase>_s` is the mean per step (docs/logging.md), a peak the
    largest."""
    aggregate = phase_profiler._Aggregate()
    aggregate.add({"train": {"time_s": 1.0, "peak_rss_gib": 1.0}})
    aggregate.add({"train": {"time_s": 3.0, "peak_rss_gib": 2.0}})
    metrics = aggregate.metrics()
    assert metrics["time/train_s"] == 2.0 and metrics["memory/train/peak_rss_gib"] == 2.0


def test_nested_phases_count_their_own_segments():
    profiler = PhaseProfiler(torch.device("cpu"))
    with profiler.phase("train"):
        with profiler.phase("generation"):
            pass
    record = profiler.end_step(1)
    assert set(record["phases"]) == {"train", "generation"}
    assert profiler.first_steps == [record]
    with pytest.raises(RuntimeError, match="stopped while"):
        profiler.start("train")
        profiler.stop("generation")


def test_profiler_memory_is_bounded_and_the_summary_covers_every_step(monkeypatch):
    profiler = PhaseProfiler(torch.device("cpu"), keep_first_steps=2)
    current_step = [0]

    def fake_stats(device):
        # 1 GiB everywhere but in step 5's train phase, 3 GiB: a step long dropped from memory by step 12
        return {"peak_rss_gib": 3.0 if (current_step[0], profiler.current_phase) == (5, "train") else 1.0}

    monkeypatch.setattr(phase_profiler, "get_memory_stats", fake_stats)
    monkeypatch.setattr(phase_profiler, "reset_peak_memory", lambda device: None)
    for step in range(1, 13):
        current_step[0] = step
        for phase in ("train", "optimizer"):
            with profiler.phase(phase):
                pass
        profiler.end_step(step)
        if step == 5:
            assert profiler.log_metrics()["memory/train/peak_rss_gib"] == 3.0
    assert [entry["step"] for entry in profiler.first_steps] == [1, 2]
    assert [(s["step"], s["phase"]) for s in profiler.timeline] == [
        (1, "train"), (1, "optimizer"), (2, "train"), (2, "optimizer"), (12, "train"), (12, "optimizer")]  # fmt: skip
    summary = profiler.summary()
    assert summary["per_phase_peak_gib"] == {"train": 3.0, "optimizer": 1.0} and summary["peak_gib"] == 3.0
    # Steps 6 to 12 only: step 5's peak went into the previous call's metrics
    assert profiler.log_metrics()["memory/train/peak_rss_gib"] == 1.0


def _git_repo(path, project_name):
    path.mkdir(parents=True)
    (path / "pyproject.toml").write_text(f'[project]\nname = "{project_name}"\nversion = "0"\n')
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"],
                   cwd=path, check=True)  # fmt: skip
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, check=True, capture_output=True, text=True)
    return head.stdout.strip()


@pytest.mark.parametrize("layout", ["our checkout", "another project's package", "installed in another repo",
                                    "vendored copy in another repo"])  # fmt: skip
def test_git_commit_is_only_our_own_checkouts(tmp_path, layout):
    if layout == "our checkout":
        head = _git_repo(tmp_path / "repo", "rloo_efficient")
        package, expected = tmp_path / "repo" / "rloo_efficient", head
    elif layout == "another project's package":  # the package directory sits at the top of someone else's repo
        _git_repo(tmp_path / "repo", "other")
        package, expected = tmp_path / "repo" / "rloo_efficient", None
    elif layout == "installed in another repo":  # a virtualenv inside another project's work tree
        _git_repo(tmp_path / "repo", "other")
        package, expected = tmp_path / "repo" / ".venv" / "lib" / "site-packages" / "rloo_efficient", None
    else:  # our sources, pyproject.toml included, unpacked inside another repository
        _git_repo(tmp_path / "repo", "other")
        vendored = tmp_path / "repo" / "vendor" / "rloo_efficient-0.1.0"
        vendored.mkdir(parents=True)
        (vendored / "pyproject.toml").write_text('[project]\nname = "rloo_efficient"\n')
        package, expected = vendored / "rloo_efficient", None
    package.mkdir(parents=True)
    assert git_commit(package) == expected


def test_settings_json_cannot_hold_train_to_the_end_as_stock_with_checkpoints(workload, tmp_path):
    """`generation_kwargs={"sequence_bias": {(token,): bias}}` (transformers' own form: tuple keys, which JSON cannot
    hold): ours trains to the end with a checkpoint at every step, equal to stock TRL run the same way, sharing
    engaged; the report holds the key as its repr, and no temporary file is left behind."""
    import trl

    cfg, path, dataset = workload
    settings = dict(generation_kwargs={"sequence_bias": {(2,): 10.0}}, save_strategy="steps", save_steps=1)
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "stock", config_class=trl.RLOOConfig, **settings),
                dataset)  # fmt: skip
    ours = run(RLOOTrainer, path, training_args(tmp_path / "ours", **settings), dataset)
    assert ours.state.global_step == stock.state.global_step == 3
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    assert_metrics_close(step_metrics(stock), step_metrics(ours), 1e-6, 1e-8)
    assert ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    assert sorted(p.name for p in (tmp_path / "ours").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2",
                                                                                "checkpoint-3"]  # fmt: skip
    report = json.loads((tmp_path / "ours" / "memory_report.json").read_text())
    assert report["config"]["generation_kwargs"] == {"sequence_bias": {"(2,)": 10.0}}
    assert report["num_steps"] == 3
    assert not list((tmp_path / "ours").rglob("*.tmp"))


def test_a_report_that_cannot_be_written_warns_once_and_training_goes_on(workload, tmp_path, monkeypatch):
    """A write that fails (a full disk, say) loses the report, not the run: one warning, no temporary file."""
    from rloo_efficient.profiling import trainer_profiling

    def full_disk(self, text, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer_profiling, "_warnings", WarnOnce())
    cfg, path, dataset = workload
    with monkeypatch.context() as patch, pytest.warns(UserWarning) as caught:
        patch.setattr(trainer_profiling.Path, "write_text", full_disk)
        trainer = run(RLOOTrainer, path, training_args(tmp_path, save_strategy="steps", save_steps=1), dataset)
    messages = [str(w.message) for w in caught if "could not be written" in str(w.message)]
    assert trainer.state.global_step == 3
    assert len([m for m in messages if "memory_report.json" in m]) == 1, messages
    assert not (tmp_path / "memory_report.json").exists() and not list(tmp_path.rglob("*.tmp"))


def test_json_ready_writes_what_json_cannot_hold(tmp_path):
    from rloo_efficient.profiling.results import json_ready, write_json_atomic

    assert json_ready({(1, 2): [torch.float32, (3, 4)], None: {frozenset(): 1}}) == {
        "(1, 2)": ["torch.float32", [3, 4]], None: {"frozenset()": 1}}
    target = tmp_path / "report.json"
    target.mkdir()  # a directory where the file goes: the rename fails
    with pytest.raises(OSError):
        write_json_atomic(target, {"a": 1})
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_profiled_stock_trainer_logs_and_writes_what_ours_does(workload, tmp_path, monkeypatch):
    """`profiled(trl.RLOOTrainer)`: the benchmarks' baseline, profiled by the same part as ours (no sharing counters),
    with a stock config releasing no cache (no `empty_cache_policy` to read)."""
    import trl

    from rloo_efficient import profiled

    _, path, dataset = workload
    released = []
    monkeypatch.setattr(phase_profiler, "release_cached_memory", lambda device: released.append(device))
    args = training_args(tmp_path, config_class=trl.RLOOConfig, max_steps=2)
    stock = run(profiled(trl.RLOOTrainer), path, args, dataset)
    assert released == []
    first = next(entry for entry in stock.state.log_history if "loss" in entry)
    for phase in PHASES:
        assert first[f"memory/{phase}/peak_rss_gib"] > 0 and f"time/{phase}_s" in first, phase
    assert first["memory/rss_after_load_gib"] > 0
    assert [entry["step"] for entry in stock.memory_profiling.step_records()] == [1, 2]
    report = json.loads((tmp_path / "memory_report.json").read_text())
    assert report["num_steps"] == 2 and report["sharing_tokens"] == {}
    assert report["trainer"] == "rloo_efficient.trainers.memory_profiling.ProfiledRLOOTrainer"
    with pytest.raises(TypeError, match="profiled already"):
        profiled(RLOOTrainer)


@pytest.mark.parametrize("trainer", ["ours", "profiled_stock"])
def test_the_optimizer_phase_follows_each_optimizer_step_across_epochs(model_cache, tmp_path, monkeypatch, trainer):
    """Two epochs of 4 micro-batches in windows of 3: each epoch ends with a window of 1, after which a count of
    micro-batches since the start would put the optimizer phase mid-window. It opens right after each micro-batch
    that ends a window, and only there, for ours and for the profiled stock baseline alike."""
    import trl

    from rloo_efficient import profiled

    cfg = tiny_workload(model_cache, num_prompts=5)  # 2 generations of 2 prompts (k=4, 4 rows a micro-batch) an epoch
    trainer_class, config_class = (RLOOTrainer, None) if trainer == "ours" else (profiled(trl.RLOOTrainer), trl.RLOOConfig)
    args = training_args(tmp_path, **({"config_class": config_class} if config_class else {}), max_steps=-1,
                         num_train_epochs=2, gradient_accumulation_steps=3, steps_per_generation=2)  # fmt: skip
    micro_batches, optimizer_at = [], []  # whether each micro-batch ends a window; where the optimizer phase opens
    start = PhaseProfiler.start

    def recorded(self, phase, evaluating=False):
        if phase == "optimizer":
            optimizer_at.append(len(micro_batches))  # (as the micro-batch under way ends)
        return start(self, phase, evaluating)

    step = trainer_class.training_step

    def training_step(self, *args):
        ends_window = self.accelerator.sync_gradients  # transformers sets it before the call
        try:
            return step(self, *args)
        finally:
            micro_batches.append(ends_window)

    monkeypatch.setattr(PhaseProfiler, "start", recorded)
    monkeypatch.setattr(trainer_class, "training_step", training_step)
    trained = run(trainer_class, build_model_dir(cfg), args, build_dataset(cfg))
    assert micro_batches == [False, False, True, True] * 2 and trained.state.global_step == 4
    assert optimizer_at == [2, 3, 6, 7]  # as each window's last micro-batch ends


def test_a_resumed_run_matches_stock_and_keeps_its_steps_before_the_checkpoint(workload, tmp_path, exact_head):
    """Four steps checkpointed at each, then resumed from the first checkpoint (mid-generation: TRL generates anew):
    the resumed steps are stock's resumed steps, and the steps file and report keep step 1's record from the first
    run, as the Trainer's log history does, with the steps after it from the resumed run only."""
    import trl


    _, path, dataset = workload
    resumed = {}
    for name, trainer_class, config_class in (("stock", trl.RLOOTrainer, trl.RLOOConfig), ("ours", RLOOTrainer, None)):
        args = training_args(tmp_path / name, **({"config_class": config_class} if config_class else {}), max_steps=4,
                             save_strategy="steps", save_steps=1)  # fmt: skip
        run(trainer_class, path, args, dataset)
        first_run = (tmp_path / name / "memory_steps.jsonl").read_text().splitlines() if name == "ours" else None
        trainer = trainer_class(model=path, reward_funcs=vowel_reward, args=args, train_dataset=dataset,
                                processing_class=build_tokenizer())  # fmt: skip
        trainer.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-1"))
        resumed[name] = trainer
    ours = resumed["ours"]
    assert ours.packed_forward_tokens > 0
    assert [entry["step"] for entry in ours.state.log_history if "loss" in entry] == [1, 2, 3, 4]  # restored
    assert_metrics_close(step_metrics(resumed["stock"]), step_metrics(ours), 1e-9, 1e-12, per_micro_batch(ours))
    lines = (tmp_path / "ours" / "memory_steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    assert lines[0] == first_run[0] and lines[1:] != first_run[1:]  # step 1 kept as written; 2 to 4 run again
    report = json.loads((tmp_path / "ours" / "memory_report.json").read_text())
    assert report["num_steps"] == 4 and report["first_steps"] == [json.loads(line) for line in lines]
    peaks = {}  # the summary: each phase's largest peaks over the four records
    for line in lines:
        for phase, record in json.loads(line)["phases"].items():
            for stat, value in record.items():
                if stat.endswith("_gib"):
                    peaks.setdefault(phase, {})[stat] = max(peaks.get(phase, {}).get(stat, value), value)
    assert report["summary"]["per_phase"] == peaks


def test_a_resumed_run_keeps_only_its_readable_records_up_to_the_checkpoint(tmp_path):
    """The steps file as a killed run leaves it: records past the checkpoint, then a line cut mid-write."""
    from types import SimpleNamespace

    from rloo_efficient.profiling.trainer_profiling import TrainerProfiling

    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0, is_main_process=True)
    profiling = TrainerProfiling(accelerator, tmp_path)
    records = [{"step": step, "time_s": 1.0, "phases": {"train": {"peak_rss_gib": float(step), "time_s": 1.0}}}
               for step in (1, 2, 3)]  # fmt: skip
    cut = '{"step": 2}\n{"step": 4, "ti'  # a record without phases, then a line cut mid-write
    (tmp_path / "memory_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + cut)
    profiling.train_begins(resumed_step=2)
    assert profiling.step_records() == records[:2]
    assert profiling.profiler.summary()["per_phase"]["train"]["peak_rss_gib"] == 2.0
    assert profiling.profiler.num_steps == 2
    profiling.train_begins()  # a new run: afresh
    assert profiling.step_records() == [] and profiling.profiler.num_steps == 0


def test_a_peft_models_reference_pass_is_the_reference_phase(workload, tmp_path):
    """A `PeftModel` policy: TRL copies its adapter as "ref" and scores the reference with that adapter active; the
    pass is the reference's phase, not the policy's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from .helpers import POLICY_LORA

    _, path, dataset = workload
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype="auto"), LoraConfig(**POLICY_LORA))
    trainer = run(RLOOTrainer, policy, training_args(tmp_path, max_steps=1, beta=0.1), dataset)
    assert "ref" in trainer.accelerator.unwrap_model(trainer.model).peft_config
    phases = {phase for step in trainer.memory_profiling.step_records() for phase in step["phases"]}
    assert {"policy_logps", "reference_logps"} <= phases


def test_profile_memory_off_adds_no_callback_no_metric_and_no_file(workload, tmp_path):
    from rloo_efficient.profiling.trainer_profiling import PROFILING_OFF, StepBoundaries

    _, path, dataset = workload
    trainer = run(RLOOTrainer, path, training_args(tmp_path, max_steps=1, profile_memory=False), dataset)
    assert trainer.memory_profiling is PROFILING_OFF
    assert not any(isinstance(callback, StepBoundaries) for callback in trainer.callback_handler.callbacks)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and not any(key.startswith(("memory/", "time/")) for entry in logged for key in entry)
    assert not (tmp_path / "memory_report.json").exists() and not (tmp_path / "memory_steps.jsonl").exists()


def test_the_trainers_former_profiling_methods_are_the_parts_for_one_release(workload, tmp_path):
    """Our trainers' methods of the former profiling mixin (`memory_report()` and the others) still answer, each the
    part's own, with one deprecation warning naming the part's method."""
    _, path, dataset = workload
    trainer = run(RLOOTrainer, path, training_args(tmp_path, max_steps=1), dataset)
    part = trainer.memory_profiling
    with pytest.warns(DeprecationWarning, match=r"trainer.memory_profiling.report\(\)"):
        assert trainer.memory_report() == part.report()
    with pytest.warns(DeprecationWarning, match=r"memory_profiling.step_records\(\)"):
        assert trainer.memory_step_records() == part.step_records() and part.step_records()
    with pytest.warns(DeprecationWarning, match="memory_profiling.steps_path"):
        assert trainer.memory_steps_path == part.steps_path


def test_the_mixin_and_its_moved_names_import_for_one_release_with_a_deprecation_warning():
    """`MemoryProfilingMixin` warns where a class subclasses it, and refuses our trainers (they profile themselves);
    the helpers that moved out of its module still import from it, each with one warning naming its new module."""
    import trl

    from rloo_efficient.profiling import results
    from rloo_efficient.trainers import memory_profiling

    with pytest.warns(DeprecationWarning, match="profiled") as caught:

        class Profiled(rloo_efficient.MemoryProfilingMixin, trl.RLOOTrainer):
            pass

    assert caught[0].filename == __file__
    assert Profiled.memory_report_name == "memory_report.json" and Profiled.memory_steps_name == "memory_steps.jsonl"
    with pytest.raises(TypeError, match="profiled already"):

        class Twice(rloo_efficient.MemoryProfilingMixin, RLOOTrainer):
            pass

    with pytest.warns(DeprecationWarning, match="rloo_efficient.profiling.results"):
        assert memory_profiling.write_json_atomic is results.write_json_atomic
    with pytest.warns(DeprecationWarning, match="rloo_efficient.profiling.phase_profiler"):
        assert memory_profiling.PHASES == PHASES
