"""
Prefix states held across micro-batches in TRL's trainers ([`core.tree.holds`], [`core.forward.scope`]).

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

import numpy as np
import torch

from ..core.forward.passes import ChunkPlan
from ..core.forward.scope import HeldScope
from ..core.forward.sharded import nested_units
from ..core.generation.prompt_cache import kv_sources, kv_token_bytes
from ..core.layers.families import position_period
from ..core.layers.vision import ModelVision
from ..core.tree.holds import (
    HoldPlan,
    chunks_encoding,
    held_image_bytes,
    held_token_bytes,
    plan_holds,
    prompts_held,
    scoring_chunks,
)
from ..core.tree.rows import row_tokens
from .config import ROWS_KEY
from .ranks import Ranks
from .switches import Switches


# Under DeepSpeed ZeRO-3 and FSDP every forward and backward gathers parameters from all processes, so that all of them
# must run the same ones: a held prompt's forward (and its backward, in training) is one more
PLANS_DIFFER = ("rloo_efficient: prompts held across micro-batches (and a no-grad pass's merged chunks) are used only "
                "where every process would make the same forwards and backwards, each of them gathering parameters "
                "from all processes; where the processes' plans differ (their prompts' lengths, or how their rows fall "
                "in micro-batches), each process forwards its rows' prompts per micro-batch, in stock's chunks.")


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


class TrainScope:
    """A training scope: its held sources, the micro-batches it plans (TRL's buffered batches, in the order TRL will
    serve them), and the next one's index."""

    def __init__(self, held: HeldScope | None, batches: list):
        self.held, self.batches, self.cursor = held, batches, 0

    def expects(self, inputs) -> bool:
        return self.cursor < len(self.batches) and self.batches[self.cursor] is inputs

    def close(self) -> None:
        if self.held is not None:
            self.held.close()
        self.cursor = len(self.batches)


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


