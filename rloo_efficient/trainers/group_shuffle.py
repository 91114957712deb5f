"""
Keeping each group's rows in one micro-batch (`shuffle_groups`): the batch TRL returns is reordered so that TRL's own
row shuffle, drawn next, lands each group's rows together ([`ordered_for_group_shuffle`]); by default only where that
reorders a sum and changes nothing else ([`group_shuffle_reason`]).
"""

import numpy as np
import torch
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from ..core.tree.rows import CarriedRows, group_shuffle_order


# The modules of the losses `group_shuffle_reason` reads
TRL_LOSSES = ("trl.trainer.rloo_trainer", "trl.trainer.grpo_trainer")


def group_shuffle_reason(trainer, ours: type, entropy_bonus: bool = False) -> str | None:
    """Why keeping each group's rows in one micro-batch would change more than the order of a sum for `trainer` (a TRL
    trainer; `ours`: our mixin, skipped in its method resolution order; `entropy_bonus`: GRPO's entropy bonus is on), or
    None: every micro-batch of a generation must feed one optimizer step, and the loss must be a sum over sequences
    normalized independently of which rows share a micro-batch."""
    args = trainer.args
    if args.gradient_accumulation_steps % args.steps_per_generation:
        return (f"gradient_accumulation_steps ({args.gradient_accumulation_steps}) is not a multiple of "
                f"steps_per_generation ({args.steps_per_generation}): a generation's micro-batches feed several "
                "optimizer steps")  # fmt: skip
    for method in ("compute_loss", "_compute_loss"):  # TRL's own RLOO or GRPO loss, read below
        owner = next(cls for cls in type(trainer).__mro__ if method in cls.__dict__ and cls is not ours)
        if owner.__module__ not in TRL_LOSSES:
            return f"{type(trainer).__name__} computes its own loss ({owner.__name__}.{method})"
    if trainer.aux_loss_enabled:
        return "the MoE load-balancing loss is computed per micro-batch"
    if getattr(trainer, "loss_type", None) == "bnpo":
        return "the bnpo loss is normalized by each micro-batch's tokens"
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        return "top_entropy_quantile takes its threshold over each micro-batch's tokens"
    if entropy_bonus:
        return "the entropy bonus is a mean over each micro-batch's tokens"
    return None


def ordered_for_group_shuffle(batch: dict, group_ids: torch.Tensor) -> dict:
    """
    `batch` reordered so that TRL's row shuffle, drawn right after from the global generator (one `torch.randperm(B)`
    in `_prepare_inputs`), lands each group's rows together ([`group_shuffle_order`]). The generator's state is put
    back: the draws stay stock's.
    """
    # TRL's randperm draws on the default device (set_default_device("cuda"): CUDA's generator): so does ours
    device = torch.get_default_device()
    forked = {"devices": []} if device.type == "cpu" else {"devices": [device], "device_type": device.type}
    with torch.random.fork_rng(**forked):
        permutation = torch.randperm(len(group_ids)).cpu()
    wanted = group_shuffle_order(group_ids, permutation)  # the rows TRL's shuffle should put at each place
    before = np.empty_like(wanted)
    before[permutation.numpy()] = wanted  # TRL takes before[permutation]: that is wanted
    index = torch.from_numpy(before)

    def take(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[index.to(value.device)]
        taken = [value[i] for i in before]
        return CarriedRows(taken) if isinstance(value, CarriedRows) else taken  # ours: read by TRL's shuffle next

    # Images by row first, as TRL's own shuffle takes them (a row may hold several images, or none)
    return unsplit_pixel_values_by_grid({key: take(value) for key, value in split_pixel_values_by_grid(
        batch).items()})  # fmt: skip
