"""
The scripts under `experiments/` a user or a device session starts. `experiments/gpu_session.sh` is what a device
session runs first, and a device is lent rarely and briefly: a step that fails on its arguments costs the session.
Every step's command is parsed here as its script parses it, and the runs the GPU benchmarks start are parsed as
`run_rloo.py` parses them, with the device's arguments (CUDA reported available, nothing run); the steps that run
their model in their own process run here at the tiny model's shape. `run_rloo.py --skip_existing` (`run_improved.sh`'s
stock runs) reuses a results file only for the same run.
"""

import argparse
import importlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rloo_efficient.demo.workload import PRESETS


ROOT = Path(__file__).resolve().parent.parent
SESSION = ROOT / "experiments" / "gpu_session.sh"
# The device tool runs one command for at most 600 s; the first call also installs the carried wheels (~15 s)
FIRST_CALL_LIMIT_S = 570


def steps(out: Path) -> dict[str, tuple[int, list[str]]]:
    """Each `run LIMIT NAME COMMAND...` line of the session script: name -> (limit, command), `$OUT` replaced."""
    text = SESSION.read_text().replace("\\\n", " ")
    found = {}
    for line in text.splitlines():
        if line.startswith("run "):
            _, limit, name, *command = shlex.split(line.replace("$OUT", str(out)))
            found[name] = (int(limit), command)
    return found


def listed(variable: str) -> list[str]:
    return re.search(rf'^{variable}="([^"]*)"', SESSION.read_text(), re.MULTILINE).group(1).split()


class Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def parse_only(monkeypatch, command: list[str]) -> argparse.Namespace:
    """The namespace `command`'s script parses from its arguments, the script stopped right after parsing them."""
    if command[:2] == ["python3", "-m"]:
        module, argv = command[2], command[3:]
    else:
        assert command[0] == "python3" and command[1].startswith("experiments/"), command
        module, argv = Path(command[1]).stem, command[2:]
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    with pytest.raises(Parsed) as parsed:
        importlib.import_module(module).main(argv)
    return parsed.value.namespace


@pytest.fixture
def experiments(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    monkeypatch.chdir(ROOT)


def test_the_lists_name_every_step_once_and_the_first_call_fits_its_limit(tmp_path):
    every = steps(tmp_path)
    first, rest = listed("FIRST"), listed("REST")
    assert sorted(first + rest) == sorted(every), "FIRST and REST name each run step once"
    assert sum(every[name][0] for name in first) <= FIRST_CALL_LIMIT_S
    assert all(limit <= FIRST_CALL_LIMIT_S for limit, _ in every.values()), "every step fits one call"


@pytest.mark.parametrize("name", [*listed("FIRST"), *listed("REST")])
def test_every_step_parses_as_its_script_parses_it(name, tmp_path, monkeypatch, experiments):
    namespace = parse_only(monkeypatch, steps(tmp_path)[name][1])
    preset = getattr(namespace, "preset", None)
    assert preset in (None, "tiny", *PRESETS), preset  # a free-form argument, read only when the model is built


@pytest.mark.parametrize("name", [name for name in [*listed("FIRST"), *listed("REST")]
                                  if re.match(r"(history|bench_gpu|capacity)", name)])  # fmt: skip
def test_every_run_a_gpu_step_starts_parses_as_run_rloo_parses_it(name, tmp_path, monkeypatch, experiments):
    """The GPU benchmarks run `run_rloo.py` in processes of their own: each run's arguments (its workload, ablation
    and the device's bf16) parse into the trainer's config, and name a preset."""
    commands = []

    def start(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 1, "", "")  # the benchmark reports it as failed and goes on

    command = steps(tmp_path)[name][1]
    with monkeypatch.context() as device:  # the benchmark's own process believes it is on a GPU, parsing does not
        device.setattr(subprocess, "run", start)
        device.setattr(torch.cuda, "is_available", lambda: True)
        device.setattr(torch.cuda, "get_device_name", lambda *args: "a device")
        importlib.import_module(Path(command[1]).stem).main(command[2:])
    assert commands, "the step starts no run"
    run_rloo = importlib.import_module("run_rloo")
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)  # a GPU's bf16
    for run in commands:
        assert run[:2] == [sys.executable, str(ROOT / "experiments" / "run_rloo.py")]
        exp, workload, config = run_rloo.parse(run[2:])[:3]
        assert config.bf16 and workload.preset in PRESETS, (workload.preset, config.bf16)
        if "--memory_history" in run:
            assert exp.memory_history.startswith(str(tmp_path))


