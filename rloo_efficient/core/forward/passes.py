"""
A packed log-prob (or training) pass ([`PackedPass`]): stock TRL's `_get_per_token_logps_and_entropies` over a batch,
its rows in TRL's chunks, each chunk packed as its prefix tree ([`packing`]), its prompts held across chunks where the
caller's [`Holds`] plan it ([`scope`]), its images once per group ([`layers.vision.ImageBatch`]); a chunk that cannot
be packed runs the caller's stock forward.

The model call is the caller's (`model`: what TRL calls, the wrapped model; `autocast`: its mixed precision), with
TRL's fused head; this module never calls the model any other way.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import nn

from ..layers.families import position_period
from ..layers.install import install
from ..layers.moe import recording_router_logits, weighted_aux_loss
from ..layers.recurrent import has_recurrent_layers
from ..layers.rope import rope_length
from ..layers.vision import ImageBatch, ModelVision
from .graphed import MAX_ROWS, GraphedForwards, scored_in_full
from .in_place_grads import adding_in_place
from .packing import pack_rows
from .scope import HeldScope


@dataclasses.dataclass
class PassCounts:
    """What the packed passes processed (deterministic; read by tests and benchmarks)."""

    packed_forward_tokens: int = 0  # tokens the packed forwards processed, held prompts' included
    tree_tokens: int = 0  # the real tokens of the prefix trees those forwards packed (each shared run once)
    held_forward_tokens: int = 0  # tokens the held prompts' source forwards processed (part of the above)
    scoring_forward_calls: int = 0  # model calls of the no-grad passes, held prompts' included
    graph_replays: int = 0  # chunks of the no-grad passes replayed from a captured graph ([`graphed`])
    in_place_head_grads: int = 0  # training backwards adding the LM head's gradient to `.grad` as made ([`in_place_grads`])
    in_place_embedding_grads: int = 0  # ... and the input embedding's


@dataclasses.dataclass
class ChunkPlan:
    """How a pass runs its chunks: `chunks` (`(start, end)` row ranges), the held `scope` they read (None: nothing
    held) with each chunk's index in its plan (`indices`), and whether the pass closes the scope when done (a no-grad
    pass's own scope; a training scope outlives its micro-batch)."""

    chunks: list
    scope: HeldScope | None = None
    indices: range | list | None = None
    closes: bool = False

    def __post_init__(self):
        if self.indices is None:
            self.indices = range(len(self.chunks))


class Holds(Protocol):
    """What a pass asks of the prompts held across its chunks ([`hold_planner.HoldPlanner`])."""

    def pass_plan(self, rows: torch.Tensor, chunks: list, compute_aux_loss: bool, images: np.ndarray | None,
                  width: int) -> ChunkPlan: ...  # fmt: skip

    def pass_done(self, plan: ChunkPlan) -> None: ...

    def check_nothing_held(self) -> None: ...


