"""
Attention over sequences of several lengths packed one after another, each with its own number of queries and keys:
the packed forward's nodes (causal, queries = keys) and each tree level's keys read by the subtrees below them
([`attention.tree`]), without the padding of length buckets.

Shapes: `query` (Tq, H, D), `key`/`value` (Tk, Hkv, D); `cu_q`/`cu_k` (n + 1,) int32 offsets of each sequence's queries
and keys; `max_q`/`max_k` the longest (host ints); output (Tq, H, D), `lse` (H, Tq) float32 (flash's layout). On CUDA
flash's variable-length entry point (`aten._flash_attention_forward` with `cum_seq_q`/`cum_seq_k`: grouped-query heads
native, a causal call aligned at each sequence's last query and key (its first where they are as many: a sequence
whose keys open with a held prompt's reads all of it), a sliding window); the math reference
("math_varlen", sequence by sequence) is the first-use check's reference ([`attention.checks.check_varlen`]) and the
backward's fallback. The backward, as the dense kernels', takes the merged output and log-sum-exp.
"""

import torch

from .kernels import KernelState, choose_kernel, math_attention, math_backward, window_bias


aten = torch.ops.aten


def varlen_kernel(query: torch.Tensor) -> str | None:
    """The variable-length kernel for calls on `query`'s device and dtype: flash's, where [`choose_kernel`] picks flash
    (CUDA, half precision, head_dim a multiple of 8 up to 256); None elsewhere (the caller pads length buckets)."""
    return "cuda_flash_varlen" if choose_kernel(query, None) == "cuda_flash" else None


def _sequences(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """`(q_slice, k_slice)` of each packed sequence (a host read: the reference only)."""
    q, k = cu_q.tolist(), cu_k.tolist()
    return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(q[:-1], q[1:], k[:-1], k[1:], strict=True)]


def _sequence(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """Packed `(T, h, ...)` rows -> `(1, h, L, ...)`."""
    return x[rows].transpose(0, 1).unsqueeze(0)


def math_varlen_forward(query, key, value, cu_q, cu_k, causal, scale, window=None):
    """`(out, lse)` of packed sequences from [`math_attention`], one sequence at a time."""
    outs, lses = [], []
    for rows, keys in _sequences(cu_q, cu_k):
        bias = window_bias(rows.stop - rows.start, window, torch.promote_types(query.dtype, torch.float32),
                           query.device, keys.stop - keys.start)  # fmt: skip
        out, lse = math_attention(_sequence(query, rows), _sequence(key, keys), _sequence(value, keys), bias, causal,
                                  scale)  # fmt: skip
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)  # lse in float32 at least, as the kernels'


def math_varlen_backward(grad_out, query, key, value, out, lse, cu_q, cu_k, causal, scale, window=None):
    """The gradients of packed sequences given the (merged) output and `lse` (H, Tq), one sequence at a time."""
    grad_q, grad_k, grad_v = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for rows, keys in _sequences(cu_q, cu_k):
        bias = window_bias(rows.stop - rows.start, window, torch.promote_types(query.dtype, torch.float32),
                           query.device, keys.stop - keys.start)  # fmt: skip
        grads = math_backward(_sequence(grad_out, rows), _sequence(query, rows), _sequence(key, keys),
                              _sequence(value, keys), bias, _sequence(out, rows), lse[None, :, rows], causal,
                              scale)  # fmt: skip
        for target, grad, at in zip((grad_q, grad_k, grad_v), grads, (rows, keys, keys), strict=True):
            target[at] = grad[0].transpose(0, 1)
    return grad_q, grad_k, grad_v


def _rows_dense(x: torch.Tensor) -> torch.Tensor:
    """Flash reads each packed row with unit stride along the head dim: a copy only where it is not."""
    return x if x.stride(-1) == 1 else x.contiguous()


def varlen_forward(kernel: str, query, key, value, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                   window: int | None = None, config: tuple = ()):  # fmt: skip
    """`(out, lse, state)` of packed sequences (see above); `window`: keys in (i - w, i] of a causal call."""
    if kernel == "cuda_flash_varlen":
        left, right = (None, None) if window is None else (window - 1, 0)
        out, lse, rng_state, unused, _ = aten._flash_attention_forward(
            _rows_dense(query), _rows_dense(key), _rows_dense(value), cu_q, cu_k, max_q, max_k, 0.0, causal, False,
            scale=scale, window_size_left=left, window_size_right=right,
        )  # fmt: skip
        extra = (cu_q, cu_k, max_q, max_k, rng_state, unused)
    else:
        out, lse = math_varlen_forward(query, key, value, cu_q, cu_k, causal, scale, window)
        kernel, extra = "math_varlen", (cu_q, cu_k)
    return out, lse, KernelState(kernel, config, extra, window=window)


def varlen_backward(state: KernelState, grad_out, query, key, value, out, lse, causal: bool, scale: float):
    """The gradients of [`varlen_forward`]'s sequences given the merged output and log-sum-exp `lse` (H, Tq)."""
    if state.kernel == "cuda_flash_varlen":
        cu_q, cu_k, max_q, max_k, rng_state, unused = state.extra
        left, right = (None, None) if state.window is None else (state.window - 1, 0)
        return aten._flash_attention_backward(
            _rows_dense(grad_out), _rows_dense(query), _rows_dense(key), _rows_dense(value), _rows_dense(out),
            lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale,
            window_size_left=left, window_size_right=right,
        )  # fmt: skip
    cu_q, cu_k = state.extra[:2]
    return math_varlen_backward(grad_out, query, key, value, out, lse, cu_q, cu_k, causal, scale, state.window)


