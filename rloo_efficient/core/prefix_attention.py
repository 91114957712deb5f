"""
One prefix-attention backend for training, scoring and decoding.

A completion attends to its prompt and to its own earlier tokens. The prompt's keys and values exist once per group,
so a completion's attention is computed in two parts and merged exactly by log-sum-exp (Hydragen, arXiv 2402.05099;
ring attention merges the same way):

    prefix:  the queries of a group's rows, batched, against the group's prompt keys    (G, H, Q, D) x (G, Hkv, Lp, D)
    suffix:  each row's queries against its own keys (causal in training, all of them while decoding)
    merge:   out = lerp(out_s, out_p, sigmoid(lse_p - lse_s)),  lse = logaddexp(lse_p, lse_s)

Each part is one fused-kernel call over all rows of all groups ([`kernel_checks`]); the backward calls the
kernels' backward with the merged output and log-sum-exp. No (L, L) mask exists: a padded prompt is masked by a
(G, 1, 1, Lp) bias. Where the rows of every group are consecutive and equally many, the prefix layout of the queries is
a view of their row layout; otherwise one gather maps between them.

The function is registered in transformers' attention interface as `ATTENTION_NAME`. [`install`] points each
attention module of a model at it (through a copy of its config, so the model's own config, masks and generation
logic are untouched). Without a layout it passes the call through to the model's own attention implementation, so the
model behaves as before. The packed forward passes its [`PackedLayout`] in the model call's keyword arguments
(`rloo_prefix_layout=`), which transformers hands down to every attention call and which gradient checkpointing's
recomputation receives again. Decoding reads the [`prefix_cache.PrefixCache`] handed to `generate`, through
[`decoding_with`], scoped to that `generate` call (no gradients, so no recomputation; `generate` rejects keyword
arguments its model's signature does not name).
"""

import contextlib
import contextvars
import copy
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .kernel_checks import attention_backward, attention_forward
from .vision import block_bias
from .window_attention import apply_sinks, band_backward, band_forward, decode_window_biases, gather_tail
from .window_attention import prompt_tail, scatter_tail, sink_gradient, tail_bias


ATTENTION_NAME = "rloo_prefix"
LAYOUT_KWARG = "rloo_prefix_layout"
# A 4-D attention mask is returned as-is by transformers' mask builders: the packed forward needs none, so it passes
# this empty placeholder and no (L, L) mask is ever built
NO_MASK = torch.empty(1, 1, 0, 0)

_decoding: contextvars.ContextVar = contextvars.ContextVar("rloo_prefix_decoding", default=None)


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


@dataclass(frozen=True)
class PackedLayout:
    """
    The packed forward's structure, passed in the model call's keyword arguments. The flat sequence is `G` prompt
    bodies of `prompt_length` tokens (right-padded), then `rows` completion rows of `row_length` tokens (right-padded).
    """

    split: SplitLayout
    prompt_length: int  # Pm: the longest prompt body (a prompt less its last token)
    rows: int  # S
    row_length: int  # Cm
    span: int  # the longest prompt + completion: a sliding window at least this long masks nothing
    body_lengths: torch.Tensor  # (G,) each body's tokens, on the device
    # What every layer derives alike from the layout (a window's prompt tail and mask), built by the first
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    # Gemma's image prompts: each body token's image block (G, Pm) (-1 for text), whose tokens attend to each other
    # both ways, on "all" layers or the "sliding" ones ([`vision.body_blocks`])
    body_blocks: torch.Tensor | None = None
    blocks_on: str = "all"

    @property
    def prompt_tokens(self) -> int:
        return self.split.groups * self.prompt_length


# -- layouts as views -------------------------------------------------------------------------------------------------
# Every flat tensor here is token-major in memory (as transformers lays out q, k and v: (1, N, h, D) transposed to
# (1, h, N, D)), so each part's layout is one `as_strided` view of it: no copies, one dispatch each.
def _blocks(x: torch.Tensor, start: int, blocks: int, length: int) -> torch.Tensor:
    """Tokens `[start, start + blocks * length)` of `x` `(1, h, N, *rest)` as `(blocks, h, length, *rest)`, a view."""
    _, head_stride, token_stride, *rest = x.stride()
    return x.as_strided(
        (blocks, x.shape[1], length, *x.shape[3:]),
        (length * token_stride, head_stride, token_stride, *rest),
        x.storage_offset() + start * token_stride,
    )


