"""
Through the real launcher: `accelerate launch --config_file <config> --num_processes 2`, with the configs we ship
(`experiments/accelerate_configs/`) made to run on CPU processes (gloo). Data parallel, DeepSpeed ZeRO-2 and ZeRO-3
(parameters really sharded): stock TRL and ours on the same workload with `beta > 0` and gradient accumulation,
whole groups per process and a group split across the processes, and under ZeRO-3 a separate reward model, Hydra,
and image prompts (a Qwen2-VL checkpoint, its vision tower sharded too).
Ours must give stock's completions and per-step metrics, with its sharing on.

FSDP is not here: with `use_cpu: true`, accelerate runs an FSDP config as plain data parallel (nothing is sharded), so
FSDP2 is checked at the model level in tests/test_distributed.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rloo_efficient.demo.workload import build_model_dir, build_reward_adapter_dir, build_reward_model_dir

from .conftest import assert_metrics_close
from .helpers import ROOT, cpu_config, free_port
from .launch_worker import launcher_workload


WORKER = Path(__file__).with_name("launch_worker.py")
# float32 (DeepSpeed trains float32 weights whatever the checkpoint holds): stock and ours add the same float32
# numbers in different orders (a packed sequence against padded rows), so each forward differs in its last bits, and
# the differences grow through 2 layers, the fused head and 3 optimizer steps to ~1e-5 relative (2e-5 seen in grad_norm
# and kl under ZeRO-3). kl is a difference of log-probs of magnitude ~5, so its error is absolute (~1e-7), not relative
# to its small value. A wrong mask, position or gradient moves these metrics by far more than 1e-4 (float64 tests
# elsewhere pin the exact equality).
RTOL, ATOL = 1e-4, 1e-5
GRADIENT_ACCUMULATION = 2
LAYOUTS = {
    # k = 2, 4 rows per process (2 per micro-batch x 2 accumulated): each process holds whole groups
    "whole_groups_per_process": {"num_generations": 2, "per_device_train_batch_size": 2},
    # k = 8 over 2 processes x 4 rows: the one group is split across the processes
    "group_split_across_processes": {"num_generations": 8, "per_device_train_batch_size": 2},
    # k = 2, 2 rows per process (1 per micro-batch x 2 accumulated): each process one group, its prompt held
    "one_row_per_micro_batch": {"num_generations": 2, "per_device_train_batch_size": 1},
}
CONFIG_FILES = {"ddp": "multi_gpu", "zero2": "zero2", "zero3": "zero3"}  # launcher -> shipped config
BOTH = ("whole_groups_per_process", "group_split_across_processes")
CASES = {  # launcher -> {case: (layout, reward)}
    "ddp": {layout: (layout, "rule") for layout in BOTH},
    "zero2": {layout: (layout, "rule") for layout in BOTH},
    "zero3": {**{layout: (layout, "rule") for layout in BOTH},
              "separate_reward_model": ("group_split_across_processes", "separate"),
              "hydra_reward_adapter": ("group_split_across_processes", "hydra"),
              "image_prompts": ("group_split_across_processes", "rule"),
              "holds_differ_across_processes": ("one_row_per_micro_batch", "rule"),
              "scoring_holds_differ_across_processes": ("one_row_per_micro_batch", "rule")},  # fmt: skip
}
# Ours' hold budget in a case: room for a training hold of 46 prompt tokens (768 bytes each on this model: keys and
# values, their float32 gradient bank, a hidden state per layer under gradient checkpointing), which at some step holds
# one process's prompt and not the other's (the test asserts it): their plans differ, and under ZeRO-3 a held prompt's
# forward on one process alone would wait forever for the other's parameter gathers. The same 46 tokens at a no-grad
# pass's 256 bytes (keys and values alone): its plans differ, and training holds nothing on either process
BUDGETS = {"holds_differ_across_processes": 46 * 768 / 1024**3,
           "scoring_holds_differ_across_processes": 46 * 256 / 1024**3}
DIFFER = {"holds_differ_across_processes": True, "scoring_holds_differ_across_processes": False}  # grad enabled
IMAGE_CASES = {"image_prompts"}  # a Qwen2-VL checkpoint, its processor, an image per prompt
EXPECTED = {"ddp": ("DistributedType.MULTI_CPU", None), "zero2": ("DistributedType.DEEPSPEED", 2),
            "zero3": ("DistributedType.DEEPSPEED", 3)}  # fmt: skip


@pytest.fixture(scope="module")
def launched(model_cache, tmp_path_factory):
    """`launched(launcher)`: the results of one launch running every case of that launcher, stock and ours, in turn
    (one launch per launcher: starting 2 processes with DeepSpeed costs more than a tiny run)."""
    cfg = launcher_workload(model_cache)
    build_model_dir(cfg), build_reward_model_dir(cfg), build_reward_adapter_dir(cfg, rank=4)  # once, before the ranks
    build_model_dir(launcher_workload(model_cache, images=True))
    done = {}

    def launch(launcher: str) -> Path:
        if launcher not in done:
            out = tmp_path_factory.mktemp(launcher)
            runs = [{"name": f"{method}_{case}", "method": method, "reward": reward, "images": case in IMAGE_CASES,
                     "gradient_accumulation_steps": GRADIENT_ACCUMULATION, **LAYOUTS[layout],
                     **({"held_prefix_budget_gib": BUDGETS[case]} if case in BUDGETS and method == "ours" else {})}
                    for case, (layout, reward) in CASES[launcher].items() for method in ("stock", "ours")]  # fmt: skip
            command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                       str(cpu_config(CONFIG_FILES[launcher], out)), "--num_processes", "2", "--main_process_port", str(free_port()),
                       str(WORKER), "--out", str(out), "--model_cache", str(model_cache), "--runs", json.dumps(runs)]  # fmt: skip
            # The first DeepSpeed launch on a machine compiles a small op with g++ (~80 s, then cached)
            finished = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
            assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-5000:]
            done[launcher] = out
        return done[launcher]

    return launch


def gap(stock: list[dict], ours: list[dict]) -> tuple[float, str, float]:
    """(worst relative difference over the metrics larger than 1e-3, which metric, worst absolute difference)."""
    relative, which, absolute = 0.0, "", 0.0
    for a, b in zip(stock, ours, strict=True):
        for key, value in a.items():
            if value is None:
                continue
            absolute = max(absolute, abs(b[key] - value))
            if abs(value) > 1e-3 and abs(b[key] - value) / abs(value) > relative:
                relative, which = abs(b[key] - value) / abs(value), key
    return relative, which, absolute


@pytest.mark.parametrize("launcher, case", [(launcher, case) for launcher in CASES for case in CASES[launcher]])
def test_through_accelerate_launch_ours_matches_stock_with_sharing_on(launched, launcher, case):
    out = launched(launcher)
    layout, reward = CASES[launcher][case]
    results = {(method, rank): json.loads((out / f"{method}_{case}_rank{rank}.json").read_text())
               for method in ("stock", "ours") for rank in (0, 1)}  # fmt: skip
    distributed_type, zero_stage = EXPECTED[launcher]
    for rank in (0, 1):
        stock, ours = results["stock", rank], results["ours", rank]
        for result in (stock, ours):  # the launch ran what its config says
            assert (result["world_size"], result["distributed_type"], result["zero_stage"]) == (2, distributed_type,
                                                                                                zero_stage)  # fmt: skip
        assert ours["completions"] == stock["completions"]
        assert len(stock["metrics"]) == 3 and any(step["kl"] for step in stock["metrics"])  # beta > 0 at work
        assert_metrics_close(stock["metrics"], ours["metrics"], RTOL, ATOL, ours["per_micro_batch"])
        for name in stock["rewards"]:
            assert ours["rewards"][name] == pytest.approx(stock["rewards"][name], rel=RTOL, abs=ATOL)
        # Our sharing ran: each prompt prefilled once, the log-prob and training forwards packed
        assert ours["share_prefix"] and ours["shared_prefill_tokens"] > 0 and ours["packed_forward_tokens"] > 0
        # A process's group split over its 2 micro-batches: its prompt forwarded once for both, in training (held,
        # its one backward in the second's: DDP's gradient sync, ZeRO's partitioned gradients) and in the scoring
        # passes (held, or the two chunks merged into one forward); with a PEFT policy (TRL's reentrant
        # checkpointing), in the scoring passes only
        if layout != "whole_groups_per_process":
            assert ours["held_forward_tokens"] > 0 or ours["scoring_forward_calls"] < stock["stock_scoring_chunks"]
        # Each generation on a process: its rows per micro-batch x 2 accumulated, of rows // k prompts (or 1)
        rows = LAYOUTS[layout]["per_device_train_batch_size"] * GRADIENT_ACCUMULATION
        distinct = max(1, rows // LAYOUTS[layout]["num_generations"])
        assert [(g["rows"], len(g["prompts"])) for g in ours["generations"]] == [(rows, distinct)] * 3
        if reward != "rule":
            assert ours["reward_forward_tokens"] > 0
            kind = {"separate": "DeepSpeedEngine", "hydra": "HydraReward"}[reward]
            assert ours["reward_funcs"][-1] == kind and stock["reward_funcs"][-1] == "DeepSpeedEngine"
        if case in IMAGE_CASES:  # each call's rows are one group: its image encoded once, where stock's once per row;
            # a scoring pass's two chunks and a step's two training micro-batches encode it once for both (the first's
            # held prompt; in training its vision tower's gradient in the second's backward, ZeRO-3's gradient
            # partitions zeroed at the step's start): per step, stock's generation, 2 scoring chunks and 2 training
            # micro-batches; ours' generation, 1 and 1
            assert len(stock["images_encoded"]) == 5 * 3 and len(ours["images_encoded"]) == 3 * 3
            assert set(ours["images_encoded"]) == {1} and min(stock["images_encoded"]) >= 2
        if zero_stage == 3:  # really sharded: each rank holds half of each model between forwards
            for model in ("policy", "reference", *(["reward"] if reward == "separate" else [])):
                if model == "reference" and reward == "hydra":
                    continue  # with a PEFT policy the reference is the base, adapters off: no model of its own
                assert ours["held_fraction"][model] == pytest.approx(0.5, abs=0.01), model
    gaps = [gap(results["stock", rank]["metrics"], results["ours", rank]["metrics"]) for rank in (0, 1)]
    print(f"[{launcher}/{case}] worst gap, stock vs ours: {max(gaps)[0]:.2e} relative ({max(gaps)[1]}), "
          f"{max(gaps, key=lambda g: g[2])[2]:.2e} absolute")  # read with pytest -s
    # Whole groups: the processes generated for different prompts; split: for the same one
    prompts = [{p for g in results["ours", rank]["generations"] for p in g["prompts"]} for rank in (0, 1)]
    if layout == "group_split_across_processes":
        assert prompts[0] == prompts[1]
    else:
        assert not prompts[0] & prompts[1]
    # Under ZeRO-3 the processes hold prompts only where their plans agree (each forward gathers parameters from
    # both; a plan disagreeing on one process alone would hang): their training plans with a budget between their
    # prompts' lengths (below the no-grad passes' holds, which cost less) disagree at some steps and agree at others,
    # and a no-grad pass's with a budget between its prompts' lengths
    agreed = [results["ours", rank]["plans_agreed"] for rank in (0, 1)]
    assert agreed[0] == agreed[1]
    if zero_stage == 3:
        for grad_enabled in (True, False):
            outcomes = {ok for grad, ok in agreed[0] if grad == grad_enabled}
            if DIFFER.get(case) == grad_enabled:
                assert outcomes == {True, False}, grad_enabled
            elif grad_enabled:  # (a no-grad pass's plans may differ beside the training budget's case)
                assert False not in outcomes
