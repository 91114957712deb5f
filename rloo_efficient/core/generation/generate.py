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
import copy
import warnings

import torch
from torch import nn
from transformers import DynamicCache, GenerationConfig, GenerationMixin
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from ..attention.backend import decoding_with
from ..layers.families import dropout_reason, family_reason, jitter_reason, recurrent_reason, rope_reason
from ..layers.install import install
from ..layers.vision import (
    IMAGE_KWARGS,
    TOKEN_TYPE_FIELDS,
    VISION_FAMILIES,
    image_token_ids,
    select_images,
    tiles_per_row,
)
from ..transformers_compat import CACHE_KWARG
from ..tree.rows import prompt_key
from . import static_buffers, static_decode
from .prompt_cache import PrefixCache, ReadDtypeCache, cache_limit, keep_prompt_once, kv_sources
from .static_checks import static_call_reason, warn_off
from .static_decode import static_sample
from .tree_prefill import (
    generating_model,
    plan_tree_prefill,
    takes_logits_to_keep,
    tree_prefill,
    tree_prefill_reason,
)
from .turn_cache import (
    TurnCaches,
    continuable,
    continue_prefill,
    hold,
    plan_continuation,
    turn_cache,
    windows_over_budget,
)


# Cache layers whose per-row contents an index over the rows fans out exactly (`reorder_cache`): keys and values,
# recurrent and convolution states (Gated DeltaNet, Mamba2, short convolutions; both in one layer for Falcon-H1's
# parallel blocks), and layers that hold nothing (Gemma 4's layers reading another layer's keys and values, MLP layers)
_FANNABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, DummyLayer, LinearAttentionLayer,
                    LinearAttentionAndFullAttentionLayer)  # fmt: skip


def generation_unsupported_reason(model: nn.Module, generation_config: GenerationConfig,
                                  shared_masks: bool = False) -> str | None:  # fmt: skip
    """Why `generate` cannot start from a shared prefill for `model`, or None when it can (a multimodal checkpoint: for
    text-only prompts; prompts with images go to `generate` as they are, see [`text_only`]). `shared_masks`: active
    dropout modules are taken, a prompt prefilled once drawing one mask for its rows
    ([`layers.families.dropout_reason`])."""
    if model.config.is_encoder_decoder:
        return f"{type(model).__name__} is an encoder-decoder model"
    reason = family_reason(model)
    if reason is not None:
        return reason
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
    return (rope_reason(model) or dropout_reason(model, shared_masks) or recurrent_reason(model)
            or jitter_reason(model))  # fmt: skip


def unique_rows(prompt_ids: list[list[int]], images: list | None = None) -> tuple[list[int], list[int]]:
    """
    `(first, inverse)` from the prompts' token lists (and each row's images, or None), on the host: `first` (U,)
    indexes one row per distinct prompt, in order of first appearance, and `inverse` (B,) gives each row's position in
    `first`. Rows are one prompt when their tokens and their images' pixels are the same ([`tree.rows.prompt_key`]).
    """
    index: dict = {}
    first, inverse = [], []
    for row, ids in enumerate(prompt_ids):
        key = tuple(ids) if images is None else prompt_key([ids, images[row] or []])
        if key not in index:
            index[key] = len(first)
            first.append(row)
        inverse.append(index[key])
    return first, inverse


def text_only(images, multimodal_fields: dict) -> bool:
    """Whether TRL's prompts hold no image: no images, and no multimodal field but token types that are all zero."""
    if images is not None and any(images):
        return False
    for key, value in multimodal_fields.items():
        if key not in TOKEN_TYPE_FIELDS:
            return False
        rows = value.tolist() if isinstance(value, torch.Tensor) else value
        if any(any(row) for row in rows):
            return False
    return True


