"""
A packed log-prob (or training) pass: stock TRL's `_get_per_token_logps_and_entropies` over a batch, its rows in
chunks, each chunk packed as its prefix tree ([`packing`]), its prompts held across chunks where a plan holds them
([`scope`]), its images once per group ([`layers.vision.ImageBatch`]); a chunk that cannot be packed runs the caller's
stock forward.

The model call is the caller's (`model`: what TRL calls, the wrapped model; `autocast`: its mixed precision), with
TRL's fused head; this module never calls the model any other way.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from ..layers.families import position_period
from ..layers.install import install
from ..layers.moe import recording_router_logits, weighted_aux_loss
from ..layers.recurrent import has_recurrent_layers
from ..layers.rope import rope_length
from ..layers.vision import ImageBatch
from .packing import pack_rows
from .scope import HeldScope


@dataclasses.dataclass
class PassCounts:
    """What the packed passes processed (deterministic; read by tests and benchmarks)."""

    packed_forward_tokens: int = 0  # tokens the packed forwards processed, held prompts' included
    tree_tokens: int = 0  # the real tokens of the prefix trees those forwards packed (each shared run once)
    held_forward_tokens: int = 0  # tokens the held prompts' source forwards processed (part of the above)
    scoring_forward_calls: int = 0  # model calls of the no-grad passes, held prompts' included


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


@dataclasses.dataclass
class PackedPass:
    """
    One packed pass over `input_ids` (`(B, P + C)`, stock's padded batch) of which the last `logits_to_keep` columns
    are completions, `rows` its group structure ([`tree.rows.row_groups`]); `model` is what TRL calls, `unwrapped` the
    module inside it. Returns stock's `(logps, entropies, aux_loss)`.
    """

    model: nn.Module
    unwrapped: nn.Module
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    rows: torch.Tensor
    compute_entropy: bool = False
    compute_aux_loss: bool = False  # each chunk's MoE load-balancing loss over every token stock's chunk holds
    images: ImageBatch | None = None  # an image batch's: each group's images once
    autocast: Callable = contextlib.nullcontext
    counts: PassCounts = dataclasses.field(default_factory=PassCounts)
    sharded: bool = False  # FSDP2 may shard the model ([`sharded`]): a held prompt's training forward is guarded

    def run(self, plan: ChunkPlan, stock: Callable) -> tuple:
        """Each of `plan`'s chunks packed (`stock(start, end, reason)`: stock's forward of the rows `[start, end)`, where
        a chunk cannot be packed, and why)."""
        install(self.unwrapped)  # done at init; a model swapped in since (e.g. a synced reference) too
        all_logps, all_entropies, all_aux = [], [], []
        try:
            for index, (start, end) in zip(plan.indices, plan.chunks, strict=True):
                if plan.scope is not None and plan.scope.plan.chunks[index].source is not None:
                    self._forward_source(plan.scope, index, start, end)  # the prompts first held here, for later chunks
                logps, entropies, aux = self._chunk(plan.scope, index, start, end, stock)
                if plan.scope is not None:
                    plan.scope.release(index)
                all_logps.append(logps)
                all_entropies.append(entropies)
                all_aux.append(aux)
        finally:
            if plan.closes:
                plan.scope.close()
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if self.compute_entropy else None
        aux_loss = torch.stack(all_aux).mean() if self.compute_aux_loss else None  # as TRL averages its chunks'
        return logps, entropies, aux_loss

    @functools.cached_property
    def _recurrent(self) -> bool:
        return has_recurrent_layers(self.unwrapped)

    def _call(self, **inputs):
        """The model on packed inputs, under stock's autocast, LongRoPE's factors as stock's forward of the padded
        chunk chooses them."""
        self.counts.scoring_forward_calls += not torch.is_grad_enabled()
        text_config = self.unwrapped.config.get_text_config()
        # A config asking for router logits would have TRL's head compute its own loss over our flat sequence
        extra = {"output_router_logits": False} if hasattr(text_config, "output_router_logits") else {}
        with self.autocast(), rope_length(self.unwrapped, self.input_ids.size(1)):
            return self.model(**inputs, fused_lm_head=True, **extra)

    def _forward_source(self, scope: HeldScope, index: int, start: int, end: int) -> None:
        """Forwards the prompts chunk `index` holds first, once, for every later chunk (their images encoded here)."""
        routers = None
        if self.compute_aux_loss:
            routers = functools.partial(recording_router_logits, self.unwrapped)
        tokens = scope.forward_source(scope.plan.chunks[index].source, self._call,
                                      self.input_ids.size(1) - self.logits_to_keep, self.input_ids.device,
                                      self._recurrent, routers, self.images, (start, end),
                                      self.unwrapped if self.sharded else None)  # fmt: skip
        self.counts.packed_forward_tokens += tokens
        self.counts.tree_tokens += tokens
        self.counts.held_forward_tokens += tokens

    def _chunk(self, scope: HeldScope | None, index: int, start: int, end: int, stock: Callable) -> tuple:
        """The rows `[start, end)` packed (after the prompts `scope` holds for them) and forwarded; where they cannot be
        packed, `stock(start, end, reason)` ([`packing.pack_rows`]'s reason)."""
        images = self.images
        pack = dict(token_weights=self.compute_aux_loss, group_sources=images is not None and images.with_positions,
                    image_tokens=images.vision.image_tokens if images else None,
                    recurrent=self._recurrent, position_period=position_period(self.unwrapped))  # fmt: skip
        ids, rows = self.input_ids[start:end], self.rows[start:end]
        if scope is not None:
            packed = scope.pack(index, ids, self.logits_to_keep, rows, **pack)
        else:
            packed = pack_rows(ids, self.logits_to_keep, rows, **pack)
        if isinstance(packed, str):
            return stock(start, end, packed)
        chunk_images = {}
        if images is not None:
            packed, chunk_images = images.packed(packed, start)
        self.counts.packed_forward_tokens += packed.num_tokens
        self.counts.tree_tokens += packed.tree.real_tokens
        routers = recording_router_logits(self.unwrapped) if self.compute_aux_loss else contextlib.nullcontext()
        with routers as router_logits:
            outputs = self._call(**packed.model_inputs(), **chunk_images)
        logps = packed.unpack(outputs.log_probs)
        entropies = packed.unpack(outputs.entropy) if self.compute_entropy else None
        aux = None
        if self.compute_aux_loss:
            held_logits = packed.layout.held.routers() if packed.layout.held is not None else []
            aux = weighted_aux_loss(router_logits, packed.token_weights, self.unwrapped.config.get_text_config(),
                                    held_logits, list(packed.held_weights))  # fmt: skip
        return logps, entropies, aux
