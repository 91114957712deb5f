"""
Decoding from static buffers: `generate`'s decoding loop with every step's shapes and addresses fixed.

`generate`'s loop grows each layer's keys and values by a concatenation every step, builds the step's attention mask
from a 2-D mask one column longer each time, and reads a device value back every step to decide whether to stop: on
a GPU, allocations and a stall per token, and nothing a captured graph could replay. [`static_sample`] is that loop
as `generate`'s `custom_generate` (so the logits processors and stopping criteria are the ones `generate` prepared
from the generation config, unchanged), over buffers sized for the call once, after the shared prefill:

- each layer's keys and values in `(B, Hkv, W - 1 + N, D)` buffers (the prefilled `W - 1` prompt columns copied in),
  each step's written in place at a device index ([`StaticLayer`]); with the prompt kept once per group
  ([`generation.prompt_cache.PrefixCache`]), the rows' own `N` positions alone, masked where not written yet
  ([`StaticPrefixLayer`]);
- the attention mask a `(B, 1, 1, W - 1 + N)` buffer, its column opened in place each step, handed to the model as a
  prepared 4-D mask (transformers uses such a mask as it is); the position ids (the multimodal rope's `(3 or 4, B,
  1)` alike) and the step's input token likewise; image prompts' features and pixels are inputs `generate` hands the
  prefill alone, and their token types grow by zeros (the step's a buffer: the prompt's last, then zero);
- the sequences a `(B, W + N)` buffer, the processors reading a view of its first columns as `generate`'s growing
  `input_ids`.

A step reads nothing back from the device: whether every row has finished is written to a device flag per step and
read every [`STOP_CHECK_EVERY`] steps. The steps run past the one where every row finished are undone: their tokens
cut from the output, and the random generator put back to its state after that step, so the next draw anyone makes
is the one it would have been after stock's `generate` (which stops right there).

Equal to `generate`'s loop up to the attention's sums over masked columns (a masked column adds an exact zero: the
same terms, in a kernel's order for a longer row): the same logits to floating-point rounding, the same samples.
On CUDA the step is captured once per call as a graph and replayed ([`GraphedStep`]). Where a call cannot be exact
this way (a window over a prompt kept once, a model preparing its own decoding inputs or taking per-step ones, an
attention implementation that takes no prepared mask, a streamer, attentions returned), it runs `generate`'s own
loop, with one warning naming why.
"""

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin


try:  # the image inputs `generate`'s own input preparation passes to the prefill alone (transformers 5)
    from transformers.generation.utils import MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL
except ImportError:  # pragma: no cover - older transformers: every such input is a per-step one
    MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL = ()

from ..graphs import REPLAY_ATOL, REPLAY_RTOL, capture, warm_up
from ..once import WarnOnce
from ..transformers_compat import CACHE_KWARG
from .prompt_cache import PrefixCache, PrefixLayer, mask_dtype


# How often (in steps) the loop reads back whether every row has finished: each read waits for the device to catch
# up, each step past the finish is a forward spent for nothing. Not yet measured on a GPU (issue 41): 8 steps cost at
# most 7 wasted forwards per call against one stall per token
STOP_CHECK_EVERY = 8
# Attention implementations that take a prepared 4-D mask as it is: boolean (True attends) for SDPA, additive for
# eager. Flash attention and the Hub's kernels read a 2-D mask or none
_MASKS = {"sdpa": "bool", "eager": "additive"}
# What `generate` hands its decoding loop that one static step reproduces (the rest: another loop's, or a model's own)
_STEP_INPUTS = {"attention_mask", "position_ids", "logits_to_keep", CACHE_KWARG, "use_cache",
                *MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL}
# Causal LMs whose own `prepare_inputs_for_generation` is `generate`'s until a sequence first reaches the config's
# `original_max_position_embeddings` + 1, where it drops the cache (to forward every row again with LongRoPE's long
# factors): Phi-3's family. Within that context, static decoding is exact
_OWN_INPUTS_PAST_CONTEXT = ("Phi3ForCausalLM",)
# Causal LMs whose own `prepare_inputs_for_generation` is `generate`'s but for `logits_to_keep`, which a step of one
# token does not change (Falcon-H1's, from its config)
_OWN_LOGITS_TO_KEEP = ("FalconH1ForCausalLM",)
# Models whose own `prepare_inputs_for_generation` is `generate`'s but for image token types it hands the first step
# alone (the whole sequence's, for the bidirectional mask among an image's tokens, which a text token's query does not
# read: the step's query is the prompt's last token, never an image's, then generated text) and drops after it: the
# step's prepared mask is the same, and these inputs are not passed
_TYPES_AT_THE_FIRST_STEP = {"Gemma3ForConditionalGeneration": ("token_type_ids",),
                            "Gemma4ForConditionalGeneration": ("mm_token_type_ids", "per_layer_inputs")}