def _regroup(x: torch.Tensor, groups: int, writable: bool = False) -> torch.Tensor:
    """
    `(S, h, L, *rest)` rows, `S = groups * R` -> `(G, h, R*L, *rest)`: a view when each row's tokens follow the
    previous row's in memory (the buffers here are laid out so), else a copy, which a `writable` target must not be.
    """
    rows, heads, length, *rest = x.shape
    row_stride, head_stride, token_stride, *rest_strides = x.stride()
    if length > 1 and row_stride != length * token_stride:  # rows not token-major (CUDA's log-sum-exp): copy
        if writable:
            raise RuntimeError("rloo_efficient: an output buffer is not laid out token-major.")
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


@dataclass
class _Prefix:
    """What a part of the completions' attention reads of their prompt: keys and values `(G, Hkv, Lp, D)` and an
    additive bias (`(G, 1, 1, Lp)` for padding, or `(G, 1, Qm, Lp)` under a sliding window); `tail`: under a window,
    the flat index `(G * Lp,)` of the prompt tokens read (their gradients go back there)."""

    key: torch.Tensor
    value: torch.Tensor
    bias: torch.Tensor | None
    tail: torch.Tensor | None = None


def _split_into(out, lse, query, prefix: _Prefix, key, value, split: SplitLayout, causal, window, scale,
                own_bias=None):  # fmt: skip
    """
    Each row's attention over [its group's prompt | its own keys], written to `out` (and its log-sum-exp to `lse`,
    for the backward). Rows: `query`, `out` (S, H, L, D), `lse` (S, H, L) or None, `key`/`value` (S, Hkv, Lk, D),
    all but the keys token-major; the rows' own keys causal (under `window` if any), or read all, masked by
    `own_bias` (decoding). Returns the kernels' states.
    """
    out_p, lse_p, state_p = attention_forward(_to_slots(query, split), prefix.key, prefix.value, prefix.bias, False,
                                              scale)  # fmt: skip
    if causal:
        out_s, lse_s, state_s = band_forward(query, key, value, window, scale)
    else:
        out_s, lse_s, state_s = attention_forward(query, key, value, own_bias, False, scale)
    if split.rows_per_group is not None:  # merge in the prefix layout, where every operand is a view
        groups = split.groups
        _merge_into(_regroup(out, groups, writable=True), None if lse is None else _regroup(lse, groups, writable=True),
                    out_p, lse_p, _regroup(out_s, groups), _regroup(lse_s, groups))  # fmt: skip
    else:
        rows = query.shape[0]
        _merge_into(out, lse, _from_slots(out_p, split, rows), _from_slots(lse_p, split, rows), out_s, lse_s)
    return state_p, state_s


def _split_backward(grad_query, grad, out, lse, query, prefix: _Prefix, key, value, split, window, scale, states):
    """
    Gradients of [`_split_into`]'s output (causal rows): the query's are written to `grad_query` (rows,
    token-major); returns the prefix keys' and values' and the rows' own keys' and values'.
    """
    state_p, state_s = states
    grad_q, grad_k, grad_v = band_backward(state_s, grad, query, key, value, out, lse, window, scale)
    grad_query.copy_(grad_q)
    # Padding slots of the prefix layout hold zeros (query, gradient, output, log-sum-exp): their scores are 0, their
    # probabilities exp(0 + bias - 0) at most 1, their gradient 0
    grad_qp, grad_pk, grad_pv = attention_backward(
        state_p, _to_slots(grad, split), _to_slots(query, split), prefix.key, prefix.value, prefix.bias,
        _to_slots(out, split), _to_slots(lse, split), False, scale,
    )  # fmt: skip
    if split.rows_per_group is not None:
        _regroup(grad_query, split.groups, writable=True).add_(grad_qp)  # a view of the token-major rows
    else:
        grad_query.add_(_from_slots(grad_qp, split, query.shape[0]))
    return grad_pk, grad_pv, grad_k, grad_v


