"""
Prefix states held across micro-batches in TRL's trainers: the training window's lifecycle ([`HeldPrefixes`]); how
each pass's chunks hold prompts is core's ([`core.forward.hold_planner`]).

TRL runs a generation batch's log-prob passes in chunks of `per_device_train_batch_size` rows, and trains on it in
micro-batches of that size: with one or two rows per micro-batch, each chunk and micro-batch would forward its rows'
prompts again. Two kinds of scope hold them once instead:

- a no-grad pass (the old policy's and the reference's log-probs): its chunks, planned together when the pass starts,
  each prompt forwarded by the first chunk holding one of its rows and read by every later one;
- training: the micro-batches TRL will serve from its buffered generation before the next optimizer step (or the
  next generation), planned when the first of them is prepared; each prompt is forwarded with grad by the first,
  read by the others, and backpropagated once, inside the Trainer's backward of the last ([`core.attention.held`]).

Windows are the Trainer's: `current_gradient_accumulation_steps` micro-batches per optimizer step, counted here from
the end of the last one (`sync_gradients`); generations are TRL's (every `steps_per_generation * num_iterations`
micro-batches).
"""

import warnings
from collections.abc import Callable

import torch

from ..core.forward.hold_planner import HoldCosts, HoldPlanner
from ..core.forward.sharded import nested_units
from ..core.layers.vision import ModelVision
from ..core.tree.rows import row_tokens, table_of
from .config import ROWS_KEY


def zero_stale_gradients(model) -> bool:
    """
    Zeroes DeepSpeed ZeRO-3's gradient partitions at the start of an accumulation window (`model`: the Trainer's wrapped
    model, ZeRO-3's engine; without ZeRO-3, nothing to do). ZeRO-3 copies each parameter's gradient partition into its
    buffer in the window's first micro-batch and adds to it in the later ones, so that a parameter whose gradient
    first arrives in a later micro-batch adds to what the last optimizer step left there. With prompts held, a
    parameter only a prompt reaches (a vision tower, which encodes prompts' images alone) gets its gradient in the
    prompt's backward, in the last micro-batch reading it: zeroed first, each parameter's gradient is its
    micro-batches' sum. (Stock's forwards reach such a parameter in every micro-batch; one none reaches in the first
    would add to the stale buffer there too.) False where ZeRO-3 runs without the buffer this zeroes (another
    DeepSpeed version): training must not hold there.
    """
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return True
    buffer = getattr(getattr(model, "optimizer", None), "grad_partitions_flat_buffer", None)
    if not isinstance(buffer, torch.Tensor):
        return False
    buffer.zero_()
    return True