def generation_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """The position ids `generate` derives from a 2-D mask: `cumsum - 1`, zero on padding."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 0)


def image_inputs(model: nn.Module, kwargs: dict, num_images: list[int], first: list[int], width: int,
                 prompt_ids: list[list[int]]) -> tuple[dict, dict]:  # fmt: skip
    """
    Splits `generate`'s multimodal kwargs for a shared prefill of the rows `first`: `(prefill's, the continuation's)`.
    The prefill gets the images of those rows alone, laid out as the processor lays out a batch of them
    ([`layers.vision.select_images`]), and their token types over the first `width - 1` columns; the continuation keeps the
    token types (which `generate` reads for the last column) and no image (its features are in the cache).
    """
    images = {key: kwargs[key] for key in IMAGE_KWARGS if kwargs.get(key) is not None}
    pixels = VISION_FAMILIES[model.config.model_type]["pixels"]
    if pixels == "tiles":  # each row's tiles, from its image tokens (the processor's count is not passed on)
        images["num_tiles"] = row_tiles(model, prompt_ids, len(images["pixel_values"]))
    prefill = select_images(images, num_images, first, pixels)
    index = torch.tensor(first)
    for key in TOKEN_TYPE_FIELDS:
        if kwargs.get(key) is not None:
            prefill[key] = kwargs[key].index_select(0, index.to(kwargs[key].device))[:, : width - 1]
    return prefill, {key: value for key, value in kwargs.items() if key not in IMAGE_KWARGS}


def row_tiles(model: nn.Module, prompt_ids: list[list[int]], tiles: int) -> list[int]:
    """Each row's image tiles (InternVL), from its image tokens on the host: `tiles` in all."""
    placeholders = image_token_ids(model)
    return tiles_per_row([sum(token in placeholders for token in ids) for ids in prompt_ids], tiles)


@torch.no_grad()
def prefill_prompts(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, first: list[int],
                    padded: bool, images: dict | None = None, cache: DynamicCache | None = None):  # fmt: skip
    """
    Forwards the first `W - 1` columns of the rows `first` of the `(B, W)` prompt batch once, and returns the
    filled [`~transformers.DynamicCache`] (one row per element of `first`). `padded`: whether any prompt is shorter
    than `W` (known on the host from the token lists). `images`: those rows' image inputs ([`image_inputs`]), encoded
    here once; positions are then the ones `generate` computes (`_prepare_position_ids_for_generation`: Qwen's 3-D
    ones, which also leave each prompt's rope delta on the model). `cache`: the empty cache to fill (default: the
    model's own kind).
    """
    prefix_ids = input_ids[first, :-1]
    prefix_mask = attention_mask[first, :-1]
    cache = ReadDtypeCache(config=model.config.get_text_config(decoder=True)) if cache is None else cache
    kwargs = dict(images or {})
    if takes_logits_to_keep(model):
        kwargs["logits_to_keep"] = 1  # the prefix's logits are never read
    inner = generating_model(model)  # as generate calls it: in the precision stock's prefill runs (mixed precision)
    if images:
        positions = inner._prepare_position_ids_for_generation(prefix_ids, {
            "input_ids": prefix_ids, "attention_mask": prefix_mask,
            **{key: value for key, value in images.items() if key in ("image_grid_thw", *TOKEN_TYPE_FIELDS)}})  # fmt: skip
    else:
        positions = generation_position_ids(prefix_mask)
    inner(
        input_ids=prefix_ids,
        # generate drops an all-ones mask (letting attention use its causal fast path); so do we, for the same numbers
        attention_mask=prefix_mask if padded else None,
        position_ids=positions,
        use_cache=True,
        **{CACHE_KWARG: cache},
        **kwargs,
    )
    return cache


def fan_out(cache: DynamicCache, inverse: list[int], device) -> DynamicCache:
    """Gives each of the `B` rows its prompt's keys, values and recurrent states: `cache` rows -> `cache[inverse]`, in
    place (`reorder_cache`: transformers' recurrent cache layers select no rows through `batch_select_indices`)."""
    cache.reorder_cache(torch.tensor(inverse, device=device))
    return cache