def _token_major(like: torch.Tensor, heads: int, length: int, *rest: int, dtype=None) -> torch.Tensor:
    """An empty `(1, heads, length, *rest)` tensor laid out token-major."""
    inner = 1
    for size in rest:
        inner *= size
    strides = (length * heads * inner, inner, heads * inner, *([1] if rest else []))
    return like.new_empty_strided((1, heads, length, *rest), strides, dtype=dtype or like.dtype)


def _prefix_of(layout: PackedLayout, key, value, window: int | None, dtype) -> _Prefix:
    """The prompt the completions read: each group's whole body with its padding bias, or under a window shorter
    than the sequences, the body's last w - 1 tokens with the window's bias ([`window_attention.prompt_tail`])."""
    split, groups, length = layout.split, layout.split.groups, layout.prompt_length
    if window is None:
        return _Prefix(_blocks(key, 0, groups, length), _blocks(value, 0, groups, length), split.prefix_bias)
    if (window, dtype) not in layout.memo:  # once per batch, for every layer with this window
        index, valid, tail = prompt_tail(layout.body_lengths, length, window)
        if split.rows_per_group is not None:  # slot s of a group's queries is token s % Cm of its row
            offsets = torch.arange(split.slots, device=index.device).remainder(layout.row_length).view(1, -1)
        else:
            offsets = split.gather.remainder(layout.row_length).view(groups, -1)
        layout.memo[window, dtype] = (index, tail_bias(offsets, valid, tail, window, dtype))
    index, bias = layout.memo[window, dtype]
    return _Prefix(gather_tail(key, index, groups), gather_tail(value, index, groups), bias, index)