class Trains(Exception):
    pass


@pytest.mark.parametrize("change", [[], ["--lora", "true"], ["--temperature", "0.7"], ["--seed", "1"]],
                         ids=["same", "lora", "temperature", "seed"])
def test_skip_existing_skips_only_the_same_run(change, tmp_path, monkeypatch, experiments):
    """`run_improved.sh` reuses stock's results file with `--skip_existing`: only a run with every setting the same
    (the experiment's, the workload's and the config's; where it writes aside) may be skipped."""
    run_rloo = importlib.import_module("run_rloo")
    argv = ["--method", "stock", "--prompt_length", "64", "--max_completion_length", "8", "--num_generations", "2",
            "--per_device_train_batch_size", "2", "--max_steps", "1", "--output_dir", str(tmp_path / "first"),
            "--results_file", str(tmp_path / "stock.json")]  # fmt: skip
    exp, workload, config = run_rloo.parse(argv)[:3]
    existing = {"peak_gib": 1.0, **run_rloo.run_settings(exp, workload, config, config.to_stock())}
    (tmp_path / "stock.json").write_text(json.dumps(existing))

    def trains(*args, **kwargs):
        raise Trains

    monkeypatch.setattr(run_rloo, "build_model_dir", trains)
    again = [*argv, "--skip_existing", "true", "--output_dir", str(tmp_path / "again"), *change]
    if change:
        with pytest.raises(Trains):
            run_rloo.main(again)
    else:
        assert run_rloo.main(again) == existing


def test_run_rloo_counts_each_phase_s_tokens_as_the_trainer_does(tmp_path, monkeypatch, experiments):
    """The per-phase token counts of a results file add up to the trainer's own counters, held prompts' source
    forwards included (one row per micro-batch: each prompt held across its group's micro-batches)."""
    argv = ["--method", "ours", "--prompt_length", "64", "--max_completion_length", "8", "--num_generations", "4",
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4", "--steps_per_generation", "4",
            "--max_steps", "1", "--beta", "0.05", "--output_dir", str(tmp_path / "out"), "--results_file",
            str(tmp_path / "ours.json"), "--report_to", "none", "--save_strategy", "no"]  # fmt: skip
    results = importlib.import_module("run_rloo").main(argv)
    sharing = json.loads((tmp_path / "out" / "memory_report.json").read_text())["sharing_tokens"]
    assert sharing["held_forward_tokens"] > 0  # prompts were held
    assert sum(results["packed_tokens"].values()) == sharing["packed_forward_tokens"]
    assert sum(results["tree_tokens"].values()) == sharing["tree_tokens"]
    assert set(results["packed_tokens"]) == {"policy_logps", "reference_logps", "train"}


def fake_results(scale: float, slow_step: int) -> dict:
    """A results file as `run_rloo.py` writes one on a GPU, every number `scale` times a base, step `slow_step`'s
    times a hundred times longer (as recording the allocator's history makes them)."""
    def phase(step, base):
        return {"time_s": base * scale * (100 if step == slow_step else 1), "peak_allocated_gib": 10 + base * scale,
                "peak_reserved_gib": 12 + base * scale}  # fmt: skip

    steps = [{"phases": {name: phase(step, base) for name, base in (("generation", 1.0), ("policy_logps", 0.25),
                                                                     ("reference_logps", 0.25), ("train", 0.5))}}
             for step in (1, 2, 3)]  # fmt: skip
    for step, record in enumerate(steps, 1):  # the profiler's step: synchronized, the optimizer step included
        record["time_s"] = 2.5 * scale * (100 if step == slow_step else 1)
    return {"steps": steps, "step_times_s": [2.0 * scale * (100 if step == slow_step else 1) for step in (1, 2, 3)],
            "fixed_state_gib": 10.0, "gradients_gib": 2.0, "weights_gib": 4.0, "optimizer_states_gib": 4.0,
            "timeline": []}  # fmt: skip


