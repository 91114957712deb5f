"""
How each packed pass runs its chunks when prompts may be held across them ([`HoldPlanner`]): a no-grad pass's chunks
merged or planned as one scope, a training micro-batch's chunk in the training scope planned for its optimizer step,
else stock's chunks with nothing held. What a held prompt costs is the policy's ([`HoldCosts`]); where processes must
run the same forwards, they agree on each plan through the caller's `agree`.

The training window (which micro-batches a training scope spans, and when it starts and ends) is the caller's: it plans
a scope ([`HoldPlanner.plan_training`]) and makes it the active one ([`HoldPlanner.activate`]); the passes ask for their
chunks ([`HoldPlanner.pass_plan`]) and report each pass done ([`HoldPlanner.pass_done`]).
"""

import functools
from collections.abc import Callable

import numpy as np
import torch

from ..generation.prompt_cache import held_token_values, kv_sources
from ..layers.families import position_period
from ..layers.recurrent import held_state_values
from ..tree.hold_budget import held_image_bytes, held_node_bytes, held_token_bytes
from ..tree.holds import HoldPlan, plan_holds
from ..tree.pass_chunks import chunks_encoding, prompts_held, scoring_chunks
from ..tree.rows import row_tokens
from .passes import ChunkPlan
from .scope import HeldScope


# Under DeepSpeed ZeRO-3 and FSDP every forward and backward gathers parameters from all processes, so that all of them
# must run the same ones: a held prompt's forward (and its backward, in training) is one more
PLANS_DIFFER = ("rloo_efficient: prompts held across micro-batches (and a no-grad pass's merged chunks) are used only "
                "where every process would make the same forwards and backwards, each of them gathering parameters "
                "from all processes; where the processes' plans differ (their prompts' lengths, or how their rows fall "
                "in micro-batches), each process forwards its rows' prompts per micro-batch, in stock's chunks.")


class HoldCosts:
    """
    What a held prompt costs, and where it may sit, read from the policy (`policy()`: the policy, unwrapped):
    `element_size` bytes per held value (bf16 under mixed precision: 2; None: the model's dtype), `checkpointing`:
    gradient checkpointing (a training prompt's layers keep their inputs only).
    """

    def __init__(self, policy: Callable, element_size: int | None, checkpointing: bool):
        self.policy, self.element_size, self.checkpointing = policy, element_size, checkpointing

    def _size(self) -> int:
        return self.element_size or self._parameter_size()

    def _parameter_size(self) -> int:
        return next(self.policy().parameters()).element_size()

    def kv_source(self) -> list[int]:
        """Per attention layer, the layer whose keys it reads ([`generation.prompt_cache.kv_sources`])."""
        return kv_sources(self.policy().config.get_text_config(decoder=True))

    @functools.cached_property
    def _kv_values(self) -> tuple[int, int]:
        """A token's held values over the layers ([`generation.prompt_cache.held_token_values`]: keys and values,
        latents): the config's alone, found once rather than per plan (it builds a cache's layers from the config)."""
        return held_token_values(self.policy().config.get_text_config(decoder=True))

    def token_bytes(self, training: bool) -> int:
        """[`tree.hold_budget.held_token_bytes`] of the policy's text config: keys and values at `element_size`
        bytes, latents at the parameters' (latent attention's come out of a norm or the rotary embedding, in the
        parameters' dtype under autocast; Kimi-Linear's rope part, in autocast's, is charged the wider size)."""
        config = self.policy().config.get_text_config(decoder=True)
        size = self._size()
        keys, latents = self._kv_values
        held = keys * size + latents * self._parameter_size()
        return held_token_bytes(held, keys + latents, config.hidden_size, config.num_hidden_layers, size, training,
                                self.checkpointing)  # fmt: skip

    def node_bytes(self, training: bool) -> int:
        """[`tree.hold_budget.held_node_bytes`] of the policy's recurrent layers (0 without any)."""
        return held_node_bytes(*held_state_values(self.policy()), self._size(), training)

    def image_bytes(self) -> int:
        """[`tree.hold_budget.held_image_bytes`] of the policy's vision config."""
        return held_image_bytes(getattr(self.policy().config, "vision_config", None), self._size(), self.checkpointing)

    def within_period(self, width: int) -> bool:
        """Whether a batch `width` columns wide may hold prompts: within Llama 4's scaling period
        ([`layers.families.position_period`]) every position scales alike, so a held node may sit at other rows'
        columns; past it, it may not. True for a model without one."""
        period = position_period(self.policy())
        return period is None or width <= period


class TrainScope:
    """A training scope: its held sources (None: nothing held), the micro-batches it plans (in the order they will be
    served), and the next one's index."""

    def __init__(self, held: HeldScope | None, batches: list):
        self.held, self.batches, self.cursor = held, batches, 0

    def expects(self, inputs) -> bool:
        return self.cursor < len(self.batches) and self.batches[self.cursor] is inputs

    def close(self) -> None:
        if self.held is not None:
            self.held.close()
        self.cursor = len(self.batches)


