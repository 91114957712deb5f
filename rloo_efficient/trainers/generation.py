"""
Generation's glue ([`GroupSharingMixin`]'s, kept apart): each distinct prompt tokenized once, and while TRL's
`_generate_single_turn` runs, the model's `generate` prefilling each distinct prompt once ([`core.generation.generate`]),
its images encoded once; vLLM and continuous batching go to TRL untouched.
"""

import contextlib

import numpy as np
import torch

from ..core.generation.generate import (
    TOKEN_TYPE_FIELDS,
    generate_with_shared_prefill,
    on_every_rank,
    row_tiles,
    text_only,
)
from ..core.layers.vision import IMAGE_KWARGS, layout_reason
from ..core.tree.rows import prompt_key


class SharedGenerationMixin:
    """TRL methods wrapped (each calls `super()`): `_tokenize_prompts` (each distinct prompt, with its environment,
    tokenized once; its rows get copies) and `_generate_single_turn` (the model's `generate` prefills each distinct
    prompt once while it runs)."""

    def _tokenize_prompts(self, prompts: list):
        if not self._settings.share_prompt_prefix or self._is_vlm:
            return super()._tokenize_prompts(prompts)
        # With environments (GRPO), each prompt is rendered with its environment's tools: part of the key
        environments = getattr(self, "_batch_environments", None)
        if getattr(self, "environment_factories", None) is None:
            environments = None
        keys = [(None if environments is None else environments[i], prompt_key(p)) for i, p in enumerate(prompts)]
        first: dict[tuple, int] = {}
        for row, key in enumerate(keys):
            first.setdefault(key, row)
        if len(first) == len(prompts):
            return super()._tokenize_prompts(prompts)
        rows = list(first.values())
        if environments is not None:
            self._batch_environments = [environments[row] for row in rows]
        try:
            unique_ids, images, fields = super()._tokenize_prompts([prompts[row] for row in rows])
        finally:
            if environments is not None:
                self._batch_environments = environments
        if fields:  # per-prompt fields would need the same fan-out: tokenize every row, as stock does
            return super()._tokenize_prompts(prompts)
        position = {key: index for index, key in enumerate(first)}
        # Each row gets its own copy of its prompt's tokens (a list later code may edit in place)
        return [list(unique_ids[position[key]]) for key in keys], images, fields

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        if not self._share_prefill:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        if "generate" in vars(self._generating_model()):
            # A `generate` set on the model itself (a test's `patch.object`, a tracing wrapper, another library's): it
            # is called as stock calls it, with stock's arguments
            self._warn_once("rloo_efficient: the shared generation prefill is off for such calls, using stock TRL's "
                            "generate: the model's generate is replaced on the model object")  # fmt: skip
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        with_images = not text_only(images, multimodal_fields)
        reason = self._image_prefill_reason(prompt_ids, images, multimodal_fields) if with_images else None
        # Where every forward gathers parameters from all ranks, they all take stock's generate or none does
        if not self._all_ranks_can(reason is None):
            self._fall_back(reason or "another process's prompts cannot be prefilled once", permanent=False)
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        with self._shared_prefill(prompt_ids, images if with_images else None):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)

    def _generating_model(self):
        """The module whose `generate` TRL's generation calls: what `unwrap_model_for_generation` yields, or under
        `torch_compile` the module inside the compiled wrapper (whose `generate` is that module's: an attribute set on
        the wrapper lands there, and must be found and removed there)."""
        return self.accelerator.unwrap_model(self.model_wrapped, keep_torch_compile=False)

    def _image_prefill_reason(self, prompt_ids, images, multimodal_fields) -> str | None:
        """Why prompts with images cannot be prefilled once per group, or None when they can."""
        if self._vision_reason is not None:
            return self._vision_reason
        unknown = set(multimodal_fields) - set(IMAGE_KWARGS) - set(TOKEN_TYPE_FIELDS)
        if unknown:
            return f"the processor returns fields the shared prefill does not split ({', '.join(sorted(unknown))})"
        if any(ids and ids[-1] in self._image_tokens for ids in prompt_ids):
            return "a prompt ends with an image's token"  # the prefill stops one token short of it
        if "pixel_values" in multimodal_fields:
            fields = multimodal_fields
            if self._vision["pixels"] == "tiles":  # InternVL: each row's tiles, from its image tokens
                model = self._unwrapped()
                fields = {**fields, "num_tiles": row_tiles(model, prompt_ids, len(fields["pixel_values"]))}
            return layout_reason(fields, [len(row or []) for row in images or [[]] * len(prompt_ids)],
                                 self._vision["pixels"])  # fmt: skip
        return None

    def _all_ranks_can(self, can: bool) -> bool:
        """`can`, agreed by every process (one all-reduce) where each forward gathers parameters from all of them."""
        if not self._forwards_are_collective(self.accelerator.unwrap_model(self.model_wrapped)):
            return can
        return on_every_rank(can, self.accelerator.device)

    def _all_ranks_agree(self, values) -> bool:
        """Whether every process has the same integer `values` (a 1-D array of one length on all of them), by one
        all-reduce where each forward gathers parameters from all of them (else True)."""
        if not self._forwards_are_collective(self._unwrapped()):
            return True
        import torch.distributed as dist

        values = np.asarray(values, dtype=np.int64)
        both = torch.as_tensor(np.concatenate([values, -values]), device=self.accelerator.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        highest, lowest = both.chunk(2)
        return bool(torch.equal(highest, -lowest))

    @contextlib.contextmanager
    def _shared_prefill(self, prompt_ids: list[list[int]], images: list | None = None):
        """
        While TRL's generation runs (its regular transformers path: vLLM and continuous batching never call `generate`),
        the model's `generate` is [`generate_with_shared_prefill`] for these prompts' token lists (and their images):
        each distinct prompt prefilled once, its images encoded once, decoding continued from that cache, sampling
        exactly as the stock call.
        """
        model = self._generating_model()
        stock_generate = model.generate

        def generate(input_ids, attention_mask, **kwargs):
            output, tokens = generate_with_shared_prefill(
                model, input_ids, attention_mask, prompt_ids=prompt_ids, prompt_cache_once=self._prompt_cache_once,
                tree=self._settings.share_prefill_tree, synced=self._forwards_are_collective(model),
                generate=stock_generate, images=images, turns=self._turns, static=self._settings.static_decoding,
                **kwargs,
            )  # fmt: skip
            self.shared_prefill_tokens += tokens
            return output

        model.generate = generate  # on the instance: found before the class's method
        try:
            yield
        finally:
            if vars(model).get("generate") is generate:  # ours, unless the block replaced it: the class's again
                del model.generate

    def _forwards_are_collective(self, model) -> bool:
        """Whether every forward gathers parameters from all ranks (so that ranks must run the same forwards)."""
        if self.accelerator.num_processes == 1:
            return False
        from torch.distributed.fsdp import FSDPModule
        from transformers.distributed.fsdp import is_fsdp_managed_module
        from transformers.integrations import is_deepspeed_zero3_enabled

        # As transformers' generate decides to keep ranks in step (`synced_gpus`), and FSDP2 applied by accelerate
        return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model) or isinstance(model, FSDPModule)