@pytest.mark.parametrize("history", [False, True])
def test_bench_gpu_reports_each_run_as_it_ends_and_times_leave_the_recorded_step_out(history, tmp_path, monkeypatch,
                                                                                     experiments, capsys):  # fmt: skip
    """With `--methods ours stock`, ours' numbers are printed before stock's run starts (a time limit that cuts stock's
    run leaves them); the table's ratios are against stock's; with `--memory_history` the times leave out step 2,
    whose allocator history is recorded, and without it they are the median of steps 2 and 3."""
    printed_before_stock = []

    def start(command, **kwargs):
        method = command[command.index("--method") + 1]
        if method == "stock":
            printed_before_stock.append(capsys.readouterr().out)
        recorded = "--memory_history" in command
        results = fake_results(2.0 if method == "stock" else 1.0, slow_step=2 if recorded else 0)
        Path(command[command.index("--results_file") + 1]).write_text(json.dumps(results))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", start)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a device")
    argv = ["--workloads", "0.6b-rows1", "--methods", "ours", "stock", "--output", str(tmp_path / "table.md"),
            *(["--memory_history", str(tmp_path)] if history else [])]  # fmt: skip
    assert importlib.import_module("bench_gpu").main(argv) == 0
    # steps 2 and 3 alike but for the recorded one
    ours = "ours: step 2.00 (synchronized, the optimizer step included: 2.50), generation 1.00"
    assert ours in printed_before_stock[0]
    table = (tmp_path / "table.md").read_text()
    rows = {line.split(" | ")[1]: line.split(" | ") for line in table.splitlines() if line.startswith("| 0.6B")}
    assert list(rows) == ["ours", "stock"]
    assert rows["ours"][2:4] == ["2.00", "0.50x"] and rows["stock"][2:4] == ["4.00", "1.00x"]
    # peak allocated 11, above the fixed state without gradients (8) 3 against stock's 4, reserved 13 against 14
    assert rows["ours"][8:14] == ["11.00", "10.00", "3.00", "0.75x", "13.00", "0.93x"]


@pytest.mark.parametrize("method", ["stock", "ours"])
def test_a_run_without_output_dir_writes_under_outputs(method, tmp_path, monkeypatch, experiments):
    """Without `--output_dir` (as `run_baseline.sh` and `run_improved.sh` run), each method's trainer writes to
    `outputs/<method>_<workload>`, not to TRL's default `trainer_output` in the working directory."""
    run_rloo = importlib.import_module("run_rloo")
    monkeypatch.chdir(tmp_path)

    class Built(Exception):
        pass

    def build(*args, **kwargs):
        raise Built(kwargs["args"].output_dir)

    config_class = run_rloo.TRAINERS["rloo"][1]
    monkeypatch.setitem(run_rloo.TRAINERS, "rloo", (build, config_class, build))
    argv = ["--method", method, "--prompt_length", "64", "--max_completion_length", "8", "--num_generations", "2",
            "--per_device_train_batch_size", "2", "--max_steps", "1", "--results_file", str(tmp_path / "r.json")]
    with pytest.raises(Built) as built:
        run_rloo.main(argv)
    assert str(built.value) == f"outputs/{method}_tiny-llama-h128_P64_C8_k2"


# The in-process steps of the session (each builds its model in the benchmark's own process), shrunk to run here:
# what each argument becomes on CPU (the preset dropped: the tiny default model)
SHRUNK = {"--prompt_lengths": ["64"], "--prompt_length": ["64"], "--completion_length": ["8"], "--ks": ["2"],
          "--k": ["2"], "--preset": []}  # fmt: skip