def generate_with_shared_prefill(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                 prompt_ids: list[list[int]] | None = None, prompt_cache_once: bool | None = False,
                                 tree: bool = True, synced: bool = False, generate=None, images: list | None = None,
                                 turns: TurnCaches | None = None, static: bool | None = False, **kwargs):  # fmt: skip
    """
    `model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)`, with each distinct prompt row
    prefilled once, and with `tree` (text prompts, a model whose cache holds keys and values: [`tree_prefill_reason`])
    the distinct prompts prefilled as their prefix tree ([`generation.tree_prefill`]: a system prompt once per call, no padding).
    `prompt_ids` are the unpadded prompts' token lists behind the left-padded `(B, W)` batch (TRL holds them; read back
    from the batch when not given): the rows are grouped on the host. With `prompt_cache_once` (see [`generation.prompt_cache`];
    the caller checks [`prefix_cache_unsupported_reason`]) the prompt's keys and values also stay once per distinct
    row during decoding (sliding windows included), unless `generate` would drop its cache midway ([`cache_limit`]);
    otherwise they are fanned out to every row (rows all distinct keep their own). `prompt_cache_once=None` chooses
    per call by [`keep_prompt_once`]'s cost model. Returns `(output of generate, prompt tokens the shared prefill
    forwarded)`. A batch with nothing to share (rows all distinct and the tree saving nothing, or one-token prompts)
    goes straight to `generate`, and 0 is returned. With `synced` (sharded parameters that every forward gathers from
    all ranks: DeepSpeed ZeRO-3 without gathering for generation, FSDP), every rank takes the same path, or their
    forwards would
    fall out of step: the prefill runs on all ranks when all of them can run it (one all-reduce per call), even where
    nothing is shared. `generate`: the model's own `generate` (default `model.generate`), for a caller that has put
    this function in its place. `images`: each row's images (TRL's lists, None for a row without), whose inputs are
    in `kwargs` as the processor returned them: rows group by their images too, and each distinct prompt's images go
    through the vision tower once, in the prefill ([`image_inputs`]). `turns`: a tool loop's caches carried between
    its calls ([`generation.turn_cache.TurnCaches`]): rows that extend a row of the previous call continue its keys and values
    (only their new tokens are forwarded), and this call's are held for the next, where the model's cache allows it
    ([`generation.turn_cache.continue_reason`]), for text prompts, not under `synced`. `static`: decode from the
    shared prefill's cache in static buffers ([`generation.static_decode.static_sample`]), the prompt fanned out or
    kept once alike; None: where the step is captured as a graph ([`generation.static_decode.CAPTURE_DEVICES`]).
    """
    generate = generate or model.generate
    if prompt_ids is None:
        prompt_ids = [ids[mask.index(1):] if 1 in mask else [] for ids, mask in
                      zip(input_ids.tolist(), attention_mask.tolist(), strict=True)]  # fmt: skip
    width = input_ids.size(1)
    config = kwargs.get("generation_config") or model.generation_config
    if config.cache_implementation == "dynamic":  # the default's cache, named: generate refuses it beside a cache
        kwargs["generation_config"] = config = copy.copy(config)
        config.cache_implementation = None
    longest = width + config.max_new_tokens if config.max_new_tokens is not None else config.max_length
    decoding = _static_decoding(model, input_ids.device, config, synced, kwargs, static)
    turns, held = _turns_kept(model, turns, prompt_ids, images, synced, width, longest)
    if held is not None and (continuation := plan_continuation(held, prompt_ids)) is not None:
        cache, tokens = continue_prefill(model, held, continuation, prompt_ids, width)
        del held
        _rope_deltas(model, None, len(prompt_ids), input_ids.device)  # not the previous call's rows' (Qwen2-VL)
        output = generate(input_ids=input_ids, attention_mask=attention_mask, **{CACHE_KWARG: cache}, **decoding,
                          **kwargs)  # fmt: skip
        _hold(turns, cache, prompt_ids, output, width, config)
        return output, tokens
    del held
    limit = cache_limit(model)
    # Phi-3's `generate` drops a cache of `limit` positions when its sequence reaches `limit + 1` and forwards every
    # row again: a prefill of a batch that wide would be thrown away
    dropped = limit is not None and width == limit + 1
    first, inverse = unique_rows(prompt_ids, images)
    plan = _tree_plan(model, prompt_ids, first, width, tree, images, synced)
    if synced:  # every rank shares, or none
        share = on_every_rank(width >= 2 and not dropped, input_ids.device)
    else:
        share = width >= 2 and not dropped and (len(first) < len(inverse) or plan is not None)  # rows or openings alike
    if not share:
        return _generate_unshared(model, generate, input_ids, attention_mask, turns, prompt_ids, config, kwargs), 0
    prefill_images = None
    if images is not None:
        prefill_images, kwargs = image_inputs(model, kwargs, [len(row or []) for row in images], first, width,
                                              prompt_ids)  # fmt: skip
    prefilled, tokens = _prefill(model, input_ids, attention_mask, prompt_ids, first, plan, prefill_images, turns)
    cache, attention = _decoding_cache(model, prefilled, prompt_ids, first, inverse, width, prompt_cache_once,
                                       bool(decoding), limit is None or longest <= limit, input_ids.device)  # fmt: skip
    del prefilled  # `cache` alone holds the prompt's keys and values now
    _rope_deltas(model, inverse if prefill_images else None, len(prompt_ids), input_ids.device)
    with attention:
        output = generate(input_ids=input_ids, attention_mask=attention_mask, **{CACHE_KWARG: cache}, **decoding,
                          **kwargs)  # fmt: skip
    _hold(turns, cache, prompt_ids, output, width, config)
    return output, tokens


