"""
One attention backend for training, scoring and decoding, registered in transformers' attention interface.

- The packed forwards (policy and reference log-probs, training, reward models) hand it a [`tree.parts.TreeLayout`]
  in the model call's keyword arguments (`rloo_prefix_layout=`), which transformers passes down to every attention call
  and which gradient checkpointing's recomputation receives again: each token attends to its ancestors in the prefix
  tree and causally within its node ([`attention.tree`]).
- Decoding reads the [`generation.prompt_cache.PrefixCache`] handed to `generate`, through [`decoding_with`], scoped to that call:
  each row's query over its prompt's keys, stored once per group, and over its own decoded keys, merged by
  log-sum-exp (Hydragen, arXiv 2402.05099):

      prefix:  the queries of a group's rows, batched, against the group's prompt keys    (G, H, R, D) x (G, Hkv, Lp, D)
      suffix:  each row's query against its own keys                                      (B, H, 1, D) x (B, Hkv, t, D)
      merge:   out = lerp(out_s, out_p, sigmoid(lse_p - lse_s)),  lse = logaddexp(lse_p, lse_s)

  Each part is one fused-kernel call over all rows ([`attention.checks`]). Where the rows of every group are consecutive
  and equally many, the prefix layout of the queries is a view of their row layout; otherwise one gather maps between
  them.

[`install`] points each attention module of a model at it (through a copy of its config, so the model's own config,
masks and generation logic are untouched). Without a layout or a decoding cache it passes the call through to the
model's own attention implementation, so the model behaves as before.
"""

import contextlib
import contextvars
import copy
import functools
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..tree.layout import LAYOUT_KWARG
from .checks import attention_forward, softcapped
from .held import capturing
from .tree import tree_attention
from .windows import apply_sinks, decode_window_biases


ATTENTION_NAME = "rloo_prefix"

_decoding: contextvars.ContextVar = contextvars.ContextVar("rloo_prefix_decoding", default=None)
_capturing: contextvars.ContextVar = contextvars.ContextVar("rloo_prefix_capturing", default=None)
_continuing: contextvars.ContextVar = contextvars.ContextVar("rloo_prefix_continuing", default=None)


@dataclass(frozen=True)
class SplitLayout:
    """
    Where the completion queries sit in the two parts. Row layout: `(S, H, Cm, D)`, S rows of Cm queries (flat order
    row-major). Prefix layout: `(G, H, Qm, D)`, each group's queries in `Qm` slots.
    """

    groups: int  # G
    rows_per_group: int | None  # R when the rows are G consecutive runs of R (prefix layout = a view), else None
    slots: int  # Qm
    gather: torch.Tensor | None  # (G*Qm,) flat query in each prefix slot; S*Cm (a zero row) at padding slots
    scatter: torch.Tensor | None  # (S*Cm,) prefix slot of each flat query
    prefix_bias: torch.Tensor | None  # (G, 1, 1, Lp) additive; None when no prompt is padded


# -- decoding's prefix layout as a view ------------------------------------------------------------------------------
def _regroup(x: torch.Tensor, groups: int) -> torch.Tensor:
    """
    `(S, h, L, *rest)` rows, `S = groups * R` -> `(G, h, R*L, *rest)`: a view when each row's tokens follow the
    previous row's in memory, else a copy.
    """
    rows, heads, length, *rest = x.shape
    row_stride, head_stride, token_stride, *rest_strides = x.stride()
    if length > 1 and row_stride != length * token_stride:  # rows not token-major (CUDA's log-sum-exp): copy
        return x.transpose(1, 2).reshape(groups, rows // groups * length, heads, *rest).transpose(1, 2)
    return x.as_strided(
        (groups, heads, rows // groups * length, *rest),
        (rows // groups * length * token_stride if length > 1 else rows // groups * row_stride, head_stride,
         token_stride if length > 1 else row_stride, *rest_strides),
        x.storage_offset(),
    )  # fmt: skip


def _to_slots(x: torch.Tensor, split: SplitLayout) -> torch.Tensor:
    """Rows `(S, h, L, *rest)` -> the prefix layout `(G, h, Qm, *rest)`: a view, or one gather (padding slots: 0)."""
    if split.rows_per_group is not None:
        return _regroup(x, split.groups)
    flat = x.transpose(1, 2).flatten(0, 1)  # (S*L, h, *rest)
    slots = torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))]).index_select(0, split.gather)
    return slots.unflatten(0, (split.groups, split.slots)).transpose(1, 2)