# Per-step inputs `generate` grows by a column of zeros each step (`_update_model_kwargs_for_generation`): a step's
# value is the prompt's last column at the first step, zeros after it
_ZERO_GROWN = ("mm_token_type_ids",)
_warnings = WarnOnce()  # static decoding's reasons, once per process
# Cache layers a static buffer holds: keys and values, all of them or a sliding window's last ones
_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
# Cache layers kept as they are: recurrent and convolution states of a fixed size, which transformers updates in
# place (for graphs' static addresses)
_FIXED = (LinearAttentionLayer,)
# Cache layers that hold nothing: a layer reading another layer's keys and values (Gemma 4's shared layers: they read
# them from the source layer's update in the same forward, our buffers)
_EMPTY = (DummyLayer,)
# Cache layers holding a recurrent mixer's states and an attention's keys and values (Falcon-H1's)
_HYBRID = (LinearAttentionAndFullAttentionLayer,)


class StaticLayer(DynamicLayer):
    """
    A layer's keys and values in buffers of every position the call will forward, `(B, Hkv, L, D)`: each step's
    written in place at `column` (a `(1,)` device index the decoding loop advances), the whole buffers returned (the
    mask hides the columns not written yet). A `DynamicLayer` to what reads a cache's layers (`keys`, `values`).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor, length: list[int],
                 sliding_window: int | None = None, whole: bool = True):  # fmt: skip
        super().__init__()
        self.keys, self.values, self.column, self._length = keys, values, column, length
        self.sliding_window = sliding_window  # a sliding-window layer's: its mask hides the columns behind it
        # Where the prefill kept only the window's last keys, what a tool loop would hold is not the whole history
        self.window = None if whole else sliding_window
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # (in the buffers' dtype: a cache filled narrower than the model hands keys over, [`ReadDtypeCache`])
        self.keys.index_copy_(2, self.column, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, self.column, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length[0]  # the positions written so far, kept on the host by the loop

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("A static decoding cache is built for one generate call and is not cropped.")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("A static decoding cache's rows are fixed when it is built.")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("A static decoding cache's rows are fixed when it is built.")


class StaticHybridLayer(StaticLayer, LinearAttentionLayer):
    """
    A layer holding both a recurrent mixer's states and an attention's keys and values (Falcon-H1's, transformers'
    `LinearAttentionAndFullAttentionLayer`): the states as they were (transformers updates them in place), the keys and
    values a [`StaticLayer`]'s.
    """

    @classmethod
    def of(cls, layer: LinearAttentionLayer, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor,
           length: list[int], window: int | None, whole: bool) -> "StaticHybridLayer":  # fmt: skip
        static = cls.__new__(cls)
        vars(static).update(vars(layer))  # the states and their bookkeeping
        static.keys, static.values, static.column, static._length = keys, values, column, length
        static.sliding_window, static.window = window, None if whole else window
        static.dtype, static.device, static.is_initialized = keys.dtype, keys.device, True
        return static


class StaticPrefixLayer(PrefixLayer):
    """
    A [`PrefixLayer`] (the prompt once per group) whose rows' own keys and values are `(B, Hkv, C, D)` buffers of the
    call's `C` decoded positions, written in place at `column` (sized at the first step, by the keys the module hands
    over); `own_bias` `(1, 1, 1, C)`, shared by the layers, masks the positions not written yet.
    """

    def __init__(self, layer: PrefixLayer, rows: int, columns: int, column: torch.Tensor, own_bias: torch.Tensor,
                 length: list[int]):  # fmt: skip
        super().__init__(layer.prefix_keys, layer.prefix_values, layer.prefix_columns, layer.prefix_bias)
        self.rows, self.columns, self.column, self.own_bias, self._length = rows, columns, column, own_bias, length

    own_length = property(lambda self: self._length[0] - self.prefix_columns,  # the loop's count
                          lambda self, value: None)  # fmt: skip

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.keys is None:  # the first step (eager: before any capture)
            self.keys = key_states.new_zeros(self.rows, key_states.shape[1], self.columns, key_states.shape[-1])
            self.values = value_states.new_zeros(self.rows, value_states.shape[1], self.columns,
                                                 value_states.shape[-1])  # fmt: skip
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values


def static_call_reason(generation_config, synced: bool, kwargs: dict) -> str | None:
    """
    Why a `generate` call with these keyword arguments must not be handed [`static_sample`], or None: `generate` gives
    a `custom_generate` callable neither `synced_gpus` nor a streamer (only the parameters its signature adds to
    `_sample`'s), and runs it in place of every decoding mode. `synced`: every forward gathers parameters from all
    ranks (ZeRO-3, FSDP), so that ranks must decode in step.
    """
    if synced or kwargs.get("synced_gpus"):
        return "ranks decode in step (synced_gpus: ZeRO-3 or FSDP)"
    if kwargs.get("streamer") is not None:
        return "a streamer reads every token on the host"
    if kwargs.get("assistant_model") is not None or kwargs.get("custom_generate") is not None:
        return "generate decodes another way (an assistant model or a custom_generate)"
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH):
        return f"generation mode {mode.name.lower()}"
    return None


def static_decode_reason(model: nn.Module, input_ids: torch.Tensor, stopping_criteria, generation_config,
                         model_kwargs: dict) -> str | None:  # fmt: skip
    """Why [`static_sample`] would not reproduce `generate`'s loop for this call, or None."""
    if dropout_active(model):
        return "dropout is active (share_under_dropout): each step draws its masks, which a replay would not check"
    if generation_config.return_dict_in_generate and (generation_config.output_attentions or
                                                      generation_config.output_hidden_states):  # fmt: skip
        return "generate returns attentions or hidden states"
    others = sorted({type(criterion).__name__ for criterion in stopping_criteria
                     if not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria))})  # fmt: skip
    if others:
        return f"stopping criteria other than length and EOS ({', '.join(others)})"
    owner = _inputs_owner(model)
    if extra := sorted(set(model_kwargs) - _STEP_INPUTS - {*_ZERO_GROWN, *_TYPES_AT_THE_FIRST_STEP.get(owner, ())}):
        return f"the model takes per-step inputs ({', '.join(extra)})"
    if owner in _OWN_INPUTS_PAST_CONTEXT:
        limit = getattr(model.config, "original_max_position_embeddings", None)
        if limit is not None and (stopping_criteria.max_length or limit + 1) > limit:
            return (f"{type(model).__name__} drops its cache when a sequence passes its original context ({limit} "
                    f"positions)")  # fmt: skip
    elif owner not in (*_TYPES_AT_THE_FIRST_STEP, *_OWN_LOGITS_TO_KEEP) and (
            type(model).prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation):
        return f"{type(model).__name__} prepares its own decoding inputs (prepare_inputs_for_generation)"
    implementation = model.config._attn_implementation
    if implementation not in _MASKS:
        return f"attn_implementation={implementation!r} takes no prepared 4-D mask"
    cache = model_kwargs.get(CACHE_KWARG)
    width = input_ids.shape[1]
    if not isinstance(cache, Cache) or not cache.layers:
        return "generate prefills its own cache"
    if isinstance(cache, PrefixCache):  # the prompt kept once per group: the rows' own keys in static buffers
        if reason := kept_once_reason(model, [type(layer) for layer in cache.layers]):
            return reason
        if any(layer.own_length or layer.prefix_columns != width - 1 for layer in cache.layers
               if type(layer) is PrefixLayer):  # fmt: skip
            return "the cache does not hold every prompt column but the last"
        return None
    kinds = sorted({type(layer).__name__ for layer in cache.layers
                    if type(layer) not in (*_LAYERS, *_FIXED, *_EMPTY, *_HYBRID)})  # fmt: skip
    if kinds:
        return f"its cache has layers other than keys and values ({', '.join(kinds)})"
    if any(window is not None for window in layer_windows(model)):
        types = set(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or [])
        if not types <= {"full_attention", "sliding_attention"}:
            return f"its layers' attention types ({', '.join(sorted(types))}) are not full and sliding alone"
    if any(layer.keys is None or _filled(layer) != width - 1 for layer in cache.layers
           if type(layer) in (*_LAYERS, *_HYBRID)):  # fmt: skip
        return "the cache does not hold every prompt column but the last"
    if model_kwargs.get("position_ids") is None:
        return "generate passed no position ids"
    return None


