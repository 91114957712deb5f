"""Data parallel on 2 CPU processes (gloo): ours and stock TRL agree step for step, and each process forwards each of
its prompts once, whether a group's rows are split across the processes or each process holds whole groups."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import assert_metrics_close
from .helpers import free_port


WORKER = Path(__file__).with_name("dp_worker.py")
LAYOUTS = {
    # k = 4 rows per prompt, 2 per process: every group is split across the two processes
    "groups_split_across_processes": ["--num_generations", "4", "--per_device_train_batch_size", "2"],
    # k = 2, 4 rows per process: each process holds whole groups
    "whole_groups_per_process": ["--num_generations", "2", "--per_device_train_batch_size", "4"],
}


def launch(method: str, out: Path, model_cache: Path, extra: list[str]) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(WORKER), "--method", method, "--out", str(out), "--model_cache", str(model_cache),
               *extra]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"{method}_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_match_stock_and_forward_each_prompt_once(workload, model_cache, tmp_path, layout):
    stock = launch("stock", tmp_path, model_cache, LAYOUTS[layout])
    ours = launch("ours", tmp_path, model_cache, LAYOUTS[layout])
    for rank in (0, 1):
        assert ours[rank]["world_size"] == 2
        assert ours[rank]["completions"] == stock[rank]["completions"]
        # Same metrics as stock on every rank (float64; TRL's head rounds log-probs to float32)
        assert_metrics_close(stock[rank]["metrics"], ours[rank]["metrics"], rtol=1e-6, atol=1e-7)
        # Each process prefilled its own prompts once per call: their prefix tree, or each distinct one padded
        expected = sum(prefill for distinct, rows, width, prefill in ours[rank]["generations"])
        assert ours[rank]["shared_prefill_tokens"] == expected > 0
        assert ours[rank]["packed_forward_tokens"] > 0
    # The two processes saw different prompts' rows (or different rows of the same prompts): real data parallel
    assert ours[0]["generations"] and ours[1]["generations"]
    # Each process recorded its own steps; the main process wrote the report, naming the world size and each rank
    report = json.loads((tmp_path / "ours" / "memory_report.json").read_text())
    assert report["world_size"] == 2 and len(report["per_rank"]) == 2
    assert report["summary"]["peak_gib"] == max(r["peak_gib"] for r in report["per_rank"])
    for rank in (0, 1):
        assert len((tmp_path / "ours" / f"memory_steps.rank{rank}.jsonl").read_text().splitlines()) == 3


def test_a_launch_that_cannot_form_whole_groups_fails_before_loading_a_model(tmp_path):
    """2 processes x 2 rows cannot hold groups of 3: stock TRL's check fails first, and ours says what to change."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(Path(__file__).parent.parent / "experiments" / "run_rloo.py"),
               "--num_generations", "3", "--per_device_train_batch_size", "2", "--prompt_length", "64",
               "--results_file", str(tmp_path / "results.json"), "--model_cache_dir", str(tmp_path / "models")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "generation_batch_size (4) must be divisible by num_generations (3)" in done.stderr
    assert "per_device_train_batch_size (2) x processes (2) x steps_per_generation (1)" in done.stderr
    assert not (tmp_path / "models").exists() and not (tmp_path / "results.json").exists()


def test_the_run_script_on_two_processes_builds_its_models_once_and_writes_one_results_file(tmp_path):
    """`run_rloo.py` under `torch.distributed.run` with an empty model cache: rank 0 builds the offline model (only
    rank 0 writes weights under a process group) while rank 1 waits, and rank 0 alone writes the results."""
    results, models = tmp_path / "results.json", tmp_path / "models"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(Path(__file__).parent.parent / "experiments" / "run_rloo.py"),
               "--num_generations", "2", "--per_device_train_batch_size", "2", "--prompt_length", "64",
               "--max_completion_length", "8", "--max_steps", "2", "--results_file", str(results),
               "--model_cache_dir", str(models), "--output_dir", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    (model,) = [path for path in models.iterdir() if path.name.startswith("tiny-")]
    assert (model / "model.safetensors").exists() and (model / "config.json").exists()
    assert json.loads(results.read_text())["world_size"] == 2
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith("results")] == ["results.json"]


def test_fsdp2_sharded_model_runs_our_forwards_generation_and_reward(tmp_path):
    """Under FSDP2 (`fully_shard`, 2 CPU processes): the packed forward and backward, a no-grad pass and training
    holding each prompt across chunks of one row ([`core.tree.holds`], [`core.forward.sharded`]), the shared prefill
    with the prompt cache once per group (text, and image prompts on a Qwen2-VL), and the packed reward scoring give the
    unsharded model's numbers; the ranks agree on the image prefill."""
    worker = Path(__file__).with_name("fsdp_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(worker), str(tmp_path)]  # fmt: skip
    # ~15 s; ranks whose forwards fall out of step would wait on each other until the timeout
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"fsdp_rank{rank}.json").read_text())
        assert result["packed_logps"] < 1e-6 and result["packed_grads"] < 1e-5  # TRL's head rounds to float32
        # A no-grad pass in chunks of one row, each prompt held across them
        assert result["held_tokens"] and result["held_logps"] < 1e-6
        assert result["generate_same_tokens"] and result["generate_logits"] < 1e-6
        assert result["reward_scores"] < 1e-10
        # Image prompts: each distinct prompt prefilled once with its image, the stock call's samples; one rank that
        # cannot prefill image prompts once makes both take stock's generate (else their forwards would fall apart)
        assert result["image_prefill_tokens"] and result["images_encoded"]
        assert result["image_generate_same_tokens"] and result["image_generate_logits"] < 1e-6
        assert result["ranks_agree"] == [True, False]
        # Training holding each prompt across micro-batches of one row: each group's prompt forwarded once, the banked
        # gradients added by its last micro-batch, the unsharded model's gradient (TRL's head rounds to float32)
        assert set(result["held_training"]) == {"llama", "mixtral", "qwen3_next"}
        assert result["held_training"]["qwen3_next"]["recurrent"]
        for held in result["held_training"].values():
            assert held["tokens"] == 13 and held["banks_added"] > 0 and held["grads"] < 1e-6
        assert result["nested_units"] == [False, True]  # (training does not hold the second: a reader's warning)