def _turns_kept(model: nn.Module, turns: TurnCaches | None, prompt_ids: list, images: list | None, synced: bool,
                width: int, longest: int) -> tuple:  # fmt: skip
    """`(turns, held)`: a tool loop's caches and the previous call's keys and values they held (taken from `turns`:
    released once copied from), or `(None, None)` where this call neither continues nor holds any (images, `synced`,
    a cache that does not continue, or windows whose whole histories pass the budget: counted in `over_budget`)."""
    held = turns.take() if turns is not None else None  # the previous call's: released once copied from
    if turns is not None and (images is not None or synced or not continuable(model, width, longest)):
        return None, None
    if turns is not None and windows_over_budget(model, len(prompt_ids), longest, turns.budget):
        turns.over_budget += 1  # its windows' whole histories would not be held: the model's own windowed cache
        return None, None
    return turns, held


def _tree_plan(model: nn.Module, prompt_ids: list, first: list[int], width: int, tree: bool, images: list | None,
               synced: bool):  # fmt: skip
    """The distinct prompts' prefix tree ([`plan_tree_prefill`]: a system prompt once per call, no padding), or None:
    text only, and not where every forward gathers sharded parameters (`synced`: a rank's decoder-only forward and
    another's padded one would gather different modules)."""
    if tree and images is None and not synced and width >= 2 and tree_prefill_reason(model) is None:
        return plan_tree_prefill(prompt_ids, first, width)
    return None


def _generate_unshared(model: nn.Module, generate, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       turns: TurnCaches | None, prompt_ids: list, config: GenerationConfig, kwargs: dict):  # fmt: skip
    """`generate`'s output for a batch with nothing to share: stock's call, into a cache held for a tool loop's next
    call where `turns` are kept."""
    if turns is None:
        return generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    cache = turn_cache(model)  # generate fills it: then it is held
    output = generate(input_ids=input_ids, attention_mask=attention_mask, **{CACHE_KWARG: cache}, **kwargs)
    _hold(turns, cache, prompt_ids, output, input_ids.size(1), config)
    return output


def _prefill(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_ids: list,
             first: list[int], plan, images: dict | None, turns: TurnCaches | None) -> tuple:  # fmt: skip
    """`(prefilled, tokens)`: the distinct prompts' cache, prefilled as their prefix tree (`plan`) or as the rows
    `first` ([`prefill_prompts`], with their image inputs `images`), into a cache then held where `turns` are kept
    (windows kept whole), and the prompt tokens it forwarded."""
    width = input_ids.size(1)
    empty = turn_cache(model) if turns is not None else None  # held: windows kept whole
    if plan is not None:
        return tree_prefill(model, plan, empty), plan.tree.num_tokens
    padded = any(len(ids) < width for ids in prompt_ids)
    return prefill_prompts(model, input_ids, attention_mask, first, padded, images, empty), len(first) * (width - 1)


def on_every_rank(value: bool, device) -> bool:
    """Whether `value` holds on every rank (one all-reduce on `device`)."""
    import torch.distributed as dist

    every = torch.tensor([int(value)], device=device)
    dist.all_reduce(every, op=dist.ReduceOp.MIN)
    return bool(every.item())