def dropout_active(model: nn.Module) -> bool:
    """Whether a forward of `model` now draws dropout masks (a dropout module with p > 0, in training mode)."""
    return model.training and any(isinstance(module, nn.Dropout) and module.p > 0 for module in model.modules())


def kept_once_reason(model: nn.Module, layer_types: list[type]) -> str | None:
    """Why a cache keeping the prompt once with layers of `layer_types` cannot be decoded from static buffers, or
    None."""
    kinds = sorted({kind.__name__ for kind in layer_types if kind not in (PrefixLayer, *_FIXED)})
    if kinds:
        return f"its cache kept once has layers other than keys and values ({', '.join(kinds)})"
    if any(window is not None for window in layer_windows(model)):  # a tool loop's cache keeps whole windows
        return "a sliding window over the prompt kept once is masked from the host's count of positions"
    return None


def replays_kept_once(model: nn.Module, layer_types: list[type], device: torch.device) -> bool:
    """Whether a call handed [`static_sample`] on `device` would replay captured steps with the prompt kept once in a
    cache of `layer_types` (what the cost model needs before the cache is built): the steps captured there, the
    model's attention taking a prepared mask, no capture of the model's failed, and the cache static decoding can
    hold. A call refused later for its own inputs ([`static_decode_reason`]) runs `generate`'s loop instead."""
    return (device.type in CAPTURE_DEVICES and model.config._attn_implementation in _MASKS
            and getattr(model, "_rloo_graph_failed", None) is None and not dropout_active(model)
            and kept_once_reason(model, layer_types) is None)  # fmt: skip


