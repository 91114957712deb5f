"""
The command line as users run it: a YAML recipe (a local model directory, a local dataset directory, a reward
function named by dotted path, our fields beside TRL's), `trl <command> --config recipe.yaml` for stock and
`rloo-efficient <command> --config recipe.yaml` for ours, each launched through `accelerate launch` by its console
script, on one process and on two (`num_processes` in the recipe, `--accelerate_config` with the shipped
data-parallel config, on CPU). Both must train the same weights, ours with its sharing on.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rloo_efficient.demo.workload import build_dataset, build_model_dir

from .conftest import tiny_workload
from .helpers import cpu_config, free_port


BIN = Path(sys.executable).parent
# float32 (TRL's scripts load the model in ModelConfig's default dtype): stock and ours sum the same numbers in other
# orders. AdamW moves each weight by about the learning rate (1e-2) per step whatever its gradient's size, so a wrong
# gradient shows at ~1e-2; rounding shows most where a gradient is near zero (an LM-head row of a token never
# sampled), 3e-6 seen
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def recipe_inputs(model_cache, tmp_path_factory):
    """A local model directory and a local dataset directory (a JSON Lines file, as `load_dataset(dir)` reads one)."""
    cfg = tiny_workload(model_cache, model_dtype="float32")
    data = tmp_path_factory.mktemp("dataset")
    with open(data / "train.jsonl", "w") as f:
        for prompt in build_dataset(cfg)["prompt"]:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    return build_model_dir(cfg), data


def launch(console_script: str, command: str, recipe: dict, directory: Path, processes: int) -> Path:
    directory.mkdir(parents=True)
    recipe = {**recipe, "output_dir": str(directory / "out")}
    (directory / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    arguments = [str(BIN / console_script), command, "--config", str(directory / "recipe.yaml")]
    if processes > 1:  # launch arguments the script does not know go to accelerate, as TRL's CLI passes them
        arguments += ["--accelerate_config", str(cpu_config("multi_gpu", directory)),
                      "--main_process_port", str(free_port())]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "ACCELERATE_CONFIG_FILE": str(directory / "none.yaml")}  # no machine-wide accelerate config  # fmt: skip
    for attempt in range(2):
        done = subprocess.run(arguments, cwd=directory, env=env, capture_output=True, text=True, timeout=600)
        # A rank of a two-process CPU run may abort in Gloo's teardown after training finished and the model was
        # saved (pytorch/pytorch#179291; `trl`'s own script as ours): launched once more, that once
        aborted_after = "Signal 6 (SIGABRT)" in done.stderr and "Training completed" in done.stdout
        if done.returncode == 0 or not aborted_after or attempt:
            break
        shutil.rmtree(directory / "out", ignore_errors=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return directory / "out"


@pytest.mark.parametrize("command, processes", [("rloo", 1), ("grpo", 2)])
def test_recipe_runs_as_trl_runs_it(recipe_inputs, tmp_path, command, processes):
    model, data = recipe_inputs
    recipe = dict(
        model_name_or_path=model, dataset_name=str(data), reward_funcs=["rloo_efficient.demo.workload.vowel_reward"],
        bf16=False,  # CPU
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=2, learning_rate=1e-2,
        beta=0.1, logging_steps=1, seed=1, report_to="none", save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    recipe["num_processes"] = processes  # a launch key in the recipe: accelerate's, unknown to the script's parser
    if processes > 1:
        recipe["use_cpu"] = True  # transformers otherwise runs each CPU process on its own
    stock = launch("trl", command, recipe, tmp_path / "stock", processes)
    ours = launch("rloo-efficient", command, {**recipe, "empty_cache_policy": "none"}, tmp_path / "ours", processes)

    report = json.loads((ours / "memory_report.json").read_text())
    assert report["trainer"] == f"rloo_efficient.trainers.{command}.{command.upper()}Trainer"
    assert report["world_size"] == processes and report["config"]["empty_cache_policy"] == "none"
    tokens = report["sharing_tokens"]
    assert tokens["packed_forward_tokens"] > 0 and tokens["shared_prefill_tokens"] > 0
    assert not (stock / "memory_report.json").exists()
    # The same files as stock's save, our profiler's two beside them
    ours_files = {path.name for path in ours.iterdir()} - {"memory_report.json"}
    assert ours_files - {name for name in ours_files if name.startswith("memory_steps")} == {
        path.name for path in stock.iterdir()}
    stock_weights, our_weights = load_file(stock / "model.safetensors"), load_file(ours / "model.safetensors")
    assert stock_weights.keys() == our_weights.keys()
    initial = load_file(Path(model) / "model.safetensors")
    assert any(not torch.equal(initial[name], stock_weights[name]) for name in initial)  # training moved them
    for name, weight in stock_weights.items():
        torch.testing.assert_close(our_weights[name], weight, rtol=RTOL, atol=ATOL, msg=name)


def test_help_lists_trls_arguments_and_ours():
    done = subprocess.run([str(BIN / "rloo-efficient"), "grpo", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for argument in ("--reward_funcs", "--dataset_name", "--model_name_or_path", "--loss_type", "--share_prompt_prefix",
                     "--empty_cache_policy"):  # fmt: skip
        assert argument in done.stdout, argument
    # As `trl`: help asked for, or nothing given, exits 0; an unknown command 2 (argparse's), its usage on stderr
    for argv, code in (([], 0), (["--help"], 0), (["ppo"], 2)):
        done = subprocess.run([str(BIN / "rloo-efficient"), *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == code and "usage: rloo-efficient {rloo,grpo}" in (done.stderr if code else done.stdout)


# -- the launch `trl` makes, and our fields as flags (no training: the launch is captured) -----------------------------
RECIPE = {"model_name_or_path": "m", "dataset_name": "d", "output_dir": "out", "bf16": False, "use_cpu": True,
          "report_to": "none"}


def _our_launch(argv):
    from unittest import mock

    from rloo_efficient import cli

    with mock.patch("accelerate.commands.launch.launch_command") as launch:
        cli.main(argv)
    return vars(launch.call_args.args[0])


def _trls_launch(argv):
    from unittest import mock

    import trl.cli.accelerate_launcher as launcher
    from accelerate.commands.launch import launch_command_parser
    from trl.cli.main import main as trl_main

    with mock.patch.object(launcher, "launch_training_script") as launch:
        trl_main(argv)
    kwargs = launch.call_args.kwargs
    argv = [*kwargs["launch_args"], "script.py", *kwargs["training_script_args"]]
    return vars(launch_command_parser().parse_args(argv))


# Launch keys in the recipe (README: `num_processes` there), on the command line, and mixed with the script's flags
@pytest.mark.parametrize("recipe, flags", [
    ({"num_processes": 2, "mixed_precision": "no"}, []),
    ({}, ["--num_processes", "2", "--accelerate_config", "multi_gpu"]),
    ({"num_processes": 3}, ["--main_process_port", "29555", "--learning_rate", "0.5"]),
])  # fmt: skip
@pytest.mark.parametrize("command", ["rloo", "grpo"])
def test_the_launch_is_trls(tmp_path, command, recipe, flags):
    """`rloo-efficient <command>` makes the `accelerate launch` that `trl <command>` makes, our module in its script's
    place, and hands the script `trl`'s arguments."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, **recipe}))
    argv = [command, "--config", str(path), *flags]
    ours, stock = _our_launch(argv), _trls_launch(argv)
    assert ours["module"] and ours["training_script"] == "rloo_efficient.cli"
    assert ours["training_script_args"] == [command, *stock["training_script_args"]]
    assert ours["nondefault"] - {"module"} == stock["nondefault"]
    mine = {"training_script", "training_script_args", "module", "nondefault"}
    assert {k: v for k, v in ours.items() if k not in mine} == {k: v for k, v in stock.items() if k not in mine}


def test_our_fields_parse_as_flags():
    """Budgets in fractions of a GiB, a boolean written out, as the docs give them."""
    from rloo_efficient import cli

    with cli.our_classes("grpo") as script:
        parser = script.make_parser(prog="rloo-efficient grpo")
        _, config, *_ = parser.parse_args_and_config(
            args=[*(f"--{key}={value}" for key, value in RECIPE.items()), "--held_prefix_budget_gib", "0.5",
                  "--tool_cache_budget_gib", "0.25", "--share_prompt_prefix", "false"], fail_with_unknown_args=False)
    parsed = config.held_prefix_budget_gib, config.tool_cache_budget_gib, config.share_prompt_prefix
    assert parsed == (0.5, 0.25, False)