def _from_slots(x: torch.Tensor, split: SplitLayout, rows: int) -> torch.Tensor:
    """The prefix layout `(G, h, Qm, *rest)` -> rows `(S, h, L, *rest)` (gather layouts only: a copy)."""
    flat = x.transpose(1, 2).flatten(0, 1).index_select(0, split.scatter)  # (S*L, h, *rest)
    return flat.unflatten(0, (rows, -1)).transpose(1, 2)


# -- the two parts, merged -------------------------------------------------------------------------------------------
def _merge_into(out, lse, out_p, lse_p, out_s, lse_s):
    """`out` <- attention over both parts' keys, from each part's output and log-sum-exp; `lse` too, unless None."""
    weight = torch.sigmoid(lse_p - lse_s).unsqueeze(-1)  # the prefix's share of the softmax mass
    if out_s.dtype == weight.dtype:
        torch.lerp(out_s, out_p, weight, out=out)
    else:  # half precision: merge in float32, as the kernels accumulate
        out.copy_(torch.lerp(out_s.float(), out_p.float(), weight))
    if lse is not None:
        torch.logaddexp(lse_p, lse_s, out=lse)


def _split_into(out, lse, query, prefix_key, prefix_value, prefix_bias, key, value, split: SplitLayout, scale,
                own_bias=None) -> None:  # fmt: skip
    """
    Each row's attention over [its group's prompt | its own keys], written to `out` (and its log-sum-exp to `lse`):
    rows `query`, `out` (S, H, L, D), `lse` (S, H, L) or None, `key`/`value` (S, Hkv, Lk, D) masked by `own_bias`;
    the prompts `(G, Hkv, Lp, D)` masked by `prefix_bias`; through the gather of `split`.
    """
    out_p, lse_p, _ = attention_forward(_to_slots(query, split), prefix_key, prefix_value, prefix_bias, False, scale)
    out_s, lse_s, _ = attention_forward(query, key, value, own_bias, False, scale)
    rows = query.shape[0]
    _merge_into(out, lse, _from_slots(out_p, split, rows), _from_slots(lse_p, split, rows), out_s, lse_s)


def split_attention(query, prefix_key, prefix_value, key, value, split: SplitLayout, scale: float,
                    prefix_bias=None, own_bias=None, sinks=None) -> torch.Tensor:  # fmt: skip
    """
    Decoding: each row's query `(B, H, 1, D)` over [its group's prompt `(G, Hkv, Lp, D)` | its own decoded keys
    `(B, Hkv, t, D)`], the prompt masked by `prefix_bias` (G or 1, 1, 1, Lp) and the row's keys by `own_bias`
    (1, 1, 1, t), each None when nothing is masked; `sinks` (H,) or None. Returns `(B, 1, H, D)`. No gradients.
    """
    if split.rows_per_group is None:  # prompts of unequal row counts: merge through the gather, into a buffer
        out = torch.empty_like(query)  # token-major, as the query
        lse = None
        if sinks is not None:
            lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
            lse = query.new_empty(query.shape[:3], dtype=lse_dtype)
        _split_into(out, lse, query, prefix_key, prefix_value, prefix_bias, key, value, split, scale, own_bias)
        if sinks is not None:
            apply_sinks(out, lse, sinks)
        return out.transpose(1, 2)
    groups = split.groups
    out_p, lse_p, _ = attention_forward(_regroup(query, groups), prefix_key, prefix_value, prefix_bias, False, scale)
    out_s, lse_s, _ = attention_forward(query, key, value, own_bias, False, scale)
    lse_s = _regroup(lse_s, groups)
    weight = torch.sigmoid(lse_p - lse_s).unsqueeze(-1)
    out_s = _regroup(out_s, groups)
    if out_s.dtype != weight.dtype:  # half precision: merge in float32, as the kernels accumulate
        out_s, out_p = out_s.float(), out_p.float()
    out = torch.lerp(out_s, out_p, weight)  # (G, H, R, D)
    if sinks is not None:
        out = out.to(weight.dtype)
        apply_sinks(out, torch.logaddexp(lse_p, lse_s), sinks)
    out = out.to(query.dtype)
    rows, heads, _, dim = query.shape
    if out.stride() == (out.shape[2] * heads * dim, dim, heads * dim, 1):  # token-major, as its inputs: a view
        return out.as_strided((rows, 1, heads, dim), (heads * dim, heads * dim, dim, 1), out.storage_offset())
    return out.transpose(1, 2).reshape(rows, 1, heads, dim)


