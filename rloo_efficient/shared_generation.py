"""
Each prompt once in generation: the shared prefill.

Stock TRL generates from `B` left-padded rows, `k` per prompt, so `generate`'s prefill runs every prompt `k` times.
Here the distinct rows of the padded `(B, W)` prompt batch are found, their first `W - 1` tokens are forwarded once
into a [`~transformers.DynamicCache`], the cache is fanned out to the `B` rows, and `generate` continues from the
full `(B, W)` batch. `generate` then forwards only the last prompt column (as it does when handed a pre-filled cache)
and samples from there: its logits processors, its calls to the random generator and its stopping are those of the
stock call, so the same seed gives the same completions (to floating-point tolerance of the logits).

The prefix forward reproduces what `generate`'s own prefill computes for those `W - 1` columns: the same tokens,
the same 2-D padding mask (dropped when it is all ones, as `generate` drops it) and the same position ids
(`cumsum(mask) - 1`, zero on padding). Causal attention makes a position's keys and values independent of the
columns after it, so leaving out the last column changes nothing before it.
"""

import contextlib
import inspect

import torch
from torch import nn
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .prefix_cache import PrefixCache, prefix_attention
from .prefix_sharing import dropout_reason, is_multimodal


# Cache layers made of one `keys`/`values` pair per row, which a batch index can fan out exactly
_FANNABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def generation_unsupported_reason(model: nn.Module, generation_config: GenerationConfig) -> str | None:
    """Why `generate` cannot start from a shared prefill for `model`, or None when it can."""
    if model.config.is_encoder_decoder:
        return f"{type(model).__name__} is an encoder-decoder model"
    if is_multimodal(model):
        return f"{type(model).__name__} is multimodal; its image features enter in generate's own prefill"
    if generation_config.cache_implementation not in (None, "dynamic"):
        return (
            f"cache_implementation={generation_config.cache_implementation!r}; the shared prefill builds a dynamic cache"
        )
    if generation_config.use_cache is False:
        return "use_cache=False in the generation config"
    if (generation_config.num_beams or 1) != 1 or (generation_config.num_return_sequences or 1) != 1:
        return "beam search or num_return_sequences > 1 rearranges the batch inside generate"
    if not getattr(model, "_supports_default_dynamic_cache", lambda: True)():
        return f"{type(model).__name__} does not use a DynamicCache"
    layer_kinds = {type(layer) for layer in DynamicCache(config=model.config.get_text_config()).layers}
    if not layer_kinds <= set(_FANNABLE_LAYERS):
        names = ", ".join(sorted(kind.__name__ for kind in layer_kinds - set(_FANNABLE_LAYERS)))
        return f"its cache has layers ({names}) that are not plain per-row keys and values"
    return dropout_reason(model)


def unique_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    `(first, inverse)`: `first` (U,) indexes one row per distinct (tokens, mask) row of the batch, in order of first
    appearance, and `inverse` (B,) gives each row's position in `first`.
    """
    index: dict[tuple, int] = {}
    first, inverse = [], []
    for row, (ids, mask) in enumerate(zip(input_ids.tolist(), attention_mask.tolist(), strict=True)):
        key = (tuple(ids), tuple(mask))
        if key not in index:
            index[key] = len(first)
            first.append(row)
        inverse.append(index[key])
    device = input_ids.device
    return torch.tensor(first, dtype=torch.long, device=device), torch.tensor(inverse, dtype=torch.long, device=device)


def generation_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """The position ids `generate` derives from a 2-D mask: `cumsum - 1`, zero on padding."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 0)


@torch.no_grad()
def prefill_prompts(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, first: torch.Tensor):
    """
    Forwards the first `W - 1` columns of the rows `first` of the `(B, W)` prompt batch once, and returns the
    filled [`~transformers.DynamicCache`] (one row per element of `first`).
    """
    prefix_ids = input_ids[first, :-1]
    prefix_mask = attention_mask[first, :-1]
    # generate drops an all-ones mask (letting attention use its causal fast path); so do we, for the same numbers
    full_mask = bool((attention_mask == 1).all())
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    kwargs = {}
    if "logits_to_keep" in inspect.signature(model.get_base_model().forward if hasattr(model, "get_base_model")
                                             else model.forward).parameters:  # fmt: skip
        kwargs["logits_to_keep"] = 1  # the prefix's logits are never read
    model(
        input_ids=prefix_ids,
        attention_mask=None if full_mask else prefix_mask,
        position_ids=generation_position_ids(prefix_mask),
        past_key_values=cache,
        use_cache=True,
        **kwargs,
    )
    return cache


def fan_out(cache: DynamicCache, inverse: torch.Tensor) -> DynamicCache:
    """Gives each of the `B` rows its prompt's keys and values: `cache` rows -> `cache[inverse]`, in place."""
    cache.batch_select_indices(inverse)
    return cache


def generate_with_shared_prefill(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_cache_once: bool = False, **kwargs
):
    """
    `model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)`, with each distinct prompt row
    prefilled once. With `prompt_cache_once` (see [`prefix_cache`]; the caller checks
    [`prefix_attention_unsupported_reason`]) the prompt's keys and values also stay once per distinct row during
    decoding; otherwise they are fanned out to every row. Returns `(output of generate, prompt tokens the shared
    prefill forwarded)`. A batch with nothing to share (all rows distinct, or one-token prompts) goes straight to
    `generate`, and 0 is returned.
    """
    first, inverse = unique_rows(input_ids, attention_mask)
    if input_ids.size(1) < 2 or first.numel() == inverse.numel():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs), 0
    prefilled = prefill_prompts(model, input_ids, attention_mask, first)
    if prompt_cache_once:
        cache = PrefixCache(prefilled, inverse)
        attention = prefix_attention(model, cache)
    else:
        cache, attention = fan_out(prefilled, inverse), contextlib.nullcontext()
    del prefilled  # `cache` alone holds the prompt's keys and values now
    with attention:
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, **kwargs)
    return output, first.numel() * (input_ids.size(1) - 1)
