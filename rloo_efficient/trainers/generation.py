"""
Generation's trainer side ([`SharedGeneration`]): each distinct prompt tokenized once ([`distinct_prompts`]), and
while TRL's `_generate_single_turn` runs, the model's `generate` prefilling each distinct prompt once
([`core.generation.generate`]), its images encoded once; a tool loop's caches held from turn to turn. vLLM and
continuous batching go to TRL untouched (the trainer's backend: [`core.generation.backends`]).
"""

import contextlib
from collections.abc import Callable

from ..core.generation.backends import GenerationBackend
from ..core.generation.generate import generate_with_shared_prefill, row_tiles, text_only
from ..core.generation.turn_cache import TurnCaches
from ..core.layers.vision import IMAGE_KWARGS, TOKEN_TYPE_FIELDS, ModelVision, layout_reason
from ..core.tree.rows import prompt_key
from .ranks import Ranks


def distinct_prompts(prompts: list, environments: list | None) -> tuple[list[int], list[int]]:
    """`(first, index)`: the first row of each distinct prompt (with its environment, where given: part of the key),
    and each row's distinct prompt."""
    keys = [(None if environments is None else environments[i], prompt_key(p)) for i, p in enumerate(prompts)]
    position: dict[tuple, int] = {}
    first = []
    for row, key in enumerate(keys):
        if key not in position:
            position[key] = len(first)
            first.append(row)
    return first, [position[key] for key in keys]


def tokenized_once(tokenize: Callable, prompts: list, environments: list | None):
    """TRL's `_tokenize_prompts` output for `prompts` with each distinct prompt tokenized once: `tokenize(rows)`, or
    with `environments` (each row's, part of the key) `tokenize(rows, rows_environments)`. Each row gets its own copy
    of its prompt's tokens (a list later code may edit in place). Every row tokenized where all are distinct, or where
    the processor returns per-prompt fields (they would need the same fan-out)."""
    every_row = (prompts,) if environments is None else (prompts, environments)
    first, index = distinct_prompts(prompts, environments)
    if len(first) == len(prompts):
        return tokenize(*every_row)
    distinct = [prompts[row] for row in first]
    unique_ids, images, fields = tokenize(distinct) if environments is None else tokenize(
        distinct, [environments[row] for row in first])  # fmt: skip
    if fields:
        return tokenize(*every_row)
    return [list(unique_ids[prompt]) for prompt in index], images, fields


class SharedGeneration:
    """
    The shared prefill of one trainer: `ranks` (where every process must take it or none), the policy's `vision`,
    `counts` (`shared_prefill_tokens` counted there); its decisions: `cache_once` (the prompt's cache kept once while
    decoding: True, False, or None: by its cost), `tree` (the prompts' prefix tree), `backend` (the way generation
    runs: [`core.generation.backends`]), `turn_budget` (a tool loop's held caches: bytes, or None), `fall_back(reason)`
    (says once why a call runs stock's generate) and `warn(message)` (says a message once).
    """

    def __init__(self, ranks: Ranks, vision: ModelVision, counts, *, cache_once: bool | None, tree: bool,
                 backend: GenerationBackend, turn_budget: int | None, fall_back: Callable[[str], None],
                 warn: Callable[[str], None]):  # fmt: skip
        self.ranks, self.vision, self.counts = ranks, vision, counts
        self.cache_once, self.tree, self.backend, self.turn_budget = cache_once, tree, backend, turn_budget
        self.fall_back, self.warn = fall_back, warn
        self.turns: TurnCaches | None = None  # a tool loop's held caches, while TRL's `_generate` runs

    @contextlib.contextmanager
    def tool_loop(self):
        """While TRL's `_generate` runs its tool loop: each turn's KV caches held for the rows' next turn, within the
        budget, and all of them released when it ends."""
        budget = self.turn_budget
        self.turns = TurnCaches(budget) if budget is not None else None
        try:
            yield
        finally:
            if self.turns is not None and self.turns.over_budget:
                self.warn("rloo_efficient: a tool turn's KV caches were not held across the tool call: they would "
                          "take more than tool_cache_budget_gib; the next turn prefilled its rows' histories "
                          "instead")  # fmt: skip
            self.turns = None  # every held cache released

    def prefill(self, model, prompt_ids: list[list[int]], images, multimodal_fields):
        """A context in which `model`'s `generate` (the module whose `generate` TRL calls) prefills each distinct prompt
        once ([`prefilling`]); None where this call cannot (then stock's `generate` runs, and the reason is said
        once), agreed by every process where forwards are collective."""
        if "generate" in vars(model):
            # A `generate` set on the model itself (a test's `patch.object`, a tracing wrapper, another library's): it
            # is called as stock calls it, with stock's arguments
            self.fall_back("the model's generate is replaced on the model object")
            return None
        with_images = not text_only(images, multimodal_fields)
        reason = self._image_reason(model, prompt_ids, images, multimodal_fields) if with_images else None
        # Where every forward gathers parameters from all ranks, they all take stock's generate or none does
        if not self.ranks.can(reason is None):
            self.fall_back(reason or "another process's prompts cannot be prefilled once")
            return None
        return self.prefilling(model, prompt_ids, images if with_images else None)

    def _image_reason(self, model, prompt_ids, images, multimodal_fields) -> str | None:
        """Why prompts with images cannot be prefilled once per group, or None when they can."""
        if self.vision.reason is not None:
            return self.vision.reason
        unknown = set(multimodal_fields) - set(IMAGE_KWARGS) - set(TOKEN_TYPE_FIELDS)
        if unknown:
            return f"the processor returns fields the shared prefill does not split ({', '.join(sorted(unknown))})"
        if any(ids and ids[-1] in self.vision.image_tokens for ids in prompt_ids):
            return "a prompt ends with an image's token"  # the prefill stops one token short of it
        if "pixel_values" in multimodal_fields:
            fields, pixels = multimodal_fields, self.vision.family["pixels"]
            if pixels == "tiles":  # InternVL: each row's tiles, from its image tokens
                fields = {**fields, "num_tiles": row_tiles(model, prompt_ids, len(fields["pixel_values"]))}
            return layout_reason(fields, [len(row or []) for row in images or [[]] * len(prompt_ids)], pixels)
        return None

    @contextlib.contextmanager
    def prefilling(self, model, prompt_ids: list[list[int]], images: list | None = None):
        """
        While TRL's generation runs (through `generate`: the backends whose calls we prefill),
        `model`'s `generate` is [`generate_with_shared_prefill`] for these prompts' token lists (and their images):
        each distinct prompt prefilled once, its images encoded once, decoding continued from that cache, sampling
        exactly as the stock call.
        """
        stock_generate = model.generate
        counts = self.counts

        def generate(input_ids, attention_mask, **kwargs):
            output, tokens = generate_with_shared_prefill(
                model, input_ids, attention_mask, prompt_ids=prompt_ids, prompt_cache_once=self.cache_once,
                tree=self.tree, synced=self.ranks.collective(model), generate=stock_generate, images=images,
                turns=self.turns, static=self.backend.static,
                **kwargs,
            )  # fmt: skip
            counts.shared_prefill_tokens += tokens
            return output

        model.generate = generate  # on the instance: found before the class's method
        try:
            yield
        finally:
            if vars(model).get("generate") is generate:  # ours, unless the block replaced it: the class's again
                del model.generate