def static_sample(model: nn.Module, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
                  synced_gpus: bool = False, streamer=None, **model_kwargs) -> torch.Tensor:  # fmt: skip
    """
    `generate`'s `_sample` (its `custom_generate` signature; the caller checks [`static_call_reason`]) from a cache
    holding the first `W - 1` columns of the `(B, W)` batch `input_ids`, decoded from static buffers (see the
    module's text). Returns the sequences, as `generate` does. Runs `generate`'s own loop where
    [`static_decode_reason`] says why it cannot.
    """
    reason = static_decode_reason(model, input_ids, stopping_criteria, generation_config, model_kwargs)
    if reason is None and stopping_criteria.max_length is None:
        reason = "no max_length or max_new_tokens bounds the buffers"
    if reason is not None:
        warn_off(reason)
        _fan_out_deferred(model_kwargs.get(CACHE_KWARG))  # generate's loop: its rows now
        return GenerationMixin._sample(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                       synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)  # fmt: skip
    optimized = getattr(model, "_optimize_model_for_decode", contextlib.nullcontext)
    # (LongRoPE's factors: each step chooses them on the device, as in generate's loop, into the same buffer)
    with optimized():
        return _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)


def _inputs_owner(model: nn.Module) -> str:
    """The name of the class whose `prepare_inputs_for_generation` `model` runs."""
    return type(model).prepare_inputs_for_generation.__qualname__.split(".")[0]


def warn_off(reason: str) -> None:
    """One warning per reason that static decoding is off."""
    _warnings.warn(f"rloo_efficient: static decoding is off for this call, generate decodes: {reason}.", key=reason,
                   stacklevel=2)  # fmt: skip


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each layer's sliding window as the model's own cache would keep it (None: attends to every position)."""
    layers = DynamicCache(config=model.config.get_text_config(decoder=True)).layers
    return [layer.sliding_window if type(layer) is DynamicSlidingWindowLayer else None for layer in layers]


def _filled(layer) -> int:
    """The positions a prefilled layer has seen (a sliding-window layer keeps the last of them only)."""
    return layer.cumulative_length if type(layer) is DynamicSlidingWindowLayer else layer.keys.shape[-2]


_DEFERRED = "_rloo_static_rows"


def defer_fan_out(cache: Cache, inverse: list[int], device) -> Cache:
    """`cache` (one row per distinct prompt) with the fan-out to the batch's rows (`inverse`) left to
    [`static_cache`], which gathers each layer's rows straight into its static buffers: the rows' copies of the prompt
    are allocated once, at their final size (fanning out first and padding after allocates them twice, and leaves the
    allocator every fanned-out layer's freed block, a little too small for the next layer's buffer). `generate`'s own
    loop ([`static_sample`] falling back) fans out first."""
    setattr(cache, _DEFERRED, torch.tensor(inverse, device=device))
    return cache


def _deferred_rows(cache) -> torch.Tensor | None:
    """The rows a deferred fan-out gives `cache`'s distinct prompts (taken: asked once), or None."""
    return vars(cache).pop(_DEFERRED, None) if cache is not None else None