# -- the registered attention function -------------------------------------------------------------------------------
def _decode_attention(module, query, key, value, cache, window, sinks, scale) -> torch.Tensor:
    """One decoding step: `query` (B, H, 1, D), `key`/`value` the rows' decoded keys (B, Hkv, t, D)."""
    if query.shape[2] != 1:
        raise ValueError(f"{ATTENTION_NAME!r} decodes one token per row at a time, got {query.shape[2]}.")
    layer = cache.layers[module.layer_idx]
    prefix_key, prefix_value = layer.prefix_keys, layer.prefix_values
    expand = _expand(module)
    if expand is not None:  # multi-head latent attention: the prompt is cached as latents, expanded here
        prefix_key, prefix_value = expand(prefix_key, prefix_value)  # as the module expands its own
    prefix_key, prefix_value = _compute_dtype(query, prefix_key, prefix_value)[1:]
    prefix_bias, own_bias = layer.prefix_bias, layer.own_bias
    if window is not None and key.shape[2] > window:  # a layer keeping its whole history (a tool loop's): the window
        key, value = key[:, :, -window:], value[:, :, -window:]
    if window is not None:
        window_bias, own_bias = decode_window_biases(layer.prefix_columns, prefix_key.shape[2], layer.own_length,
                                                     key.shape[2], window, query.dtype, query.device)  # fmt: skip
        if window_bias is not None:  # both mask with the dtype's minimum: keep one, not their sum (-inf)
            prefix_bias = window_bias if prefix_bias is None else torch.minimum(prefix_bias, window_bias)
    query, key, value, prefix_key, prefix_value = _one_head_dim(query, key, value, prefix_key, prefix_value)
    return split_attention(query, prefix_key, prefix_value, key, value, cache.split, scale, prefix_bias, own_bias,
                           sinks)  # fmt: skip


def _expand(module):
    """Multi-head latent attention's own expansion of latents into keys and values (the class's: not the recording
    one [`install_attention`] sets on the module, since a source forward reading another's latents must not record
    them as its own); None for other attention."""
    expand = getattr(type(module), "expand_kv", None)
    return None if expand is None else functools.partial(expand, module)