class _PackedAttention(torch.autograd.Function):
    """
    Attention of the packed flat sequence (see [`prefix_sharing`]): `query` (1, H, N, D), `key`/`value`
    (1, Hkv, N, D). Prompt bodies attend causally within themselves; completion rows attend to their group's body and
    their own earlier tokens; under a sliding `window`, to the keys within it only ([`window_attention`]); `sinks`
    (H,) or None, attention sinks. One autograd node per layer; its backward is the kernels' backward.
    """

    @staticmethod
    def forward(ctx, query, key, value, sinks, layout: PackedLayout, window: int | None, scale: float,
                sliding: bool = False):  # fmt: skip
        groups, length = layout.split.groups, layout.prompt_length
        rows, row_length, n_prompt = layout.rows, layout.row_length, layout.prompt_tokens
        heads, tokens, dim = query.shape[1], query.shape[2], query.shape[3]
        out = _token_major(query, heads, tokens, dim)
        lse = lse_rows = None  # the merged log-sum-exp, for the backward and the sinks
        if any(ctx.needs_input_grad[:4]) or sinks is not None:
            lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32  # the kernels' accumulation
            lse = _token_major(query, heads, rows * row_length, dtype=lse_dtype)
            lse_rows = _blocks(lse, 0, rows, row_length)
        rows_of = lambda x: _blocks(x, n_prompt, rows, row_length)  # noqa: E731
        lse_prompt = None
        if length > 0:
            prompt = tuple(_blocks(x, 0, groups, length) for x in (query, key, value))
            blocks = _image_blocks_bias(layout, window, sliding, query.dtype)
            if blocks is None:
                out_prompt, lse_prompt, state_prompt = band_forward(*prompt, window, scale)
            else:  # an image's tokens attend to each other both ways: the bodies' attention under a bias
                out_prompt, lse_prompt, state_prompt = attention_forward(*prompt, blocks, False, scale)
            if sinks is not None:
                apply_sinks(out_prompt, lse_prompt, sinks)
            _blocks(out, 0, groups, length).copy_(out_prompt)
            prefix = _prefix_of(layout, key, value, window, query.dtype)
            states = _split_into(rows_of(out), lse_rows, rows_of(query), prefix, rows_of(key), rows_of(value),
                                 layout.split, True, window, scale)  # fmt: skip
            ctx.prompt_state = state_prompt
        else:  # one-token prompts: nothing before the rows, plain causal attention per row
            out_rows, lse_out, states = band_forward(rows_of(query), rows_of(key), rows_of(value), window, scale)
            rows_of(out).copy_(out_rows)
            if lse_rows is not None:
                lse_rows.copy_(lse_out)
        if sinks is not None:
            apply_sinks(rows_of(out), lse_rows, sinks)
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(query, key, value, sinks, out, lse, lse_prompt)
        # Nothing the size of the sequence outside save_for_backward, or gradient checkpointing could not free it
        ctx.layout, ctx.window, ctx.scale, ctx.states, ctx.sliding = layout, window, scale, states, sliding
        return out.transpose(1, 2)  # (1, N, H, D), as transformers' attention functions return

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, sinks, out, lse, lse_prompt = ctx.saved_tensors
        layout, window, scale = ctx.layout, ctx.window, ctx.scale
        groups, length = layout.split.groups, layout.prompt_length
        rows, row_length, n_prompt = layout.rows, layout.row_length, layout.prompt_tokens
        grad = grad_out.transpose(1, 2)  # (1, H, N, D)
        grad_q, grad_k, grad_v = (_token_major(x, x.shape[1], x.shape[2], x.shape[3]) for x in (query, key, value))
        rows_of = lambda x: _blocks(x, n_prompt, rows, row_length)  # noqa: E731
        lse_rows = _blocks(lse, 0, rows, row_length)
        sink_grad = ctx.needs_input_grad[3]  # not for frozen sinks (a PEFT policy's)
        grad_sinks = sink_gradient(rows_of(grad), rows_of(out), lse_rows, sinks) if sink_grad else None
        if length == 0:
            parts = band_backward(ctx.states, rows_of(grad), rows_of(query), rows_of(key), rows_of(value),
                                  rows_of(out), lse_rows, window, scale)  # fmt: skip
            for target, part in zip((grad_q, grad_k, grad_v), parts, strict=True):
                rows_of(target).copy_(part)
            return grad_q, grad_k, grad_v, grad_sinks, None, None, None, None
        prompt = tuple(_blocks(x, 0, groups, length) for x in (query, key, value))
        grad_prompt, out_prompt = _blocks(grad, 0, groups, length), _blocks(out, 0, groups, length)
        if sink_grad:
            grad_sinks = grad_sinks + sink_gradient(grad_prompt, out_prompt, lse_prompt, sinks)
        blocks = _image_blocks_bias(layout, window, ctx.sliding, query.dtype)
        if blocks is None:
            prompt_grads = band_backward(ctx.prompt_state, grad_prompt, *prompt, out_prompt, lse_prompt, window, scale)
        else:
            prompt_grads = attention_backward(ctx.prompt_state, grad_prompt, *prompt, blocks, out_prompt, lse_prompt,
                                              False, scale)  # fmt: skip
        prefix = _prefix_of(layout, key, value, window, query.dtype)  # again: views, or the tail gathered again
        grad_pk, grad_pv, grad_kr, grad_vr = _split_backward(
            rows_of(grad_q), rows_of(grad), rows_of(out), lse_rows, rows_of(query), prefix, rows_of(key),
            rows_of(value), layout.split, window, scale, ctx.states,
        )  # fmt: skip
        for target, prompt_part in zip((grad_q, grad_k, grad_v), prompt_grads, strict=True):
            _blocks(target, 0, groups, length).copy_(prompt_part)
        rows_of(grad_k).copy_(grad_kr)
        rows_of(grad_v).copy_(grad_vr)
        if prefix.tail is None:  # the whole body was read
            _blocks(grad_k, 0, groups, length).add_(grad_pk)
            _blocks(grad_v, 0, groups, length).add_(grad_pv)
        else:  # its tail, gathered
            scatter_tail(grad_k, grad_pk, prefix.tail)
            scatter_tail(grad_v, grad_pv, prefix.tail)
        return grad_q, grad_k, grad_v, grad_sinks, None, None, None, None


