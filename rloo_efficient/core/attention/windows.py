"""
Sliding windows and attention sinks in the prefix-attention backend ([`attention.backend`]).

A sliding window `w` lets the token at position p attend to the keys at positions (p - w, p] (transformers'
`sliding_window_overlay`). Every part of the attention keeps its shape:

- causal blocks (a prefix tree's nodes, [`attention.tree`]) longer than the window: flash applies the window itself
  on CUDA (its variable-length entry point, the blocks as sequences); elsewhere [`band_forward`] splits the run of
  blocks into chunks of `w` queries, each reading the `2w - 1` keys that can reach it as an overlapping view of a
  copy of the keys, with one (chunks, 1, w, 2w - 1) mask for the band and the block boundaries: memory linear in the
  run, no (L, L) mask;
- a node read by its subtree: only its last `w - 1` tokens can be in any descendant's window, gathered once per node
  and masked per query by position ([`attention.tree`]);
- decoding from the prompt stored once per group: one mask per step over the stored prompt and one over the row's own
  tokens ([`decode_window_biases`]).

An attention sink (GPT-OSS: one learned logit per head) takes softmax mass and adds no value: with a part's output
`o` and log-sum-exp `l`, the output is `o sigmoid(l - s)` and the log-sum-exp `logaddexp(l, s)` ([`apply_sinks`]).
It is one more key with a zero value, so the kernels' backward, given that output and log-sum-exp, gives the other
keys' gradients unchanged; the sink's own is `-sum over queries of sigmoid(s - l') (dO . O')` ([`sink_gradient`]).
"""

import math
from dataclasses import dataclass

import torch

from .checks import attention_backward, attention_forward, windowed_backward, windowed_forward
from .kernels import KernelState


# -- causal blocks under a window --------------------------------------------------------------------------------------
@dataclass
class BandState:
    kernel: KernelState | None  # the call that ran (None: none to reuse, the chunks' backward runs their forward)
    chunks: int = 0  # 0: one causal call over the blocks (plain, or flash's windowed); else the chunks with a mask


def _flat(x: torch.Tensor, front: int, total: int) -> torch.Tensor:
    """Blocks `(B, h, L, *rest)` as one token-major run `(1, h, front + total, *rest)`: `front` zeros, then the B * L
    tokens, then zeros up to `total` (a copy)."""
    blocks, heads, length, *rest = x.shape
    run = x.new_zeros((front + total, heads, *rest))
    run.narrow(0, front, blocks * length).copy_(x.transpose(1, 2).reshape(blocks * length, heads, *rest))
    return run.unsqueeze(0).transpose(1, 2)


def _windows(run: torch.Tensor, chunks: int, step: int, width: int) -> torch.Tensor:
    """`(1, h, T, *rest)` token-major -> `(chunks, h, width, *rest)`: chunk j reads tokens [j step, j step + width),
    an overlapping view."""
    _, heads, _, *rest = run.shape
    _, head_stride, token_stride, *rest_strides = run.stride()
    strides = (step * token_stride, head_stride, token_stride, *rest_strides)
    return run.as_strided((chunks, heads, width, *rest), strides, run.storage_offset())


def _unflat(chunked: torch.Tensor, blocks: int, length: int) -> torch.Tensor:
    """`(chunks, h, c, *rest)` -> blocks `(B, h, L, *rest)` (the first B * L tokens)."""
    chunks, heads, c, *rest = chunked.shape
    tokens = chunked.transpose(1, 2).reshape(chunks * c, heads, *rest)[: blocks * length]
    return tokens.view(blocks, length, heads, *rest).transpose(1, 2)


