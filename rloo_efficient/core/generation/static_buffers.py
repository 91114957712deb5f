"""
The static buffers a decoding call writes in place ([`generation.static_decode`]): each cache layer's keys and values
in buffers of every position the call will forward, its filled columns copied in once.

- [`StaticLayer`]: a layer's keys and values, `(B, Hkv, W - 1 + N, D)`, each step's written at a device index;
  [`StaticHybridLayer`] the same beside a recurrent mixer's states (Falcon-H1's); [`StaticPrefixLayer`] the rows' own
  `N` positions alone, after a prompt kept once per group ([`generation.prompt_cache.PrefixCache`]);
- [`static_cache`]: a prefilled cache's layers turned into these, the prefilled tensors released layer by layer, a
  deferred fan-out ([`defer_fan_out`]) gathered straight into the buffers;
- which layers static buffers hold ([`KV_LAYERS`], [`HYBRID_LAYERS`]), keep as they are ([`FIXED_LAYERS`],
  [`EMPTY_LAYERS`]), and the tensors a step advances in place ([`layer_tensors`], [`layer_states`]).
"""

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

from .prompt_cache import PrefixLayer


# Cache layers a static buffer holds: keys and values, all of them or a sliding window's last ones
KV_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
# Cache layers kept as they are: recurrent and convolution states of a fixed size, which transformers updates in
# place (for graphs' static addresses)
FIXED_LAYERS = (LinearAttentionLayer,)
# Cache layers that hold nothing: a layer reading another layer's keys and values (Gemma 4's shared layers: they read
# them from the source layer's update in the same forward, our buffers)
EMPTY_LAYERS = (DummyLayer,)
# Cache layers holding a recurrent mixer's states and an attention's keys and values (Falcon-H1's)
HYBRID_LAYERS = (LinearAttentionAndFullAttentionLayer,)


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


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each layer's sliding window as the model's own cache would keep it (None: attends to every position)."""
    layers = DynamicCache(config=model.config.get_text_config(decoder=True)).layers
    return [layer.sliding_window if type(layer) is DynamicSlidingWindowLayer else None for layer in layers]


def filled_positions(layer) -> int:
    """The positions a prefilled layer has seen (a sliding-window layer keeps the last of them only)."""
    return layer.cumulative_length if type(layer) is DynamicSlidingWindowLayer else layer.keys.shape[-2]


_DEFERRED = "_rloo_static_rows"


def defer_fan_out(cache: Cache, inverse: list[int], device) -> Cache:
    """`cache` (one row per distinct prompt) with the fan-out to the batch's rows (`inverse`) left to
    [`static_cache`], which gathers each layer's rows straight into its static buffers: the rows' copies of the prompt
    are allocated once, at their final size (fanning out first and padding after allocates them twice, and leaves the
    allocator every fanned-out layer's freed block, a little too small for the next layer's buffer). `generate`'s own
    loop ([`generation.static_decode.static_sample`] falling back) fans out first."""
    setattr(cache, _DEFERRED, torch.tensor(inverse, device=device))
    return cache


def deferred_rows(cache) -> torch.Tensor | None:
    """The rows a deferred fan-out gives `cache`'s distinct prompts (taken: asked once), or None."""
    return vars(cache).pop(_DEFERRED, None) if cache is not None else None


def fan_out_deferred(cache) -> None:
    """`cache`'s deferred fan-out done now, as `reorder_cache` does it (where no static buffers will take it)."""
    if (rows := deferred_rows(cache)) is not None:
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
        if type(layer) in EMPTY_LAYERS:
            layers.append(layer)
            continue
        if type(layer) in FIXED_LAYERS:  # its states are updated in place already
            if rows is not None:
                layer.reorder_cache(rows)
            layers.append(layer)
            continue
        if type(layer) in HYBRID_LAYERS and rows is not None:  # its states fanned out here, its keys below
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
        if type(layer) in HYBRID_LAYERS:
            layers.append(StaticHybridLayer.of(layer, keys, values, column, length, window, whole=kept == filled))
        else:
            layers.append(StaticLayer(keys, values, column, length, window, whole=kept == filled))
    cache.layers = layers
    return cache


def layer_tensors(layer) -> list[torch.Tensor]:
    """The tensors a cache layer holds: keys and values, and a recurrent layer's states."""
    held = [getattr(layer, "keys", None), getattr(layer, "values", None), *layer_states(layer)]
    return [tensor for tensor in held if isinstance(tensor, torch.Tensor)]


def layer_states(layer) -> list[torch.Tensor]:
    """A recurrent layer's convolution and recurrent states (transformers keeps them in dicts by state index), and from
    transformers 5.25 its count of tokens seen (a device tensor each step adds to): what a step advances in place,
    where running a step twice at one position is not the same as once."""
    held = []
    for name in ("conv_states", "recurrent_states"):
        states = getattr(layer, name, None) or {}
        held += list(states.values() if isinstance(states, dict) else states)
    held.append(getattr(layer, "cumulative_length_linear", None))
    return [tensor for tensor in held if isinstance(tensor, torch.Tensor)]
