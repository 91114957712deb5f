"""
A [`tree.holds.HoldPlan`] as it runs: each chunk forwards the source first needed there, reads the sources it needs in
the version its backward calls for ([`attention.held`]), and releases those whose last use it was.

The model call is the caller's (`call(**inputs)`: a trainer's wrapped model under its autocast, with TRL's fused head):
this module packs, holds and releases; it never calls the model any other way than the caller does.
"""

import contextlib
from dataclasses import replace

import numpy as np
import torch

from ..attention.held import Capture, HeldReads, HeldSource, holding, link
from ..layers.vision import ImageBatch
from ..tree.holds import HoldPlan
from ..tree.rows import row_tokens
from .packing import PackedBatch, pack_rows, pack_source
from .param_alias import aliased_parameters
from .sharded import running_owner


class HeldScope:
    """The sources of a plan's scope while its chunks run (`training`: with grad, read in the version each reader's
    backward calls for; else without). `kv_source`: per attention layer, the layer whose keys it reads.
    `alias_parameters`: a training source reads the trainable parameters through aliases ([`param_alias`]), where
    nothing else watches their gradients' accumulation (one process)."""

    def __init__(self, plan: HoldPlan, training: bool, kv_source: list[int] | None = None,
                 alias_parameters: bool = False):  # fmt: skip
        self.plan, self.training, self.kv_source = plan, training, kv_source
        self.alias_parameters = training and alias_parameters
        self.sources: dict[int, HeldSource] = {}
        self.forwarded_tokens = 0  # tokens the source forwards processed (read by tests and counters)

    def reads(self, sources: tuple[int, ...], reader_backprop: int) -> HeldReads:
        """The held state a forward whose backward runs in chunk `reader_backprop` reads of `sources`."""
        slots = []
        for source in sources:
            if source not in self.sources:
                raise RuntimeError(f"Held source {source} is read before its chunk forwarded it, or after its release.")
            attached = self.training and self.plan.attached(source, reader_backprop)
            slots.append(self.sources[source].read(attached))
        return HeldReads(slots, self.kv_source)

    def forward_source(self, source: int, call, prompt_width: int, device, recurrent: bool, routers=None,
                       images: ImageBatch | None = None, chunk: tuple[int, int] = (0, 0), sharded=None,
                       parameters_of=None) -> int:  # fmt: skip
        """Runs `source`'s packed forward through `call`, holding what its layers hand over (and the router logits
        `routers(on_record)` records, a context manager yielding a list, where given). With `images` (an image batch,
        planned by group), `chunk`: the `(start, end)` rows of the batch's chunk that forwards the source (its images
        are encoded here once). `sharded`: the model, where FSDP2 may shard it ([`sharded`]). `parameters_of`: the
        module `call` runs, whose parameters a training source reads through aliases where the scope says so. Returns
        its tokens."""
        extra = {}
        if images is None:
            batch = pack_source(self.plan, source, prompt_width, device, recurrent)
        else:
            shape = (chunk[1] - chunk[0], images.input_ids.size(1))
            batch = pack_source(self.plan, source, prompt_width, device, recurrent, images.vision.image_tokens, shape)
            batch, extra = images.packed(batch, chunk[0])
        reads = self.reads(batch.held_sources, int(self.plan.backprop_chunk[source]))
        inputs = {**batch.model_inputs(), "rloo_prefix_layout": replace(batch.layout, held=reads, memo={}), **extra}
        aliased = contextlib.nullcontext()
        if self.alias_parameters and parameters_of is not None:
            aliased = aliased_parameters(parameters_of)
        with running_owner(sharded if self.training else None) as owner, aliased:
            capture = Capture(self.kv_source, owner)
            recorded = routers(capture.guard) if routers is not None else contextlib.nullcontext([])
            with holding(capture), recorded as logits:
                call(**inputs)
        capture.routers(list(logits))
        # (its backward sets off the backward of the ancestors it read attached, whose banks it must bring in)
        self.sources[source] = HeldSource(link(capture.tensors, reads.links()), batch.num_tokens)
        self.forwarded_tokens += batch.num_tokens
        return batch.num_tokens

    def pack(self, chunk: int, input_ids, logits_to_keep: int, rows: torch.Tensor, **kwargs) -> PackedBatch | str:
        """Chunk `chunk`'s rows packed after their held nodes, its layout reading the held state."""
        packed = pack_rows(input_ids, logits_to_keep, rows, hold=(self.plan, self.plan.chunks[chunk]), **kwargs)
        if isinstance(packed, str):
            return packed
        reads = self.reads(packed.held_sources, chunk)
        return replace(packed, layout=replace(packed.layout, held=reads, memo={}))

    def release(self, chunk: int) -> None:
        """Drops the sources whose last use was chunk `chunk` (in training: whose backward it runs)."""
        for source in self.plan.released_after(chunk, self.training):
            held = self.sources.pop(source, None)
            if held is not None:
                held.release()

    def close(self) -> None:
        for held in self.sources.values():
            held.release()
        self.sources.clear()


def chunk_tables(rows: torch.Tensor, chunks: list[np.ndarray]) -> list[tuple]:
    """[`tree.rows.row_tokens`] of each chunk's rows (`chunks`: row indices into `rows`)."""
    return [row_tokens(rows[torch.from_numpy(chunk)]) for chunk in chunks]