class _Batch(NamedTuple):
    """A pass's batch: stock's padded `(B, P + C)` rows, the last `logits_to_keep` columns completions, and `rows`, its
    group structure ([`tree.rows.row_groups`])."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    rows: torch.Tensor


@dataclasses.dataclass
class PackedPass:
    """
    How a trainer's packed passes call its model: `model` is what TRL calls (the wrapped model), `unwrapped` the module
    inside it, `autocast` its mixed precision; `holds` plans each pass's chunks (None: stock's chunks, nothing held);
    `fall_back(reason)` says why a chunk runs stock's forward; `counts` adds up what the passes processed.
    """

    model: nn.Module
    unwrapped: nn.Module
    compute_entropy: bool = False
    compute_aux_loss: bool = False  # each chunk's MoE load-balancing loss over every token stock's chunk holds
    vision: ModelVision | None = None  # the model's, for a batch with images: each group's images once
    autocast: Callable = contextlib.nullcontext
    holds: Holds | None = None
    fall_back: Callable = lambda reason: None
    counts: PassCounts = dataclasses.field(default_factory=PassCounts)
    sharded: bool = False  # FSDP may shard the model ([`sharded`]): a held prompt's training forward is guarded
    graphs: bool = False  # a no-grad pass's small chunks replayed from CUDA graphs where captured ([`graphed`])
    grads_in_place: bool = False  # training: the LM head's and embedding's gradients added to `.grad` as made

    def run(self, input_ids, attention_mask, logits_to_keep: int, rows: torch.Tensor, batch_size: int | None,
            images: dict, stock: Callable) -> tuple:  # fmt: skip
        """
        Stock's `(logps, entropies, aux_loss)` of `input_ids` (`(B, P + C)`, stock's padded batch, the last
        `logits_to_keep` columns completions; `rows`: its group structure, [`tree.rows.row_groups`]; `images`: TRL's
        image kwargs, or empty), in TRL's chunks of `batch_size` rows, each packed; `stock(input_ids, attention_mask,
        **images)`: TRL's forward of some rows, for a chunk that cannot be packed.
        """
        install(self.unwrapped)  # done at init; a model swapped in since (e.g. a synced reference) too
        batch = _Batch(input_ids, attention_mask, logits_to_keep, rows)
        image_batch = None
        if images:
            image_batch = ImageBatch(self.unwrapped, self.vision, images, input_ids, attention_mask, logits_to_keep)
        size, total = batch_size or input_ids.size(0), input_ids.size(0)
        plan = ChunkPlan([(start, min(start + size, total)) for start in range(0, total, size)])
        if self.holds is not None:
            with_images = image_batch.rows_with_images if image_batch is not None else None
            plan = self.holds.pass_plan(rows, plan.chunks, self.compute_aux_loss, with_images, input_ids.size(1))
        graphed = None
        if self.graphs and not torch.is_grad_enabled() and not self.compute_aux_loss and image_batch is None and (
                not self._recurrent and GraphedForwards.applies(self.unwrapped, input_ids.device)):  # fmt: skip
            graphed = GraphedForwards(self.unwrapped, input_ids.device, functools.partial(self._call, input_ids.size(1)),
                                      self.compute_entropy, self.counts)  # fmt: skip
        all_logps, all_entropies, all_aux = [], [], []
        in_place = contextlib.nullcontext()
        if self.grads_in_place and torch.is_grad_enabled():
            in_place = adding_in_place(self.unwrapped, self.counts)
        try:
            with in_place:  # (the stock forward of a chunk that cannot be packed too)
                for index, (start, end) in zip(plan.indices, plan.chunks, strict=True):
                    if plan.scope is not None and plan.scope.plan.chunks[index].source is not None:
                        # The prompts first held here, forwarded once for every later chunk
                        self._forward_source(batch, image_batch, plan.scope, index, start, end)
                    logps, entropies, aux = self._chunk(batch, image_batch, plan.scope, index, start, end, stock, graphed)
                    if plan.scope is not None:
                        plan.scope.release(index)
                        if graphed is not None:
                            graphed.release(set(plan.scope.sources))
                    all_logps.append(logps)
                    all_entropies.append(entropies)
                    all_aux.append(aux)
        finally:
            if plan.closes:
                plan.scope.close()
        if self.holds is not None:
            self.holds.pass_done(plan)
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if self.compute_entropy else None
        aux_loss = torch.stack(all_aux).mean() if self.compute_aux_loss else None  # as TRL averages its chunks'
        return logps, entropies, aux_loss

    @functools.cached_property
    def _recurrent(self) -> bool:
        return has_recurrent_layers(self.unwrapped)

    def _call(self, width: int, **inputs):
        """The model on packed inputs, under stock's autocast, LongRoPE's factors as stock's forward of the padded
        chunk (`width` columns) chooses them."""
        self.counts.scoring_forward_calls += not torch.is_grad_enabled()
        text_config = self.unwrapped.config.get_text_config()
        # A config asking for router logits would have TRL's head compute its own loss over our flat sequence
        extra = {"output_router_logits": False} if hasattr(text_config, "output_router_logits") else {}
        with self.autocast(), rope_length(self.unwrapped, width):
            return self.model(**inputs, fused_lm_head=True, **extra)

    def _forward_source(self, batch: _Batch, images: ImageBatch | None, scope: HeldScope, index: int, start: int,
                        end: int) -> None:  # fmt: skip
        """Forwards the prompts chunk `index` holds first, once, for every later chunk (their images encoded here)."""
        routers = None
        if self.compute_aux_loss:
            routers = functools.partial(recording_router_logits, self.unwrapped)
        width = batch.input_ids.size(1)
        tokens = scope.forward_source(scope.plan.chunks[index].source, functools.partial(self._call, width),
                                      width - batch.logits_to_keep, batch.input_ids.device, self._recurrent, routers,
                                      images, (start, end), self.unwrapped if self.sharded else None,
                                      parameters_of=self.model)  # fmt: skip
        tokens = int(tokens)  # (numpy's: a report's JSON takes an int)
        self.counts.packed_forward_tokens += tokens
        self.counts.tree_tokens += tokens
        self.counts.held_forward_tokens += tokens

    def _chunk(self, batch: _Batch, images: ImageBatch | None, scope: HeldScope | None, index: int, start: int,
               end: int, stock: Callable, graphed: GraphedForwards | None = None) -> tuple:  # fmt: skip
        """The rows `[start, end)` packed (after the prompts `scope` holds for them) and forwarded (one or two rows
        through `graphed`, where given: packed in full, replayed where their layout repeats); where they cannot be
        packed ([`packing.pack_rows`] says why), stock's forward."""
        pack = dict(token_weights=self.compute_aux_loss, group_sources=images is not None and images.with_positions,
                    image_tokens=images.vision.image_tokens if images else None, recurrent=self._recurrent,
                    position_period=position_period(self.unwrapped))  # fmt: skip
        ids, rows = batch.input_ids[start:end], batch.rows[start:end]
        graphed = graphed if end - start <= MAX_ROWS else None
        if graphed is not None:
            rows = scored_in_full(rows, batch.logits_to_keep)
        if scope is not None:
            packed = scope.pack(index, ids, batch.logits_to_keep, rows, **pack)
        else:
            packed = pack_rows(ids, batch.logits_to_keep, rows, **pack)
        if isinstance(packed, str):
            if self.holds is not None:
                self.holds.check_nothing_held()
            self.fall_back(packed)
            return stock(ids, batch.attention_mask[start:end], **(images.of_rows(start, end) if images else {}))
        chunk_images = {}
        if images is not None:
            packed, chunk_images = images.packed(packed, start)
        self.counts.packed_forward_tokens += packed.num_tokens
        self.counts.tree_tokens += int(packed.tree.real_tokens)  # (numpy's: a report's JSON takes an int)
        if graphed is not None:
            log_probs, entropy = graphed.forward(packed)
            return packed.unpack(log_probs), packed.unpack(entropy) if self.compute_entropy else None, None
        routers = recording_router_logits(self.unwrapped) if self.compute_aux_loss else contextlib.nullcontext()
        with routers as router_logits:
            outputs = self._call(batch.input_ids.size(1), **packed.model_inputs(), **chunk_images)
        logps = packed.unpack(outputs.log_probs)
        entropies = packed.unpack(outputs.entropy) if self.compute_entropy else None
        aux = None
        if self.compute_aux_loss:
            held_logits = packed.layout.held.routers() if packed.layout.held is not None else []
            aux = weighted_aux_loss(router_logits, packed.token_weights, self.unwrapped.config.get_text_config(),
                                    held_logits, list(packed.held_weights))  # fmt: skip
        return logps, entropies, aux