def _image_blocks_bias(layout: PackedLayout, window: int | None, sliding: bool, dtype) -> torch.Tensor | None:
    """The bodies' `(G, 1, Pm, Pm)` bias where an image's tokens attend to each other both ways on this layer (built
    once per batch for every layer alike), or None where the bodies attend causally."""
    if layout.body_blocks is None or (layout.blocks_on == "sliding" and not sliding):
        return None
    key = ("image blocks", window, dtype)
    if key not in layout.memo:
        layout.memo[key] = block_bias(layout.body_blocks, window, dtype)
    return layout.memo[key]


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
        _split_into(out, lse, query, _Prefix(prefix_key, prefix_value, prefix_bias), key, value, split, False, None,
                    scale, own_bias)  # fmt: skip
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
    if hasattr(module, "expand_kv"):  # multi-head latent attention: the prompt is cached as latents, expanded here
        prefix_key, prefix_value = module.expand_kv(prefix_key, prefix_value)  # as the module expands its own
    prefix_key, prefix_value = _compute_dtype(query, prefix_key, prefix_value)[1:]
    prefix_bias, own_bias = layer.prefix_bias, None
    if window is not None:
        window_bias, own_bias = decode_window_biases(layer.prefix_columns, prefix_key.shape[2], layer.own_length,
                                                     key.shape[2], window, query.dtype, query.device)  # fmt: skip
        if window_bias is not None:  # both mask with the dtype's minimum: keep one, not their sum (-inf)
            prefix_bias = window_bias if prefix_bias is None else torch.minimum(prefix_bias, window_bias)
    query, key, value, prefix_key, prefix_value = _one_head_dim(query, key, value, prefix_key, prefix_value)
    return split_attention(query, prefix_key, prefix_value, key, value, cache.split, scale, prefix_bias, own_bias,
                           sinks)  # fmt: skip


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
    cache = _decoding.get() if layout is None else None
    if layout is None and cache is None:
        return _base_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if dropout:
        raise ValueError(f"{ATTENTION_NAME!r} attention has no dropout: disable it (disable_dropout=True).")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{ATTENTION_NAME!r} attention cannot apply softcap: this model needs its own attention.")
    sinks = kwargs.get("s_aux")  # GPT-OSS: one logit per head
    window = kwargs.get("sliding_window")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    query, key, value = _compute_dtype(query, key, value)
    value_dim = value.shape[-1]
    if layout is not None:
        sliding = window is not None  # a sliding layer (Gemma 4's image blocks attend both ways only there)
        if window is not None and window >= layout.span:  # every key any query may read is within the window
            window = None
        out = _PackedAttention.apply(*_one_head_dim(query, key, value), sinks, layout, window, scale, sliding)
    else:
        out = _decode_attention(module, query, key, value, cache, window, sinks, scale)
    return (out if out.shape[-1] == value_dim else out[..., :value_dim]), None


def _compute_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """
    The tensors in one dtype, as scaled_dot_product_attention gets them: under autocast its lower precision (autocast
    casts SDPA's inputs; rotary embeddings leave queries and keys in float32 while values are in bf16), else the
    query's. Differentiable; no copy where the dtype already matches.
    """
    device_type = tensors[0].device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else tensors[0].dtype
    return tuple(tensor if tensor.dtype == dtype else tensor.to(dtype) for tensor in tensors)


AttentionInterface.register(ATTENTION_NAME, prefix_attention)


def _attention_modules(model: nn.Module):
    text_config = model.config.get_text_config()
    for module in model.modules():
        if hasattr(module, "_rloo_base_config"):
            yield module
        elif getattr(module, "config", None) is text_config and hasattr(module, "layer_idx") and hasattr(
            module, "num_key_value_groups"
        ):
            yield module


def install(model: nn.Module) -> int:
    """
    Points every attention module of `model` at [`prefix_attention`] (idempotent, and free once done) and returns
    how many there are; a hybrid model's recurrent layers are routed to their forks too ([`recurrent.install`]). The
    modules get a copy of the config naming it; `model.config` is untouched, and calls without a layout run the
    model's own implementation, so nothing changes for code that does not pass one.
    """
    count = getattr(model, "_rloo_prefix_attention_modules", None)
    if count is not None:
        return count
    from .recurrent import install as install_forks  # here: recurrent.py imports this module

    install_forks(model)
    count = 0
    for module in _attention_modules(model):
        if not hasattr(module, "_rloo_base_config"):
            proxy = copy.copy(module.config)
            proxy._attn_implementation_internal = ATTENTION_NAME
            module._rloo_base_config, module.config = module.config, proxy
        count += 1
    model._rloo_prefix_attention_modules = count
    return count


def installed(model: nn.Module) -> bool:
    return any(hasattr(module, "_rloo_base_config") for module in model.modules())


@contextlib.contextmanager
def decoding_with(cache):
    """Within the block, installed attention modules decode from `cache` (a [`prefix_cache.PrefixCache`])."""
    token = _decoding.set(cache)
    try:
        yield
    finally:
        _decoding.reset(token)