IN_PROCESS = ["static_once_0.6b", "static_generation", "held_overhead", "tree_kernels", "decode_cost_k8"]


def shrink(command: list[str]) -> list[str]:
    """A step's arguments with every shape argument of [`SHRUNK`] replaced by its small value (its values dropped)."""
    argv, index = [], 0
    while index < len(command):
        argument = command[index]
        index += 1
        if argument in SHRUNK:
            while index < len(command) and not command[index].startswith("--"):
                index += 1
            argv += [argument, *SHRUNK[argument]] if SHRUNK[argument] else []
        else:
            argv.append(argument)
    return argv


@pytest.mark.parametrize("name", IN_PROCESS)
def test_every_in_process_step_runs_at_a_tiny_shape_on_cpu(name, tmp_path, monkeypatch, experiments, capsys):
    """Each step that runs its model in the benchmark's own process runs through on CPU with its methods and flags, at
    the tiny model's shape: what a session would lose to a renamed function or a broken table (its CUDA branches are
    what the device adds)."""
    command = shrink(steps(tmp_path)[name][1])
    assert importlib.import_module(Path(command[1]).stem).main(command[2:]) in (0, None)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| -")]
    assert len(rows) >= 2, out[-2000:]  # a table's head and at least one row


def frames(name: str) -> list[dict]:
    return [{"filename": "/env/site-packages/torch/nn/modules/linear.py", "line": 1, "name": name}]


def event(action: str, address: int, size: int, name: str = "forward") -> dict:
    return {"action": action, "addr": address, "size": size, "frames": frames(name)}


def test_memory_history_replays_each_phase_to_its_peak_and_reads_only_the_sites_live_there(monkeypatch, experiments):
    """The allocator history the device session records, replayed: each phase's peak allocated (from what was allocated
    before the recording), the blocks live then by site, its peak reserved (segments allocated or mapped, freed or
    unmapped); and a block's site is read only where it is live at a peak (a recorded step holds millions of events)."""
    memory_history = importlib.import_module("memory_history")
    marker = memory_history.MARKER_BYTES
    trace = [
        event("alloc", 1, marker, "_phase_marker"), event("free_completed", 1, marker, "_phase_marker"),
        event("segment_alloc", 100, 4096, "grow"), event("alloc", 2, 1000, "a"), event("alloc", 3, 3000, "b"),
        event("free_requested", 2, 1000), event("free_completed", 2, 1000),  # the peak was 5000 + 4000
        event("alloc", 4, 500, "a"), event("free_completed", 9, 2000),  # a block from before the recording
        event("alloc", 5, marker, "_phase_marker"), event("free_completed", 5, marker, "_phase_marker"),
        event("segment_map", 101, 8192, "map"), event("alloc", 6, 6000, "c"), event("segment_unmap", 101, 8192),
        event("free_completed", 6, 6000), event("segment_free", 100, 4096),
    ]  # fmt: skip
    read = []
    site = memory_history._site
    monkeypatch.setattr(memory_history, "_site", lambda frames, depth=4: read.append(frames) or site(frames, depth))
    report = memory_history.analyze(trace, ["generation", "train"], start_allocated=5000, start_reserved=10_000)
    gib = 1024**3
    generation, train = report["generation"], report["train"]
    assert generation["peak_allocated_gib"] * gib == 9000 and generation["from_before_the_step_gib"] * gib == 5000
    assert [(e["gib"] * gib, e["blocks"]) for e in generation["largest"]] == [(3000, 1), (1000, 1)]
    assert generation["peak_reserved_gib"] * gib == 14096
    assert train["peak_allocated_gib"] * gib == 5000 + 3000 + 500 - 2000 + 6000  # (the marker freed before)
    assert [e["gib"] * gib for e in train["largest"]] == [6000, 3000, 500]
    assert train["peak_reserved_gib"] * gib == 10_000 + 4096 + 8192
    assert [e["site"].split()[-1] for e in train["reserved_by"]] == ["map"]
    assert len(read) == 2 + 2 + 3  # the segments' sites, and the blocks live at the two peaks
