"""Per-phase memory metrics reach the logs and memory_report.json; cache release happens at the right boundaries."""

import json

import pytest
import torch

import rloo_efficient.profiling as profiling
from rloo_efficient import RLOOTrainer
from rloo_efficient.memory import get_memory_stats, peak_rss_resettable
from rloo_efficient.profiling import PHASES, PhaseProfiler

from .conftest import run, training_args


@pytest.fixture(scope="module")
def profiled_run(workload, tmp_path_factory):
    cfg, path, dataset = workload
    output_dir = tmp_path_factory.mktemp("profiled")
    return run(RLOOTrainer, path, training_args(output_dir, max_steps=2), dataset)


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


def test_memory_report_holds_every_step(profiled_run):
    with open(f"{profiled_run.args.output_dir}/memory_report.json") as f:
        report = json.load(f)
    assert [entry["step"] for entry in report["steps"]] == [1, 2]
    assert set(report["steps"][0]["phases"]) == set(PHASES)
    assert report["environment"]["torch"] == torch.__version__ and report["environment"]["trl"]
    assert report["config"]["num_generations"] == 4 and report["config"]["share_prompt_prefix"] is True
    overall = report["summary"]["overall"]["peak_rss_gib"]
    assert overall == max(entry["phases"][p]["peak_rss_gib"] for entry in report["steps"] for p in entry["phases"])


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("none", []),
        ("after_generation", ["generation"]),
        # Scoring, then step 1's train and optimizer; step 2 only trains and steps
        ("every_phase", ["generation", "policy_logps", "reference_logps", "reward", "train", "optimizer", "train", "optimizer"]),
    ],
)
def test_cache_release_boundaries(workload, tmp_path, monkeypatch, policy, expected):
    cfg, path, dataset = workload
    released = []
    monkeypatch.setattr(profiling, "release_cached_memory", lambda device: released.append(device))
    trainer = run(RLOOTrainer, path, training_args(tmp_path, max_steps=2, empty_cache_policy=policy), dataset)
    assert trainer._profiler.release_boundaries == expected
    assert len(released) == len(expected)  # the release itself ran once per boundary
    release_logged = [entry.get("time/cache_release_s") for entry in trainer.state.log_history if "loss" in entry]
    assert (release_logged[0] is not None) == bool(expected)


def test_nested_phases_count_their_own_segments():
    profiler = PhaseProfiler(torch.device("cpu"))
    with profiler.phase("train"):
        with profiler.phase("generation"):
            pass
    record = profiler.end_step(1)
    assert set(record["phases"]) == {"train", "generation"}
    assert profiler.steps == [record]
    with pytest.raises(RuntimeError, match="stopped while"):
        profiler.start("train")
        profiler.stop("generation")


@pytest.mark.skipif(not peak_rss_resettable(), reason="the kernel does not let this process reset its RSS peak")
def test_cpu_peak_is_per_window():
    get_memory_stats(torch.device("cpu"))  # start a window
    block = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)  # 64 MiB, touched
    peak_with = get_memory_stats(torch.device("cpu"))["peak_rss_gib"]
    del block
    get_memory_stats(torch.device("cpu"))  # a reset sets the peak to the RSS now: open the window after the free
    peak_after = get_memory_stats(torch.device("cpu"))["peak_rss_gib"]
    assert peak_with - peak_after > 0.05  # the 64 MiB block shows in its window only