def _fan_out_deferred(cache) -> None:
    """`cache`'s deferred fan-out done now, as `reorder_cache` does it (where no static buffers will take it)."""
    if (rows := _deferred_rows(cache)) is not None:
        cache.reorder_cache(rows)


def static_cache(cache: Cache, columns: int, column: torch.Tensor, length: list[int],
                 windows: list[int | None], rows: torch.Tensor | None = None) -> Cache:  # fmt: skip
    """
    `cache`'s layers as [`StaticLayer`]s of `columns` positions, their filled columns copied in, in place (the
    caller's cache object decodes and holds them afterwards); the prefilled tensors are released layer by layer.
    `windows`: each layer's sliding window or None. A layer that kept only its window's last columns has them where
    they were in the prompt (the ones before, never read again, stay zero; a tool loop's cache keeps all of them).
    Zeros in the columns not written: a masked column's weight is zero, and zero times whatever memory held (NaN)
    would not be. `rows`: each batch row's row of `cache` (a deferred fan-out, [`defer_fan_out`]), gathered into the
    buffers; a recurrent layer's states are fanned out as `reorder_cache` does.
    """
    filled = length[0]
    layers = []
    for layer, window in zip(cache.layers, windows, strict=True):
        if type(layer) in _EMPTY:
            layers.append(layer)
            continue
        if type(layer) in _FIXED:  # its states are updated in place already
            if rows is not None:
                layer.reorder_cache(rows)
            layers.append(layer)
            continue
        if type(layer) in _HYBRID and rows is not None:  # its states fanned out here, its keys below
            LinearAttentionLayer.reorder_cache(layer, rows)
        kept = layer.keys.shape[-2]
        if rows is None:
            unwritten = (0, 0, filled - kept, columns - filled)
            keys, values = F.pad(layer.keys, unwritten), F.pad(layer.values, unwritten)
        else:
            keys, values = (tensor.new_zeros(len(rows), *tensor.shape[1:-2], columns, tensor.shape[-1])
                            for tensor in (layer.keys, layer.values))  # fmt: skip
            for buffer, tensor in ((keys, layer.keys), (values, layer.values)):
                buffer.narrow(-2, filled - kept, kept).copy_(tensor.index_select(0, rows))
        layer.keys = layer.values = None
        if type(layer) in _HYBRID:
            layers.append(StaticHybridLayer.of(layer, keys, values, column, length, window, whole=kept == filled))
        else:
            layers.append(StaticLayer(keys, values, column, length, window, whole=kept == filled))
    cache.layers = layers
    return cache


