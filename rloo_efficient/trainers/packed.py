"""
The packed log-prob and training forwards ([`GroupSharingMixin`]'s, kept apart): TRL's
`_get_per_token_logps_and_entropies`, where the active group structure matches the batch it is given, packs each chunk
as its prefix tree ([`core.forward.packing`]), its images once per group ([`core.layers.vision`]), its prompts held
across chunks and micro-batches where they can be ([`held_prefix`]); TRL's forward otherwise.
"""

import contextlib
import dataclasses
import functools
import weakref

import numpy as np
import torch
from trl.extras.profiling import profiling_context

from ..core.forward.packing import pack_rows
from ..core.generation.generate import TOKEN_TYPE_FIELDS
from ..core.layers.families import position_period
from ..core.layers.install import install
from ..core.layers.moe import recording_router_logits, weighted_aux_loss
from ..core.layers.recurrent import has_recurrent_layers
from ..core.layers.rope import rope_length
from ..core.layers.vision import (
    image_blocks,
    image_indices,
    layout_reason,
    packed_positions,
    rope_index_positions,
    select_images,
    token_blocks,
)


class PackedForwardMixin:
    """TRL method wrapped (calling `super()` where it does not pack): `_get_per_token_logps_and_entropies`."""

    _unwrapped_models: weakref.WeakKeyDictionary | None = None

    def _unwrapped(self, model=None):
        """`accelerator.unwrap_model(model)` (default: the policy), looked up once per model: accelerate's asks which
        packages are installed on every call (about 1.7 ms here), and the packed forward asks it once per chunk."""
        model = self.model if model is None else model
        if self._unwrapped_models is None:
            self._unwrapped_models = weakref.WeakKeyDictionary()
        known = self._unwrapped_models.get(model)
        inner = known() if known is not None else None
        if inner is None:
            inner = self.accelerator.unwrap_model(model)
            self._unwrapped_models[model] = weakref.ref(inner)  # (weak: the inner module is often the model itself)
        return inner

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal_kwargs):  # fmt: skip
        """TRL's forward, or the packed one when the active group structure matches the batch."""
        images = {key: value for key, value in multimodal_kwargs.items() if value is not None}
        rows = self._rows_for(input_ids, logits_to_keep, images)
        if self._hold_budget is not None and not torch.is_grad_enabled() and not self._all_ranks_agree(
                np.array([rows is not None])):  # fmt: skip
            rows = None  # every process packs or none does: the packed pass agrees its plans with all ([`held_prefix`])
        if rows is None:
            self._check_nothing_held()
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal_kwargs,
            )  # fmt: skip
        with profiling_context(self, "_get_per_token_logps_and_entropies"):  # TRL's timer, as its own method has
            return self._packed_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, rows, batch_size,
                                                    compute_entropy, compute_aux_loss, images)  # fmt: skip

    def _rows_for(self, input_ids, logits_to_keep, images: dict) -> torch.Tensor | None:
        """The active group structure when the packed forward can serve this call, else None."""
        rows = self._active_rows
        if not self._share_prefix or rows is None:
            return None
        if images.get("pixel_values") is not None:  # a batch with images: stock's forward where they cannot be packed
            reason = self._images_reason(images)
            if reason is not None:
                self._fall_back(reason, permanent=False)
                return None
        if any(key not in images for key in ("pixel_values", "num_images")) and images:  # token types, no image
            return None
        group, plen, scored = rows[:, :3].numpy().T  # host values
        if len(group) != input_ids.shape[0] or plen.max() > input_ids.shape[1] - logits_to_keep or (
            scored.max() > logits_to_keep):  # fmt: skip
            # Count-free, so that it warns once however many batch shapes miss it
            self._fall_back("the group structure of the batch's generation does not match the rows, prompt length or "
                            "completion length of the batch a forward is given", permanent=False)  # fmt: skip
            return None
        return rows

    def _packed_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, rows, batch_size,
                                    compute_entropy, compute_aux_loss=False, images=None):  # fmt: skip
        """TRL's micro-batch chunking, each chunk packed as one flat sequence (TRL's forward where it can't be); with
        `compute_aux_loss`, each chunk's MoE load-balancing loss over every token stock's chunk holds ([`core.layers.moe`]);
        with `images` (TRL's image kwargs), each group's images once ([`core.layers.vision`])."""
        batch_size = batch_size or input_ids.size(0)
        unwrapped = self._unwrapped(model)
        install(unwrapped)  # done at init; a model swapped in since (e.g. a synced reference) too
        text_config = unwrapped.config.get_text_config()
        # A config asking for router logits would have TRL's head compute its own loss over our flat sequence
        extra = {"output_router_logits": False} if hasattr(text_config, "output_router_logits") else {}
        all_logps, all_entropies, all_aux = [], [], []
        with_positions = bool(images) and self._vision["positions"] == "rope_index"  # Qwen's, from each group's row
        recurrent = has_recurrent_layers(unwrapped)
        chunks = [(start, min(start + batch_size, input_ids.size(0))) for start in range(0, input_ids.size(0), batch_size)]
        # Prompts held across chunks (a no-grad pass's, or this micro-batch of a training scope's): [`held_prefix`]; a
        # no-grad pass's chunks as many rows as fit what one of stock's forwards
        period = position_period(unwrapped)
        with_images = None  # an image batch's rows with images
        if images:
            counts = images["num_images"]
            with_images = np.asarray(counts.cpu() if isinstance(counts, torch.Tensor) else counts) > 0
        merged = None
        if not torch.is_grad_enabled() and not compute_aux_loss:
            merged = self._merged_chunks(rows, chunks, with_images, input_ids.size(1))
        if merged is not None:
            scope, indices, closes, chunks = merged
        else:
            scope, indices, closes = self._held_chunks(rows, chunks, compute_aux_loss, with_images, input_ids.size(1))

        def call(**inputs):  # LongRoPE's factors as stock's forward of the padded chunk chooses them
            self.scoring_forward_calls += not torch.is_grad_enabled()
            with self.accelerator.autocast(), rope_length(unwrapped, input_ids.size(1)):
                return model(**inputs, fused_lm_head=True, **extra)

        try:
            for index, (start, end) in zip(indices, chunks, strict=True):
                pack = dict(token_weights=compute_aux_loss, group_sources=with_positions,
                            image_tokens=self._image_tokens if images else None, recurrent=recurrent,
                            position_period=period)  # fmt: skip
                if scope is not None:
                    source = scope.plan.chunks[index].source
                    if source is not None:  # the prompts first held here: forwarded once, for every later chunk
                        routers = functools.partial(recording_router_logits, unwrapped) if compute_aux_loss else None
                        held_images = None
                        if images:  # its groups' images, encoded here once for every later chunk
                            held_images = (self._image_tokens, (end - start, input_ids.size(1)),
                                           lambda batch, start=start: self._with_images(
                                               unwrapped, batch, images, input_ids, attention_mask, start,
                                               logits_to_keep))  # fmt: skip
                        sharded = unwrapped if getattr(self, "is_fsdp_enabled", False) else None
                        tokens = scope.forward_source(source, call, input_ids.size(1) - logits_to_keep,
                                                      input_ids.device, recurrent, routers, held_images,
                                                      sharded)  # fmt: skip
                        self.packed_forward_tokens += tokens
                        self.tree_tokens += tokens
                        self.held_forward_tokens += tokens
                    packed = scope.pack(index, input_ids[start:end], logits_to_keep, rows[start:end], **pack)
                else:
                    packed = pack_rows(input_ids[start:end], logits_to_keep, rows[start:end], **pack)
                chunk_images = {}
                if images and not isinstance(packed, str):
                    packed, chunk_images = self._with_images(unwrapped, packed, images, input_ids, attention_mask,
                                                             start, logits_to_keep)  # fmt: skip
                if isinstance(packed, str):
                    self._check_nothing_held()
                    self._fall_back(packed, permanent=False)
                    stock = super()._get_per_token_logps_and_entropies.__func__
                    stock = getattr(stock, "__wrapped__", stock)  # TRL's forward without its timer: this call is timed
                    logps, entropies, aux = stock(self, model, input_ids[start:end], attention_mask[start:end],
                                                  logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                                                  **(self._images_of_rows(images, start, end) if images else {}))  # fmt: skip
                else:
                    self.packed_forward_tokens += packed.num_tokens
                    self.tree_tokens += packed.tree.real_tokens
                    routers = recording_router_logits(unwrapped) if compute_aux_loss else contextlib.nullcontext()
                    with routers as router_logits:
                        outputs = call(**packed.model_inputs(), **chunk_images)
                    logps = packed.unpack(outputs.log_probs)
                    entropies = packed.unpack(outputs.entropy) if compute_entropy else None
                    aux = None
                    if compute_aux_loss:
                        held_logits = packed.layout.held.routers() if packed.layout.held is not None else []
                        aux = weighted_aux_loss(router_logits, packed.token_weights, text_config, held_logits,
                                                list(packed.held_weights))  # fmt: skip
                if scope is not None:
                    self._chunk_done(scope, index)
                all_logps.append(logps)
                if compute_entropy:
                    all_entropies.append(entropies)
                if compute_aux_loss:
                    all_aux.append(aux)
        finally:
            if closes:
                scope.close()
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        aux_loss = torch.stack(all_aux).mean() if compute_aux_loss else None  # as TRL averages its chunks'
        return logps, entropies, aux_loss

    def _images_reason(self, images: dict) -> str | None:
        """Why a batch's image kwargs (TRL's, `pixel_values` among them) cannot be packed, or None."""
        return self._vision_reason or layout_reason(images, images.get("num_images") or [], self._vision["pixels"])

    def _check_nothing_held(self) -> None:
        """Refuses stock's forward for a training micro-batch while prompts held for its training scope wait for their
        backward: it would not read them, and their gradient would be lost ([`held_prefix`])."""
        scope = self._active_scope
        if torch.is_grad_enabled() and scope is not None and scope.held is not None and scope.held.sources:
            raise RuntimeError("rloo_efficient: a training micro-batch would run stock's forward while prompts held "
                               "across its micro-batches wait for their backward (their gradient would be lost). Set "
                               "held_prefix_budget_gib=0 to forward each micro-batch's prompts itself.")  # fmt: skip

    def _with_images(self, model, packed, images: dict, input_ids, attention_mask, start: int, logits_to_keep: int):
        """
        The packed chunk starting at row `start` of an image batch: the images of each group's first row, once, in the
        order of the groups' nodes, and what the family needs beside them ([`core.layers.vision`]): Qwen's 3-D positions (the
        model's own `get_rope_index` on each group's first row, its completion columns unmasked: the rows of a group
        share their prompt's positions, and completions are text, one position per column), or the tokens' image
        blocks (Gemma). Returns `(packed, image kwargs)`.
        """
        num_images, first = images["num_images"], start + packed.first_rows
        # The images of the groups whose prompt the forward holds (not those a held node holds: encoded before)
        group_images = select_images(images, num_images, start + packed.image_rows, self._vision["pixels"])
        if self._vision["positions"] == "rope_index":  # every group's positions, its images' grids with them
            index = torch.from_numpy(first).to(input_ids.device)
            mask = attention_mask.index_select(0, index)
            mask[:, -logits_to_keep:] = 1
            grid = group_images.get("image_grid_thw")
            if len(packed.image_rows) < len(first) and images.get("image_grid_thw") is not None:
                grid = images["image_grid_thw"].index_select(
                    0, torch.from_numpy(image_indices(num_images, first)).to(input_ids.device))  # fmt: skip
            token_types = images["mm_token_type_ids"].index_select(0, index)
            positions = rope_index_positions(model, input_ids.index_select(0, index), mask,
                                             {"image_grid_thw": grid, "mm_token_type_ids": token_types})  # fmt: skip
            packed = dataclasses.replace(packed, position_ids=packed_positions(positions, packed.group_source_index))
        blocks = image_blocks(model)
        if blocks is not None and group_images:  # an image's tokens attend to each other both ways
            key, image_types, layers = blocks
            ids = token_blocks(images[key][start : start + packed.num_rows], image_types, packed.source_index)
            packed = dataclasses.replace(packed, layout=dataclasses.replace(packed.layout, token_blocks=ids,
                                                                            blocks_on=layers))  # fmt: skip
        return packed, group_images

    def _images_of_rows(self, images: dict, start: int, end: int) -> dict:
        """TRL's image kwargs for the rows `[start, end)` alone, as TRL's forward takes them for a batch of those."""
        rows = np.arange(start, end)
        out = select_images(images, images["num_images"], rows, self._vision["pixels"])
        out["num_images"] = images["num_images"][start:end]
        if images.get("num_tiles") is not None:  # InternVL's: TRL slices the tiles by them
            out["num_tiles"] = images["num_tiles"][start:end]
        for key in TOKEN_TYPE_FIELDS:
            if images.get(key) is not None:
                out[key] = images[key][start:end]
        return out
