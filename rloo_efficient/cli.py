"""
`rloo-efficient rloo|grpo ...`: TRL's own training scripts (`trl rloo`, `trl grpo`) with our trainer and config in
place of TRL's, so a recipe that runs with TRL runs with us unchanged, our fields added:

    rloo-efficient grpo --config recipe.yaml                       # as `trl grpo --config recipe.yaml`
    rloo-efficient grpo --config recipe.yaml --num_processes 2     # launch arguments go to `accelerate launch`, as TRL's
    accelerate launch --config_file zero3.yaml -m rloo_efficient.cli grpo --config recipe.yaml   # one process per rank

The arguments are exactly those of TRL's script: its script dataclass (`dataset_name`, `reward_funcs` by name or
dotted path, `reward_model_name_or_path`, ...), our [`RLOOConfig`] / [`GRPOConfig`] (TRL's fields and ours),
`ModelConfig` and `DatasetMixtureConfig`; `--help` lists them. As `trl <command>`, the console script launches the
training through `accelerate launch` (arguments the script does not know are accelerate's, `--accelerate_config`
included), and `python -m rloo_efficient.cli <command>` runs it in this process.
"""

import contextlib
import importlib
import sys
from unittest import mock

import trl


COMMANDS = ("rloo", "grpo")


@contextlib.contextmanager
def our_classes(command: str):
    """Within the block, TRL's script for `command` finds our trainer and config where it imports TRL's (`from trl
    import GRPOTrainer`, `from trl import GRPOConfig`, inside its `main` and `make_parser`)."""
    import rloo_efficient

    name = command.upper()
    with (
        mock.patch.object(trl, f"{name}Trainer", getattr(rloo_efficient, f"{name}Trainer")),
        mock.patch.object(trl, f"{name}Config", getattr(rloo_efficient, f"{name}Config")),
    ):
        yield importlib.import_module(f"trl.scripts.{command}")


def _command(argv: list[str]) -> tuple[str, list[str]]:
    if not argv or argv[0] not in COMMANDS:
        usage = f"usage: rloo-efficient {{{','.join(COMMANDS)}}} [--config recipe.yaml] [script arguments]"
        if argv[:1] in ([], ["-h"], ["--help"]):  # help asked for (or nothing given): as `trl`, printed, exit 0
            print(f"{usage}\n{__doc__}")
            raise SystemExit(0)
        print(f"{usage}\nrloo-efficient: error: unknown command {argv[0]!r}", file=sys.stderr)
        raise SystemExit(2)  # (argparse's, as `trl`'s)
    return argv[0], argv[1:]


def run(argv: list[str] | None = None) -> None:
    """Runs TRL's script for `argv[0]` in this process (one rank under `accelerate launch`), with our classes."""
    command, arguments = _command(list(sys.argv[1:] if argv is None else argv))
    with our_classes(command) as script:
        parser = script.make_parser(prog=f"rloo-efficient {command}")
        # Launch keys in the recipe (num_processes, mixed_precision) were accelerate's: ignored here, as TRL's scripts do
        script.main(*parser.parse_args_and_config(args=arguments, fail_with_unknown_args=False))
    _close_process_group()


def _close_process_group() -> None:
    """
    Destroys the default process group once training is done (TRL's scripts leave it to interpreter exit). Left
    alive, Gloo's worker threads may still hold finished work whose tensors Python frees during finalization, and the
    rank aborts (SIGABRT) after a run that completed; seen on CPU under `accelerate launch` with two processes
    (pytorch/pytorch#179291), also after this destroy where one rank finished while another still wrote the model: so
    the ranks first wait for each other (a run that failed on another rank never gets here: the launcher stops this
    one). Each rank then destroys its own group: not a collective for Gloo.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """The console script: parses as TRL's `trl <command>` does, then launches [`run`] through `accelerate launch`."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument
    from trl.cli.commands.training import _subtract_subsequence

    command, arguments = _command(list(sys.argv[1:] if argv is None else argv))
    with our_classes(command) as script:
        parser = script.make_parser(prog=f"rloo-efficient {command}")
        # Exits on --help; what the script does not know is for accelerate (as in trl/cli/commands/training.py)
        *_, config_remaining, cli_remaining = parser.parse_args_and_config(
            arguments, return_remaining_strings=True, separate_remaining_strings=True
        )
    launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    script_args = _subtract_subsequence(arguments, cli_remaining)
    launch = launch_command_parser().parse_args([*launch_args, "--module", __name__, command, *script_args])
    launch_command(launch)
    return 0


if __name__ == "__main__":
    run()