def _rng_state(device: torch.device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class StaticStep:
    """
    One decoding step over static buffers: `rows` rows, `columns` cache positions (the prompt's `W - 1` prefilled and
    one per step). A call opens the step's column of the mask, forwards the step's input token and returns the float32
    logits of its next token; [`advance`] takes the sampled tokens as the next input. The same operators on the same
    addresses every step, nothing read back: what a captured graph replays.
    """

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, model_kwargs: dict, columns: int):
        rows, width = input_ids.shape
        self.model = model
        self.written = [width - 1]  # positions in the cache: the host's count, for get_seq_length
        cache = model_kwargs[CACHE_KWARG]
        self.additive = _MASKS[model.config._attn_implementation] == "additive"
        self.windows = {}
        # generate's position ids (cumsum(mask) - 1) and input at the prompt's last column, then one further a step
        # (the multimodal rope's position ids have a leading dimension: `(3 or 4, B, W)`)
        self.position = model_kwargs["position_ids"].narrow(-1, width - 1, 1).clone()
        self.token = input_ids.narrow(1, width - 1, 1).clone()
        self.extra = {"logits_to_keep": model_kwargs["logits_to_keep"]} if "logits_to_keep" in model_kwargs else {}
        dropped = _TYPES_AT_THE_FIRST_STEP.get(_inputs_owner(model), ())
        self.extra.update({key: model_kwargs[key].narrow(-1, model_kwargs[key].shape[-1] - 1, 1).clone()
                           for key in _ZERO_GROWN if model_kwargs.get(key) is not None and key not in dropped})
        if isinstance(cache, PrefixCache):  # the rows' own positions alone in buffers; the prompt stays once
            self.additive, own = True, columns - (width - 1)  # the kernels' bias: additive
            self.column = torch.zeros(1, dtype=torch.long, device=input_ids.device)
            dtype = mask_dtype(cache, next(layer.prefix_keys for layer in cache.layers if type(layer) is PrefixLayer))
            self.full = torch.full((1, 1, 1, own), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device)
            cache.layers = [StaticPrefixLayer(layer, rows, own, self.column, self.full, self.written)
                            if type(layer) is PrefixLayer else layer for layer in cache.layers]  # fmt: skip
            self.cache = cache
            self.mask = self.full  # handed to the model as prepared; the prefix attention reads `own_bias`
            return
        # This step's write position (a device index, advanced in place)
        self.column = torch.full((1,), width - 1, dtype=torch.long, device=input_ids.device)
        self.cache = static_cache(cache, columns, self.column, self.written, layer_windows(model),
                                  _deferred_rows(cache))  # fmt: skip
        mask = model_kwargs.get("attention_mask")  # generate drops a mask of all ones
        if mask is None:
            mask = input_ids.new_ones(rows, width)
        attends = F.pad(mask.bool(), (0, columns - width)).view(rows, 1, 1, columns)
        self.full = self._mask(attends)
        # A window shorter than the buffers: its own mask, the column falling out of the window closed each step.
        # Column `c` reads the keys in (c - w, c]: closing `(c - w) mod columns` closes an unwritten column (after
        # `c`, still closed) until `c >= w`
        windows = {layer.sliding_window for layer in self.cache.layers if isinstance(layer, StaticLayer)
                   and layer.sliding_window is not None and layer.sliding_window < columns}  # fmt: skip
        for window in windows:
            behind = torch.arange(columns, device=attends.device) <= width - 1 - window
            closing = torch.full((1,), (width - 1 - window) % columns, dtype=torch.long, device=attends.device)
            self.windows[window] = (self._mask(attends & ~behind), closing)
        self.mask = self._model_mask()

    def _mask(self, attends: torch.Tensor) -> torch.Tensor:
        """`attends` as the model's attention takes it: boolean for SDPA, additive (the dtype's minimum) for eager."""
        if not self.additive:
            return attends.clone()
        dtype = mask_dtype(self.cache, next(layer.keys for layer in self.cache.layers if isinstance(layer, StaticLayer)))
        return torch.zeros(attends.shape, dtype=dtype, device=attends.device).masked_fill_(attends.logical_not(),
                                                                                          torch.finfo(dtype).min)

    @property
    def opened(self):
        return 0.0 if self.additive else True

    @property
    def closed(self):
        return torch.finfo(self.full.dtype).min if self.additive else False

    def _model_mask(self):
        """What the model is handed: one mask where its layers all read the same, else one per attention type (the
        models with sliding and full layers take such a mapping as their prepared masks)."""
        if not self.windows:
            return self.full
        (sliding, _), = self.windows.values()  # one window (checked: full and sliding types alone)
        if all(getattr(layer, "sliding_window", None) is not None for layer in self.cache.layers):
            return sliding
        return {"full_attention": self.full, "sliding_attention": sliding}

    def __call__(self) -> torch.Tensor:
        # The step's column opened (the first step's, the prompt's last, is open already), and a window's oldest closed
        self.full.index_fill_(-1, self.column, self.opened)
        for sliding, closing in self.windows.values():
            sliding.index_fill_(-1, self.column, self.opened)
            sliding.index_fill_(-1, closing, self.closed)
        outputs = self.model(input_ids=self.token, attention_mask=self.mask, position_ids=self.position,
                             use_cache=True, return_dict=True, **{CACHE_KWARG: self.cache}, **self.extra)  # fmt: skip
        return outputs.logits.select(1, -1).to(copy=True, dtype=torch.float32)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a step reads or writes in place (what a captured graph keeps the addresses of)."""
        masks = [self.full, *(tensor for pair in self.windows.values() for tensor in pair)]
        caches = [tensor for layer in self.cache.layers for tensor in _layer_tensors(layer)]
        grown = [self.extra[key] for key in _ZERO_GROWN if key in self.extra]
        return [*masks, self.position, self.token, self.column, *grown, *caches]

    def advance(self, tokens: torch.Tensor) -> None:
        """Takes the step's sampled tokens `(B,)` as the next step's input."""
        self.token.copy_(tokens.unsqueeze(1))
        self.position.add_(1)
        for key in _ZERO_GROWN:
            if key in self.extra:
                self.extra[key].zero_()
        self.column.add_(1)
        for _, closing in self.windows.values():
            closing.add_(1).remainder_(self.full.shape[-1])
        self.written[0] += 1


def _layer_tensors(layer) -> list[torch.Tensor]:
    """The tensors a cache layer holds: keys and values, and a recurrent layer's states."""
    held = [getattr(layer, "keys", None), getattr(layer, "values", None), *_states(layer)]
    return [tensor for tensor in held if isinstance(tensor, torch.Tensor)]