def hold_reason(args, fsdp: int) -> str | None:
    """Why prompts cannot be held across training micro-batches under `args` (TRL's config) and `fsdp` (0: no FSDP;
    1 or 2: its version), or None."""
    if fsdp == 1:
        return ("under FSDP1 a held prompt's gradient enters each layer at its keys and values, inside the layer, "
                "while FSDP gathers a layer's parameters again only for a gradient reaching its output (FSDP2 "
                "holds them)")  # fmt: skip
    if args.gradient_checkpointing and (args.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
        return ("gradient checkpointing with use_reentrant=True keeps no graph of a layer's keys (a held prompt's "
                "gradient could not reach it)")  # fmt: skip
    return None


def warn_hold(reason: str) -> None:
    warnings.warn(f"rloo_efficient: each training micro-batch forwards its rows' prompts (they are not held "
                  f"across micro-batches): {reason}.", stacklevel=3)  # fmt: skip


def upcoming_micro_batches(buffered: list | None, inputs, step: int, per_generation: int, num_iterations: int,
                           remaining: int) -> list | None:  # fmt: skip
    """The micro-batches TRL will serve from `inputs` on: its buffered generation's (`buffered`, `per_generation` of
    them, each served `num_iterations` times) in the order TRL serves them from its micro-batch counter `step`, for the
    `remaining` micro-batches of the optimizer step or to the end of the generation, whichever comes first; None where
    `inputs` is not TRL's next buffered one."""
    generate_every = per_generation * num_iterations
    count = min(remaining, generate_every - step % generate_every)
    if not buffered or count < 2 or buffered[step % per_generation] is not inputs:
        return None
    return [buffered[(step + t) % per_generation] for t in range(count)]


class HeldPrefixes:
    """
    The training window of prompts held across a step's micro-batches: the trainer tells it where each optimizer
    step's window starts and ends ([`step_begins`], [`step_ends`]) and which micro-batch comes next ([`prepare`]); it
    plans each window's training scope with `planner` ([`core.forward.hold_planner.HoldPlanner`], which the packed
    passes ask for their chunks). `policy()`: the policy, unwrapped; `args`: TRL's config; `fsdp`: 0, or FSDP's
    version; `vision`: the policy's.
    """

    def __init__(self, planner: HoldPlanner, policy: Callable, args, vision: ModelVision, fsdp: int = 0):
        self.planner, self.policy, self.vision, self.fsdp = planner, policy, vision, fsdp
        self.window_position = 0  # micro-batches run since the last optimizer step
        reason = hold_reason(args, fsdp)
        self.training = reason is None  # whether training micro-batches hold prompts too (the no-grad passes may alone)
        if reason is not None:
            warn_hold(reason)

    @classmethod
    def of(cls, budget: int, policy: Callable, args, agree: Callable, warn: Callable, vision: ModelVision,
           fsdp: int = 0, aux_loss: bool = False, alias_parameters: bool = False) -> "HeldPrefixes":  # fmt: skip
        """The window and its planner for `policy` under `args`, within `budget` bytes (`agree`, `warn`, `aux_loss`,
        `alias_parameters`: [`HoldPlanner`]'s)."""
        costs = HoldCosts(policy, 2 if args.bf16 or args.fp16 else None, args.gradient_checkpointing)
        planner = HoldPlanner(budget, costs, agree, warn, aux_loss=aux_loss, alias_parameters=alias_parameters)
        return cls(planner, policy, args, vision, fsdp=fsdp)

    def step_begins(self, model) -> None:
        """A training micro-batch starts (`model`: the Trainer's wrapped model)."""
        if self.training and self.window_position == 0 and not zero_stale_gradients(model):
            self.training = False  # (before this window's first scope is planned)
            warn_hold("this DeepSpeed ZeRO-3 optimizer keeps no gradient partitions to zero at a step's start (a held "
                      "prompt's parameters would add to the last step's gradient)")  # fmt: skip

    def step_ends(self, sync_gradients: bool) -> None:
        """A training micro-batch ended; `sync_gradients`: it ended its optimizer step's window."""
        self.window_position = 0 if sync_gradients else self.window_position + 1

    def prepare(self, inputs, upcoming: Callable) -> None:
        """`inputs` is the next training micro-batch (None: a batch no training scope serves); `upcoming(position)`:
        the micro-batches TRL will serve from `inputs` on, in order, to the end of the optimizer step (`position`:
        micro-batches run in its window so far) or of the generation, where `inputs` is TRL's next buffered one (else
        None)."""
        scope = None
        if inputs is not None and self.training:
            scope = self._training_scope(inputs, upcoming)
        self.planner.activate(scope)

    def _training_scope(self, inputs, upcoming: Callable):
        """The training scope `inputs` is the next micro-batch of: the current one, or one planned from here to the
        end of the optimizer step or the generation, whichever comes first."""
        scope = self.planner.train_scope
        if scope is not None and scope.expects(inputs):
            return scope
        self.planner.close()
        if self.fsdp and nested_units(self.policy()):  # (known once sharded)
            self.training = False
            warn_hold("FSDP2 shards a module inside another sharded one (not only the root's), whose parameters a "
                      "held prompt's backward would need gathered")  # fmt: skip
            return None
        batches = upcoming(self.window_position)
        if not batches or len(batches) < 2:
            return None
        width = max(batch["prompt_ids"].size(1) + batch["completion_ids"].size(1) for batch in batches)
        images = any(batch.get("pixel_values") is not None for batch in batches)  # each group's prompt held apart
        tables = None  # each micro-batch's rows, where the scope may hold
        if all(ROWS_KEY in batch for batch in batches) and self.planner.costs.within_period(width) and (
                not images or self._images_packed(batches)):  # fmt: skip
            tables = [row_tokens(table_of(batch[ROWS_KEY])) for batch in batches]
        return self.planner.plan_training(batches, tables, width, self.vision.image_tokens if images else None)

    def _images_packed(self, batches: list) -> bool:
        """Whether every micro-batch's images will be packed ([`core.layers.vision.ModelVision.batch_reason`]): a
        micro-batch running stock's forward inside a training scope would leave the prompts held for it without their
        backward."""
        return all(self.vision.batch_reason(batch) is None for batch in batches if batch.get("pixel_values") is not None)

    def close(self) -> None:
        """Releases the training scope (a step failed, or the next micro-batch is not the one it planned)."""
        self.planner.close()