class HeldPrefixes:
    """
    Prompts held across a no-grad pass's chunks and a step's training micro-batches, within `budget` bytes: the
    trainer tells it where each optimizer step's window starts and ends ([`step_begins`], [`step_ends`]) and which
    micro-batch comes next ([`prepare`]); the packed passes ask it for each pass's [`ChunkPlan`] ([`pass_plan`]).
    `policy()`: the policy, unwrapped; `args`: TRL's config; `fsdp`: 0, or FSDP's version; `aux_loss`: the MoE
    load-balancing loss is on (a training plan holds every token then); `alias_parameters`: a held prompt's training
    forward reads the parameters through aliases ([`core.forward.param_alias`]): where no DDP, DeepSpeed or FSDP
    watches their gradients and no compiled graph guards them.
    """

    def __init__(self, budget: int, policy: Callable, args, ranks: Ranks, switches: Switches, vision: ModelVision,
                 fsdp: int = 0, aux_loss: bool = False, alias_parameters: bool = False):  # fmt: skip
        self.budget, self.policy, self.training_args, self.ranks, self.switches = budget, policy, args, ranks, switches
        self.vision, self.fsdp, self.aux_loss, self.alias_parameters = vision, fsdp, aux_loss, alias_parameters
        self.train_scope: TrainScope | None = None
        self.active_scope: TrainScope | None = None  # the training scope of the micro-batch being prepared or run
        self.window_position = 0  # micro-batches run since the last optimizer step
        reason = hold_reason(args, fsdp)
        self.training = reason is None  # whether training micro-batches hold prompts too (the no-grad passes may alone)
        if reason is not None:
            warn_hold(reason)

    # -- training: the trainer's windows and micro-batches ---------------------------------------------------------
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
        self.active_scope = None
        if inputs is not None and self.training:
            self.active_scope = self._training_scope(inputs, upcoming)

    def _training_scope(self, inputs, upcoming: Callable) -> TrainScope | None:
        """The training scope `inputs` is the next micro-batch of: the current one, or one planned from here to the
        end of the optimizer step or the generation, whichever comes first."""
        scope = self.train_scope
        if scope is not None and scope.expects(inputs):
            return scope
        self.close()
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
        if all(ROWS_KEY in batch for batch in batches) and self._within_period(width) and (
                not images or self._images_packed(batches)):  # fmt: skip
            tables = [row_tokens(batch[ROWS_KEY]) for batch in batches]
            image_cost = (self.vision.image_tokens, self._held_image_bytes()) if images else None
            cap = min(len(batch[ROWS_KEY]) for batch in batches) * width  # one of stock's forwards

        def plan_for(hoist: bool) -> HoldPlan | None:
            if tables is None:
                return None
            return plan_holds(tables, full=self.aux_loss, budget=self.budget,
                              token_bytes=self._held_token_bytes(training=True), by_group=images,
                              image_cost=image_cost, source_cap=cap if hoist else None)  # fmt: skip

        plan = self._agreed_plan(plan_for, len(batches), training=True) or None
        held = None
        if plan is not None:
            held = HeldScope(plan, training=True, kv_source=self._kv_source(), alias_parameters=self.alias_parameters)
        self.train_scope = TrainScope(held, batches)
        return self.train_scope

    def _images_packed(self, batches: list) -> bool:
        """Whether every micro-batch's images will be packed ([`core.layers.vision.ModelVision.batch_reason`]): a
        micro-batch running stock's forward inside a training scope would leave the prompts held for it without their
        backward."""
        return all(self.vision.batch_reason(batch) is None for batch in batches if batch.get("pixel_values") is not None)

    def close(self) -> None:
        """Releases the training scope (a step failed, or the next micro-batch is not the one it planned)."""
        if self.train_scope is not None:
            self.train_scope.close()
        self.train_scope = self.active_scope = None

    def check_nothing_held(self) -> None:
        """Refuses stock's forward for a training micro-batch while prompts held for its training scope wait for their
        backward: it would not read them, and their gradient would be lost."""
        scope = self.active_scope
        if torch.is_grad_enabled() and scope is not None and scope.held is not None and scope.held.sources:
            raise RuntimeError("rloo_efficient: a training micro-batch would run stock's forward while prompts held "
                               "across its micro-batches wait for their backward (their gradient would be lost). Set "
                               "held_prefix_budget_gib=0 to forward each micro-batch's prompts itself.")  # fmt: skip

    # -- the packed passes: each pass's chunks -----------------------------------------------------------------------
    def pass_plan(self, rows: torch.Tensor, chunks: list, compute_aux_loss: bool, images: np.ndarray | None,
                  width: int) -> ChunkPlan:  # fmt: skip
        """How a packed pass over `chunks` (stock's `(start, end)` row ranges of `rows`) runs them: a no-grad pass's
        chunks merged where every prompt they count once is held, or its own scope; a training micro-batch's scope;
        else stock's chunks, nothing held. `images`: an image batch's rows with images, else None. `width`: the
        batch's columns ([`_within_period`])."""
        merged = None
        if not torch.is_grad_enabled() and not compute_aux_loss:
            merged = self._merged_chunks(rows, chunks, images, width)
        return merged or self._held_chunks(rows, chunks, compute_aux_loss, images, width)

    def pass_done(self, plan: ChunkPlan) -> None:
        """After a pass: a training scope moves to its next micro-batch (its sources released by the pass)."""
        train = self.train_scope
        if train is not None and plan.scope is not None and train.held is plan.scope:
            train.cursor += 1
            if train.cursor == len(train.batches):
                self.close()

    def _within_period(self, width: int) -> bool:
        """Whether a batch `width` columns wide may hold prompts: within Llama 4's scaling period
        ([`core.layers.families.position_period`]) every position scales alike, so a held node may sit at other rows'
        columns; past it, it may not. True for a model without one."""
        period = position_period(self.policy())
        return period is None or width <= period

    def _held_chunks(self, rows: torch.Tensor, chunks: list, compute_aux_loss: bool, images: np.ndarray | None,
                     width: int) -> ChunkPlan:  # fmt: skip
        """The training scope's current micro-batch under grad, or a scope planned now for a no-grad pass; stock's
        chunks with nothing held where nothing is."""
        if torch.is_grad_enabled():
            scope = self.active_scope
            if scope is None or scope.held is None or len(chunks) != 1 or not self._within_period(width):
                return ChunkPlan(chunks)
            return ChunkPlan(chunks, scope.held, [scope.cursor])
        if len(chunks) < 2:
            return ChunkPlan(chunks)
        batch_size, scored = chunks[0][1] - chunks[0][0], row_tokens(rows)[2]
        encodes = None if images is None else lambda plan: chunks_encoding(plan, chunks, scored, images,
                                                                           compute_aux_loss)  # fmt: skip
        plan = self._agreed_plan(lambda hoist: self._scoring_plan(rows, chunks, compute_aux_loss, images, width,
                                                                  batch_size if hoist else None),
                                 len(chunks), training=False, encodes=encodes)  # (every process, plan or not)
        if not plan:
            return ChunkPlan(chunks)
        return ChunkPlan(chunks, HeldScope(plan, training=False, kv_source=self._kv_source()), closes=True)

    def _merged_chunks(self, rows: torch.Tensor, chunks: list, images: np.ndarray | None,
                       width: int) -> ChunkPlan | None:  # fmt: skip
        """A no-grad pass's chunks merged ([`core.tree.holds.scoring_chunks`]), each no larger than one of stock's
        forwards (`chunks`: stock's, of its batch size), where every prompt they count once is held; else None
        (stock's chunks)."""
        if len(chunks) < 2:
            return None
        group, plen, scored, _ = row_tokens(rows)
        batch_size = chunks[0][1] - chunks[0][0]
        merged = scoring_chunks(group, plen, scored, batch_size * width)
        plan = None
        if len(merged) < len(chunks):
            plan = self._scoring_plan(rows, merged, False, images, width, batch_size)
        # (a row with an empty prompt runs stock's forward, which would split a merged chunk by stock's batch size)
        if len(merged) >= len(chunks) or (plen == 0).any() or not prompts_held(plan, merged, group, plen, scored):
            merged, plan = None, None
        # (the merged chunks follow each process's own lengths: their number agreed too)
        encodes = None if merged is None or images is None else lambda plan: chunks_encoding(plan, merged, scored,
                                                                                             images, False)  # fmt: skip
        hoisted = plan
        plan = self._agreed_plan(lambda hoist: hoisted if hoist or hoisted is None else self._scoring_plan(
            rows, merged, False, images, width, None), len(chunks), training=False, encodes=encodes,
            merged=len(merged or ()))  # fmt: skip
        if merged is None or plan is False:
            return None
        if plan is None:
            return ChunkPlan(merged)
        return ChunkPlan(merged, HeldScope(plan, training=False, kv_source=self._kv_source()), closes=True)

    def _scoring_plan(self, rows: torch.Tensor, chunks: list, compute_aux_loss: bool, images: np.ndarray | None,
                      width: int, batch_size: int | None):  # fmt: skip
        """The [`HoldPlan`] of a no-grad pass over `chunks` of `rows`, or None; a source forward within one of stock's
        (`batch_size` rows of `width` columns; None: each source in its own chunk)."""
        if not self._within_period(width):
            return None
        return plan_holds([row_tokens(rows[start:end]) for start, end in chunks], full=compute_aux_loss,
                          token_bytes=self._held_token_bytes(training=False), budget=self.budget,
                          by_group=images is not None, training=False,
                          source_cap=batch_size * width if batch_size is not None else None)  # fmt: skip

    def _agreed_plan(self, plan_for, chunks: int, training: bool, encodes=None, merged: int = 0):
        """The plan of a scope that every process agrees on ([`_plans_agree`]): `plan_for(True)`, its sources hoisted
        ([`core.tree.holds.hoisted_sources`]); where the processes' differ, `plan_for(False)` (each process hoists by
        its own prompts' lengths: plans without hoisting may agree where hoisted ones do not); else False, with one
        warning. None: agreed, nothing held."""
        plan = plan_for(True)
        if self._plans_agree(plan, chunks, training, encodes, merged):
            return plan
        plan = plan_for(False)
        if self._plans_agree(plan, chunks, training, encodes, merged):
            return plan
        self.switches.warn_once(PLANS_DIFFER)
        return False

    def _plans_agree(self, plan: HoldPlan | None, chunks: int, training: bool, encodes=None,
                     merged: int = 0) -> bool:  # fmt: skip
        """Whether every process's `plan` (of a scope of at most `chunks` chunks, `merged` of them where a no-grad
        pass's were merged) adds the same forwards and backwards to the same chunks, and (`encodes(plan)`, an image
        batch's) encodes images in the same chunks' own forwards ([`core.tree.holds.chunks_encoding`]); True where the
        processes' forwards are independent."""
        if not self.ranks.collective():
            return True
        pattern = np.zeros((3, chunks), dtype=np.int64)  # one length on every process, images or not
        if plan is not None:
            pattern[:2] = plan.forward_pattern(chunks, training)
        if encodes is not None:
            encoded = encodes(plan)
            pattern[2, : len(encoded)] = encoded
        return self.ranks.agree(np.append(pattern.ravel(), merged))

    # -- what a held prompt costs ------------------------------------------------------------------------------------
    def _kv_source(self) -> list[int]:
        return kv_sources(self.policy().config.get_text_config(decoder=True))

    def _held_token_bytes(self, training: bool) -> int:
        """[`tree.holds.held_token_bytes`] of the policy's text config."""
        config = self.policy().config.get_text_config(decoder=True)
        size = self._held_element_size()
        return held_token_bytes(kv_token_bytes(config, size), config.hidden_size, config.num_hidden_layers, size,
                                training, self.training_args.gradient_checkpointing)  # fmt: skip

    def _held_image_bytes(self) -> int:
        """[`tree.holds.held_image_bytes`] of the policy's vision config."""
        return held_image_bytes(getattr(self.policy().config, "vision_config", None), self._held_element_size(),
                                self.training_args.gradient_checkpointing)  # fmt: skip

    def _held_element_size(self) -> int:
        """Bytes per value of what a held prompt keeps: bf16 under mixed precision, else the model's dtype."""
        if self.training_args.bf16 or self.training_args.fp16:
            return 2
        return next(self.policy().parameters()).element_size()