class HoldPlanner:
    """
    The chunks of every packed pass, prompts held within `budget` bytes at `costs` ([`HoldCosts`]). `agree(values)`:
    whether every process has the same integer `values` (True where each process forwards alone); `warn(message)`:
    says once why a plan is not used. `aux_loss`: the MoE load-balancing loss is on (a training plan holds every token
    then); `alias_parameters`: a held prompt's training forward reads the parameters through aliases
    ([`param_alias`]), where nothing else watches their gradients.
    """

    def __init__(self, budget: int, costs: HoldCosts, agree: Callable[[np.ndarray], bool],
                 warn: Callable[[str], None], aux_loss: bool = False, alias_parameters: bool = False):  # fmt: skip
        self.budget, self.costs, self.agree, self.warn = budget, costs, agree, warn
        self.aux_loss, self.alias_parameters = aux_loss, alias_parameters
        self.train_scope: TrainScope | None = None  # the training scope planned last
        self.active_scope: TrainScope | None = None  # the training scope of the micro-batch being prepared or run

    # -- training scopes ---------------------------------------------------------------------------------------------
    def plan_training(self, batches: list, tables: list | None, width: int, image_tokens: int | None) -> TrainScope:
        """A training scope over `batches` (the micro-batches it spans, in order; `tables`: each one's
        [`tree.rows.row_tokens`], None where it may not hold), `width` columns wide; `image_tokens`: the tokens an
        image takes, where the batches have images (each group's prompt held apart), else None. Replaces the last one
        (closed)."""
        self.close()
        image_cost = (image_tokens, self.costs.image_bytes()) if image_tokens is not None else None
        cap = min(len(table[0]) for table in tables) * width if tables is not None else None  # one stock forward

        def plan_for(hoist: bool) -> HoldPlan | None:
            if tables is None:
                return None
            return plan_holds(tables, full=self.aux_loss, budget=self.budget,
                              token_bytes=self.costs.token_bytes(training=True),
                              node_bytes=self.costs.node_bytes(training=True), by_group=image_tokens is not None,
                              image_cost=image_cost, source_cap=cap if hoist else None)  # fmt: skip

        plan = self._agreed_plan(plan_for, len(batches), training=True) or None
        held = None
        if plan is not None:
            held = HeldScope(plan, training=True, kv_source=self.costs.kv_source(),
                             alias_parameters=self.alias_parameters)  # fmt: skip
        self.train_scope = TrainScope(held, batches)
        return self.train_scope

    def activate(self, scope: TrainScope | None) -> None:
        """Makes `scope` the one the next training micro-batch runs in (None: none)."""
        self.active_scope = scope

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
        batch's columns ([`HoldCosts.within_period`])."""
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

    def _held_chunks(self, rows: torch.Tensor, chunks: list, compute_aux_loss: bool, images: np.ndarray | None,
                     width: int) -> ChunkPlan:  # fmt: skip
        """The training scope's current micro-batch under grad, or a scope planned now for a no-grad pass; stock's
        chunks with nothing held where nothing is."""
        if torch.is_grad_enabled():
            scope = self.active_scope
            if scope is None or scope.held is None or len(chunks) != 1 or not self.costs.within_period(width):
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
        return ChunkPlan(chunks, HeldScope(plan, training=False, kv_source=self.costs.kv_source()), closes=True)

    def _merged_chunks(self, rows: torch.Tensor, chunks: list, images: np.ndarray | None,
                       width: int) -> ChunkPlan | None:  # fmt: skip
        """A no-grad pass's chunks merged ([`tree.pass_chunks.scoring_chunks`]), each no larger than one of stock's
        forwards (`chunks`: stock's, of its batch size), where every prompt they count once is held; else None (stock's
        chunks)."""
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
        return ChunkPlan(merged, HeldScope(plan, training=False, kv_source=self.costs.kv_source()), closes=True)

    def _scoring_plan(self, rows: torch.Tensor, chunks: list, compute_aux_loss: bool, images: np.ndarray | None,
                      width: int, batch_size: int | None) -> HoldPlan | None:  # fmt: skip
        """The [`HoldPlan`] of a no-grad pass over `chunks` of `rows`, or None; a source forward within one of stock's
        (`batch_size` rows of `width` columns; None: each source in its own chunk)."""
        if not self.costs.within_period(width):
            return None
        return plan_holds([row_tokens(rows[start:end]) for start, end in chunks], full=compute_aux_loss,
                          token_bytes=self.costs.token_bytes(training=False),
                          node_bytes=self.costs.node_bytes(training=False), budget=self.budget,
                          by_group=images is not None, training=False,
                          source_cap=batch_size * width if batch_size is not None else None)  # fmt: skip

    def _agreed_plan(self, plan_for, chunks: int, training: bool, encodes=None, merged: int = 0):
        """The plan of a scope that every process agrees on ([`_plans_agree`]): `plan_for(True)`, its sources hoisted
        ([`tree.hold_budget.hoisted_sources`]); where the processes' differ, `plan_for(False)` (each process hoists by
        its own prompts' lengths: plans without hoisting may agree where hoisted ones do not); else False, with one
        warning. None: agreed, nothing held."""
        plan = plan_for(True)
        if self._plans_agree(plan, chunks, training, encodes, merged):
            return plan
        plan = plan_for(False)
        if self._plans_agree(plan, chunks, training, encodes, merged):
            return plan
        self.warn(PLANS_DIFFER)
        return False

    def _plans_agree(self, plan: HoldPlan | None, chunks: int, training: bool, encodes=None,
                     merged: int = 0) -> bool:  # fmt: skip
        """Whether every process's `plan` (of a scope of at most `chunks` chunks, `merged` of them where a no-grad
        pass's were merged) adds the same forwards and backwards to the same chunks, and (`encodes(plan)`, an image
        batch's) encodes images in the same chunks' own forwards ([`tree.pass_chunks.chunks_encoding`])."""
        pattern = np.zeros((3, chunks), dtype=np.int64)  # one length on every process, images or not
        if plan is not None:
            pattern[:2] = plan.forward_pattern(chunks, training)
        if encodes is not None:
            encoded = encodes(plan)
            pattern[2, : len(encoded)] = encoded
        return self.agree(np.append(pattern.ravel(), merged))