def _states(layer) -> list[torch.Tensor]:
    """A recurrent layer's convolution and recurrent states (transformers keeps them in dicts by state index), and from
    transformers 5.25 its count of tokens seen (a device tensor each step adds to): what a step advances in place,
    where running a step twice at one position is not the same as once."""
    held = []
    for name in ("conv_states", "recurrent_states"):
        states = getattr(layer, name, None) or {}
        held += list(states.values() if isinstance(states, dict) else states)
    held.append(getattr(layer, "cumulative_length_linear", None))
    return [tensor for tensor in held if isinstance(tensor, torch.Tensor)]


def _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
    """The decoding loop; its output as `generate`'s: the sequences, or with `return_dict_in_generate` a
    `GenerateDecoderOnlyOutput` with the scores and logits asked for and the cache."""
    sequences, scores, logits = _loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                      model_kwargs)  # fmt: skip
    config = generation_config
    if not config.return_dict_in_generate:
        return sequences
    # (the output's field is the release's name for the cache: `cache` from transformers 5.24, `past_key_values` before)
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores if config.output_scores else None,
                                     logits=logits if config.output_logits else None,
                                     **{CACHE_KWARG: model_kwargs.get(CACHE_KWARG)})  # fmt: skip


# Devices on which a call's decoding step is captured as a graph and replayed ([`GraphedStep`]); elsewhere it runs
# eagerly. Also where `static_decoding=None` (the default) turns static decoding on. Measured on an H200 (bf16,
# Qwen3-0.6B's shape, P=3072 C=256 k=8; results/gpu.md, 2026-11-27): generation 0.30x stock's time (7.7 ms a token
# against generate's 26.0; the eager static step alone: 25.6), the trainer's step 0.34x; 1.7B at P=16384: step 0.23x.
# On CPU the eager static step is within 0.8-1.3x of generate's loop (results/static_decode.md): off there.
CAPTURE_DEVICES = ("cuda",)
# On a model's first captured call, replays checked against the eager step for this many tokens
CHECKED_STEPS = 3


def captures(model: nn.Module, device) -> bool:
    """Whether `model`'s decoding steps on `device` are captured as graphs: a [`CAPTURE_DEVICES`] device, the model
    on one device (a capture runs on one stream). Where `static_decoding=None` turns static decoding on."""
    device_map = getattr(model, "hf_device_map", None) or {"": 0}
    return torch.device(device).type in CAPTURE_DEVICES and len(set(device_map.values())) == 1