def _static_decoding(model: nn.Module, device, config: GenerationConfig, synced: bool, kwargs: dict,
                     static: bool | None) -> dict:  # fmt: skip
    """`generate`'s arguments decoding from static buffers ([`static_decode.static_sample`]) where `static` asks for it
    (None: where steps are captured, the model on one device: a capture runs on one stream) and the call allows it
    (else one warning naming why not); `{}` for `generate`'s own loop."""
    if static is None:
        static = static_decode.captures(model, device)
    if not static:
        return {}
    inner = generating_model(model)
    own = getattr(type(inner), "generate", None) is not GenerationMixin.generate
    off = f"{type(inner).__name__} has its own generate" if own else static_call_reason(config, synced, kwargs)
    if off is not None:
        warn_off(off)
        return {}
    return {"custom_generate": static_sample}


def _decoding_cache(model: nn.Module, prefilled, prompt_ids: list, first, inverse, width: int,
                    prompt_cache_once: bool | None, static: bool, within_limit: bool, device) -> tuple:  # fmt: skip
    """`(cache, attention)`: the cache `generate` decodes from, built from the distinct prompts' `prefilled` cache,
    and the context its calls run in. Every row its own prompt: the rows' cache itself. The prompt kept once
    ([`PrefixCache`], read by our attention): where asked or (`prompt_cache_once=None`) where the cost model finds it
    reads enough fewer bytes ([`keep_prompt_once`]; replayed `static` steps break even sooner), and `generate` keeps
    its cache to the end (`within_limit`). Otherwise fanned out to every row (for `static` decoding, into its
    buffers)."""
    sources = kv_sources(model.config.get_text_config(decoder=True))
    if prompt_cache_once is None and len(first) < len(inverse):
        replayed = static and static_decode.replays_kept_once(model, PrefixCache.layer_types(prefilled, sources),
                                                              device)  # fmt: skip
        prompt_cache_once = keep_prompt_once(prefilled, len(inverse), device, replayed)
    if len(first) == len(inverse):  # every row its own prompt (a tool turn's histories): the cache is the rows'
        return prefilled, contextlib.nullcontext()
    if prompt_cache_once and within_limit:
        install(model)
        cache = PrefixCache(prefilled, inverse, [len(prompt_ids[row]) - 1 for row in first], width - 1, sources)
        return cache, decoding_with(cache)
    if prompt_cache_once:  # a constant message: Python shows it once
        warnings.warn("rloo_efficient: the prompt's KV cache is fanned out to every completion for such batches: "
                      "generate drops its cache past the model's original context (Phi-3).",
                      stacklevel=3)  # fmt: skip
    fan = static_buffers.defer_fan_out if static else fan_out  # static decoding: gathered into its buffers
    return fan(prefilled, inverse, device), contextlib.nullcontext()


def _hold(turns, cache, prompt_ids, output, width: int, config: GenerationConfig) -> None:
    """Keeps the keys and values `cache` holds after `generate` for the next call of a tool loop (`turns`, or None)."""
    if turns is None:
        return
    eos = config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    turns.keep(hold(cache, prompt_ids, sequences, width, eos))


def _rope_deltas(model: nn.Module, inverse: list[int] | None, rows: int, device) -> None:
    """
    Qwen2-VL's family continues a generation from a cache with the 3-D rope offsets its last uncached call stored on
    the model (`rope_deltas`, one per row). The first step of a text-only `generate` stores zeros, so a generate that
    starts from our prefilled cache gets the same zeros, for its own rows (not a stale earlier call's). With images
    (`inverse` given), the prefill stored each distinct prompt's offset: each row gets its prompt's.
    """
    inner = generating_model(model)
    for module in (inner, getattr(inner, "model", None)):
        if module is not None and hasattr(module, "rope_deltas"):
            if inverse is None:
                module.rope_deltas = torch.zeros(rows, 1, dtype=torch.long, device=device)
            else:
                module.rope_deltas = module.rope_deltas[torch.tensor(inverse, device=module.rope_deltas.device)]