class _ExpandHoldingLatents:
    """An installed latent-attention module's `expand_kv` ([`install_attention`]): hands its latents over first
    ([`_record_latents`]), then expands them as the class does. An object holding its module, so that a deep copy of
    the model and a pickled one (`torch.save(model)`) hold theirs."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (_record_outside_graph if torch.compiler.is_compiling() else _record_latents)(self.module, kv_nope, k_rot)
        return type(self.module).expand_kv(self.module, kv_nope, k_rot)


def _record_latents(module, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> None:
    """Latent attention's latents, where a packed forward takes what its layers store: a source forward holds them in
    place of the keys and values they expand to ([`held.Capture.latents`]); a tree prefill lays them out as the
    layer's cache stores them ([`capturing_keys`]: keys the latents, values the rope part, as `cache.update` takes
    them)."""
    capture = capturing()
    if capture is not None:
        capture.latents(module.layer_idx, kv_nope, k_rot)
    keys = _capturing.get()
    if keys is not None:
        keys(module.layer_idx, kv_nope, k_rot)


_record_outside_graph = torch._dynamo.disable(_record_latents)  # (a compiled layer: what the context holds now)


def _one_head_dim(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """
    Queries, keys and values padded with zeros to one head dim, as the fused kernels need (DeepSeek-V3's values are
    narrower than its keys): zero dims add nothing to the scores, and a value's give output dims the caller crops.
    Differentiable; no copy where the dims already agree.
    """
    width = max(tensor.shape[-1] for tensor in tensors)
    return tuple(tensor if tensor.shape[-1] == width else F.pad(tensor, (0, width - tensor.shape[-1]))
                 for tensor in tensors)  # fmt: skip


def _base_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own attention implementation, with the module's own config in place while it runs."""
    base_config = module._rloo_base_config
    implementation = base_config._attn_implementation
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    function = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)
    proxy, module.config = module.config, base_config  # flash attention reads its kernel's name from module.config
    try:
        return function(module, query, key, value, attention_mask, **kwargs)
    finally:
        module.config = proxy


def prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as `ATTENTION_NAME` (transformers' attention interface signature)."""
    layout = kwargs.pop(LAYOUT_KWARG, None)
    capture = _capturing.get() if layout is not None else None
    if capture is not None and "expand_kv" not in vars(module):  # as the module hands them over: what its cache
        capture(module.layer_idx, key, value)  # would store (latent attention's latents: [`_record_latents`])
    cache = _decoding.get() if layout is None else None
    if layout is None and cache is None:
        return _base_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if dropout:
        raise ValueError(f"{ATTENTION_NAME!r} attention has no dropout: disable it (disable_dropout=True).")
    sinks = kwargs.get("s_aux")  # GPT-OSS: one logit per head
    window = kwargs.get("sliding_window")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    query, key, value = _compute_dtype(query, key, value)
    value_dim = value.shape[-1]
    if layout is not None:
        expand = _expand(module)  # (latent attention: what expands held latents)
        sliding = window is not None  # a sliding layer (Gemma 4's image blocks attend both ways only there)
        if window is not None and window >= layout.span:  # every key any query may read is within the window
            window = None
        history = ()
        if layout.history:  # a continued prefill: the rows' held keys and values, in the query's dtype
            if torch.is_grad_enabled():
                raise ValueError("A continued prefill's attention over held keys has no backward: run it without "
                                 "grad.")  # fmt: skip
            history = _continuing.get()(module.layer_idx)
            if expand is not None:  # latent attention: the cache holds latents, expanded here as the module does
                history = expand(*history)
            history = _compute_dtype(query, *history)[1:]
        capture = capturing()
        if capture is not None:  # a source forward: these keys are held for later micro-batches ([`tree.holds`])
            capture.attention(module.layer_idx, key, value)
        held = _compute_dtype(query, *layout.held.attention(module.layer_idx, expand))[1:] if (
            layout.held_parts) else ()  # fmt: skip
        query, key, value, *rest = _one_head_dim(query, key, value, *history, *held)
        history, held = rest[: len(history)], rest[len(history) :]
        with _softcapped(kwargs.get("softcap")):  # Gemma 2's attention-logit cap: the math path's
            out = tree_attention(query, key, value, sinks, layout, window, scale, sliding, tuple(history) or None,
                                 *held)  # fmt: skip
    else:
        with _softcapped(kwargs.get("softcap")):
            out = _decode_attention(module, query, key, value, cache, window, sinks, scale)
    return (out if out.shape[-1] == value_dim else out[..., :value_dim]), None


def _softcapped(softcap: float | None):
    """[`checks.softcapped`] where a layer caps its scores; nothing to enter elsewhere (no call is inside another's)."""
    return contextlib.nullcontext() if softcap is None else softcapped(softcap)


def _compute_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """
    The tensors in one dtype, as scaled_dot_product_attention gets them: under autocast its lower precision (autocast
    casts SDPA's inputs; rotary embeddings leave queries and keys in float32 while values are in bf16), else the
    query's. Differentiable; no copy where the dtype already matches.
    """
    device_type = tensors[0].device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else tensors[0].dtype
    return tuple(tensor if tensor.dtype == dtype else tensor.to(dtype) for tensor in tensors)


def stored_as_read(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """
    Keys and values as a cache stores them: under autocast, float32 ones in autocast's lower precision, the dtype
    every attention reads them in (autocast casts SDPA's and eager attention's float32 inputs, the flash integration
    and [`_compute_dtype`] cast to it), so that a reader gets the same values from a narrower store; else as they are
    (autocast leaves float64 alone: a float64 model's attention reads float64).
    """
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(tensor.to(dtype) if tensor.dtype == torch.float32 else tensor for tensor in tensors)


# Under `torch.compile` the function runs as Python, outside the graph (a graph break per attention call): what it
# does depends on host structure (the layout's buckets, the decoding cache in its context) that a compiled graph would
# freeze at its first trace; the rest of each layer stays compiled. Eager calls skip dynamo's wrapper (host time per
# layer: it switches the frame evaluation off and on around every call)
_outside_graph = torch._dynamo.disable(prefix_attention, recursive=True)


def _registered_attention(module, query, key, value, attention_mask, **kwargs):
    if torch.compiler.is_compiling():
        return _outside_graph(module, query, key, value, attention_mask, **kwargs)
    return prefix_attention(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION_NAME, _registered_attention)


def _attention_modules(model: nn.Module):
    text_config = model.config.get_text_config()
    for module in model.modules():
        if hasattr(module, "_rloo_base_config"):
            yield module
        elif getattr(module, "config", None) is text_config and hasattr(module, "layer_idx") and hasattr(
            module, "num_key_value_groups"
        ):
            yield module


def install_attention(model: nn.Module) -> int:
    """
    Points every attention module of `model` at [`prefix_attention`] (idempotent) and returns how many there are (see
    [`layers.install.install`], which routes a hybrid's recurrent layers too). The modules get a copy of the config
    naming it; `model.config` is untouched, and calls without a layout run the model's own implementation, so nothing
    changes for code that does not pass one.
    """
    count = 0
    for module in _attention_modules(model):
        if not hasattr(module, "_rloo_base_config"):
            proxy = copy.copy(module.config)
            proxy._attn_implementation_internal = ATTENTION_NAME
            module._rloo_base_config, module.config = module.config, proxy
        if hasattr(type(module), "expand_kv") and "expand_kv" not in vars(module):  # latent attention: held as latents
            module.expand_kv = _ExpandHoldingLatents(module)
        count += 1
    return count


@contextlib.contextmanager
def decoding_with(cache):
    """Within the block, installed attention modules decode from `cache` (a [`generation.prompt_cache.PrefixCache`])."""
    token = _decoding.set(cache)
    try:
        yield
    finally:
        _decoding.reset(token)


@contextlib.contextmanager
def capturing_keys(capture):
    """Within the block, each attention call of a packed forward hands `capture(layer_idx, key, value)` its layer's
    keys and values as the module hands them over (what the layer's cache would store), each `(1, Hkv, N, D)`; a
    latent attention layer its latents, as its cache stores them (`(1, 1, N, rank)` and `(1, 1, N, rope dims)`)."""
    token = _capturing.set(capture)
    try:
        yield
    finally:
        _capturing.reset(token)


@contextlib.contextmanager
def continuing_with(held):
    """Within the block, a continued prefill's attention reads each layer's held keys and values from `held(layer_idx)`
    (`(B, Hkv, T, D)` each: the new batch's cache, held tokens in place; see [`generation.turn_cache`])."""
    token = _continuing.set(held)
    try:
        yield
    finally:
        _continuing.reset(token)