class GraphedStep:
    """
    A [`StaticStep`] captured once as a CUDA graph and replayed: one launch for the whole forward. The first call is
    the warm-up (eager, on a side stream, as capture needs); then the step is captured (nothing runs) and every later
    call replays it over the same buffers. On the model's first captured call, [`CHECKED_STEPS`] replays are checked
    against the eager step at the same position (the eager step writes the same keys again); a mismatch, or a step that
    cannot be captured (a host read, a copy from the host), returns to the eager step with one warning naming why.
    One capture per `generate` call: the buffers are the call's, released with it (a graph kept across calls would keep
    a whole batch's cache allocated through training).
    """

    def __init__(self, step: StaticStep, device: torch.device):
        self.step, self.device, self.graph, self.calls = step, device, None, 0
        self.checking = CHECKED_STEPS if not getattr(step.model, "_rloo_graph_checked", False) else 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            return self._capture()
        if self.graph is None:
            return self.step()
        if not self.checking:
            self.graph.replay()
            return self.output.clone()  # the graph's output buffer is overwritten by the next replay
        # The eager step at the same position, from the same recurrent states (a replay advances them in place;
        # keys and values are written again at the same column, as they were)
        states = [tensor for layer in self.step.cache.layers for tensor in _states(layer)]
        before = [tensor.clone() for tensor in states]
        self.graph.replay()
        logits = self.output.clone()
        replayed = [tensor.clone() for tensor in states]
        for tensor, saved in zip(states, before, strict=True):
            tensor.copy_(saved)
        self.checking -= 1
        eager = self.step()
        if not torch.allclose(logits, eager, rtol=REPLAY_RTOL, atol=REPLAY_ATOL):
            difference = (logits - eager).abs().max().item()
            self._give_up(f"a replay differs from the eager step by {difference:.3g} (logits)")
            return eager  # with the eager step's states
        for tensor, saved in zip(states, replayed, strict=True):  # the replay's, as every later step's will be
            tensor.copy_(saved)
        if not self.checking:
            self.step.model._rloo_graph_checked = True
        return logits

    def _capture(self) -> torch.Tensor:
        first = warm_up(self.step, self.device, self.step.buffers)  # (read after the step: it allocates some)
        try:
            self.graph, self.output = capture(self.step, self.device)
        except Exception as error:  # noqa: BLE001 - any failure to capture: the eager step decodes, exactly
            self._give_up(f"its step cannot be captured ({type(error).__name__}: {error})")
        return first

    def _give_up(self, reason: str) -> None:
        """The eager step from here on, and for the model's later calls (not captured again): one warning."""
        self.graph = self.output = None
        self.step.model._rloo_graph_failed = reason
        warnings.warn(f"rloo_efficient: static decoding runs its steps eagerly, not from a CUDA graph: {reason}.",
                      stacklevel=3)  # fmt: skip


def _loop(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
    rows, width = input_ids.shape
    device = input_ids.device
    steps = stopping_criteria.max_length - width
    recorded = ([], [])  # each step's scores and logits, where generate returns them
    record = generation_config.return_dict_in_generate and (generation_config.output_scores or
                                                            generation_config.output_logits)  # fmt: skip
    if steps <= 0:  # nothing to decode: the cache's rows as generate's loop would leave them
        _fan_out_deferred(model_kwargs.get(CACHE_KWARG))
        return input_ids, (), ()
    step = StaticStep(model, input_ids, model_kwargs, width - 1 + steps)
    graphs = device.type in CAPTURE_DEVICES and getattr(model, "_rloo_graph_failed", None) is None
    forward = GraphedStep(step, device) if graphs else step
    sequences = input_ids.new_empty(rows, width + steps)
    sequences[:, :width] = input_ids
    pad = generation_config._pad_token_tensor
    stops_at_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
    sampling = bool(generation_config.do_sample)
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    finished = torch.zeros(steps, dtype=torch.bool, device=device)  # whether every row had finished after each step
    states = {}  # the random generator's state after each step since the last check
    checked = 0
    for index in range(steps):
        logits = forward()
        length = width + index
        scores = logits_processor(sequences[:, :length], logits)
        if record:
            recorded[0].append(scores)
            recorded[1].append(logits)
        if sampling:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            states[index] = _rng_state(device)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if stops_at_eos:  # finished rows get padding, as generate gives them
            tokens = tokens * unfinished + pad * (1 - unfinished)
        sequences[:, length].copy_(tokens)
        unfinished &= ~stopping_criteria(sequences[:, : length + 1], scores)
        finished[index] = unfinished.max() == 0
        if index + 1 - checked == STOP_CHECK_EVERY or index + 1 == steps:
            done = finished[checked : index + 1].nonzero()  # the loop's one read-back, every STOP_CHECK_EVERY steps
            if done.numel():
                last = checked + int(done[0, 0])  # generate stops after this step
                if sampling and last != index:  # the draws of the steps past it undone
                    _set_rng_state(device, states[last])
                return sequences[:, : width + last + 1], tuple(recorded[0][: last + 1]), tuple(recorded[1][: last + 1])
            checked, states = index + 1, {}
        step.advance(tokens)
    return sequences, tuple(recorded[0]), tuple(recorded[1])