def _band_bias(chunks: int, window: int, blocks: int, length: int, dtype, device) -> torch.Tensor:
    """`(chunks, 1, w, 2w - 1)`: query `a` of chunk j (token j w + a of the run) may read key `m` of its window (token
    j w + m - (w - 1)) when that key is in the run, in the query's block, and `a <= m <= a + w - 1` (causal, and within
    the window)."""
    c, width = window, 2 * window - 1
    query = torch.arange(chunks * c, device=device).view(chunks, 1, c, 1)
    key = (torch.arange(chunks, device=device) * c).view(chunks, 1, 1, 1) + torch.arange(width, device=device) - (
        window - 1)  # fmt: skip
    total = blocks * length
    allowed = (key >= 0) & (key < total) & (key // length == query // length) & (key <= query) & (key > query - window)
    return torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def band_forward(query, key, value, window: int | None, scale: float):
    """
    Blocks `query` (B, H, L, D), `key`/`value` (B, Hkv, L, D), each attending causally within itself, with keys
    in (i - w, i] under a `window`. Returns `(out, lse, state)` in the blocks' shapes.
    """
    blocks, heads, length, dim = query.shape
    if window is None or length <= window:  # every key in the block is within the window
        out, lse, state = attention_forward(query, key, value, None, True, scale)
        return out, lse, BandState(state)
    windowed = windowed_forward(query, key, value, scale, window)  # flash on CUDA applies the window itself
    if windowed is not None:
        out, lse, state = windowed
        return out, lse, BandState(state)
    chunks = math.ceil(blocks * length / window)
    q, k, v, bias = _chunked(query, key, value, chunks, window)
    out, lse, state = attention_forward(q, k, v, bias, False, scale)
    return _unflat(out, blocks, length), _unflat(lse, blocks, length), BandState(state, chunks)


def _chunked(query, key, value, chunks: int, window: int):
    """The blocks' queries as `chunks` of `w`, the keys and values each chunk can reach as overlapping windows of
    `2w - 1`, and their mask."""
    blocks, _, length, _ = query.shape
    total = chunks * window
    q = _windows(_flat(query, 0, total), chunks, window, window)
    k, v = (_windows(_flat(x, window - 1, total), chunks, window, 2 * window - 1) for x in (key, value))
    return q, k, v, _band_bias(chunks, window, blocks, length, query.dtype, query.device)


def band_backward(band: BandState, grad, query, key, value, out, lse, window: int | None, scale: float):
    """Gradients of [`band_forward`] given the (merged) output and log-sum-exp of the blocks."""
    blocks, heads, length, dim = query.shape
    if band.chunks == 0:
        if band.kernel.window is None:
            return attention_backward(band.kernel, grad, query, key, value, None, out, lse, True, scale)
        grads = windowed_backward(band.kernel, grad, query, key, value, out, lse, scale)
        if grads is not None:
            return grads
        band = BandState(None, math.ceil(blocks * length / window))  # its kernel raised: the chunks instead
    chunks, total = band.chunks, band.chunks * window
    q, k, v, bias = _chunked(query, key, value, chunks, window)
    kernel = band.kernel
    if kernel is None:  # the forward ran another kernel: the chunks' own state, from their forward
        kernel = attention_forward(q, k, v, bias, False, scale)[2]
    g, o = (_windows(_flat(x, 0, total), chunks, window, window) for x in (grad, out))
    l = _windows(_flat(lse.unsqueeze(-1), 0, total), chunks, window, window).squeeze(-1)  # noqa: E741
    grad_q, grad_k, grad_v = attention_backward(kernel, g, q, k, v, bias, o, l, False, scale)

    def fold(windows):  # (chunks, Hkv, 2w - 1, D) per chunk -> the run's keys: each key is in two chunks' windows
        run = windows.new_zeros((window - 1 + total, windows.shape[1], dim))
        own = run[window - 1 :].view(chunks, window, windows.shape[1], dim)
        own.copy_(windows[:, :, window - 1 :].transpose(1, 2))
        # the w - 1 keys before each chunk, read by it again: non-overlapping strided slots (w - 1 <= w)
        before = run.as_strided((chunks, window - 1, windows.shape[1], dim),
                                (window * run.stride(0), run.stride(0), run.stride(1), 1))  # fmt: skip
        before.add_(windows[:, :, : window - 1].transpose(1, 2))
        return run[window - 1 : window - 1 + blocks * length].view(blocks, length, -1, dim).transpose(1, 2)

    return _unflat(grad_q, blocks, length), fold(grad_k), fold(grad_v)


# -- decoding under a window -----------------------------------------------------------------------------------------
def decode_window_biases(prefix_columns: int, stored: int, own: int, read: int, window: int, dtype, device):
    """
    `(prefix_bias, own_bias)`, each `(1, 1, 1, L)` or None when every key is in the window: the step's query sits at
    position `prefix_columns + own - 1`; the stored prompt holds the last `stored` of the prompt's `prefix_columns`
    positions, and the row's keys read are the last `read` of its `own` decoded positions after them.
    """
    first = prefix_columns + own - window  # the first position in the window
    biases = []
    for start, length in ((prefix_columns - stored, stored), (prefix_columns + own - read, read)):
        hidden = first - start  # keys of this part before the window
        if hidden <= 0:
            biases.append(None)
            continue
        allowed = torch.arange(length, device=device) >= hidden
        bias = torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        biases.append(bias.view(1, 1, 1, length))
    return tuple(biases)


# -- sinks -----------------------------------------------------------------------------------------------------------
def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """In place: `out` (B, H, L, D) and `lse` (B, H, L) of attention without the sinks -> with them."""
    sinks = sinks.to(lse.dtype).view(1, -1, 1)
    weight = torch.sigmoid(lse - sinks).unsqueeze(-1)
    if out.dtype == weight.dtype:
        out.mul_(weight)
    else:  # half precision: scaled in float32, as the kernels accumulate
        out.copy_(out.float() * weight)
    torch.logaddexp(lse, sinks, out=lse)


def sink_gradient(grad: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """`(H,)`: the sinks' gradient from queries with output gradient `grad` and output `out` (B, H, L, D), and the
    log-sum-exp `lse` (B, H, L), all with the sinks."""
    delta = (grad.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (B, H, L)
    share = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)  # the sink's probability
    return -(share * delta).sum(dim=(0, 2))


def block_bias(blocks: torch.Tensor, window: int | None, dtype) -> torch.Tensor:
    """`(n, 1, L, L)` additive, from each block's tokens' image blocks `(n, L)` (-1 for text): token i sees token j when
    j <= i or both are in one image, and under a sliding `window` only when j is also within it (stock's mask: (causal
    or same image) and window)."""
    length = blocks.shape[1]
    i = torch.arange(length, device=blocks.device).view(-1, 1)
    allowed = (torch.arange(length, device=blocks.device) <= i) | (
        (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0))  # fmt: skip
    if window is not None:
        allowed &= torch.arange(length, device=blocks.device) > i - window
    return torch.zeros((), dtype=dtype, device=blocks.device).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
