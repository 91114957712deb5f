"""
Attention that also returns its log-sum-exp, forward and backward, on the fused kernel each device has.

[`prefix_attention`] splits a completion's attention into two parts (its prompt, stored once per group, and its own
tokens) and merges them by log-sum-exp. The merge needs each part's log-sum-exp, which `scaled_dot_product_attention`
does not return, so the parts call the kernels underneath it:

- CPU: `aten._scaled_dot_product_flash_attention_for_cpu` (any float dtype, grouped-query heads, an additive mask);
- CUDA, half precision without a mask: `aten._scaled_dot_product_flash_attention`;
- CUDA otherwise: `aten._scaled_dot_product_efficient_attention` (float32, an additive mask);
- anywhere else, or where a kernel fails its first-use check: [`math_attention`], which materializes the scores.

The backward is the kernels' own, called with the MERGED output and log-sum-exp (as ring attention does): then each
part's gradients are exactly its share of the gradients of attention over the concatenated keys, and the sum over the
parts is the full gradient. Shapes: `query` (B, H, Lq, D), `key`/`value` (B, Hkv, Lk, D) with H a multiple of Hkv
(head h reads key/value head h // (H // Hkv)); `bias` None or additive, broadcastable to (B, 1, Lq, Lk) in the
query's dtype; `lse` (B, H, Lq). `causal` aligns the first query with the first key (Lq == Lk where it is used).
"""

import warnings
from dataclasses import dataclass, field

import torch


aten = torch.ops.aten


@dataclass
class KernelState:
    """What a kernel's backward needs from its forward beyond the tensors (random-number state, padded shapes)."""

    kernel: str
    extra: tuple = field(default_factory=tuple)


# -- the math reference ----------------------------------------------------------------------------------------------
def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _scores(query, key, bias, causal, scale):
    scores = torch.matmul(query, _expand_heads(key, query.shape[1]).transpose(-1, -2)).mul_(scale)
    if bias is not None:
        scores = scores + bias
    if causal:
        lq, lk = scores.shape[-2:]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return scores


def math_attention(query, key, value, bias, causal, scale):
    """(output, lse) with materialized scores, in float32 at least: the reference the kernels are checked against."""
    work = torch.promote_types(query.dtype, torch.float32)
    q, k, v = query.to(work), key.to(work), value.to(work)
    scores = _scores(q, k, None if bias is None else bias.to(work), causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), _expand_heads(v, q.shape[1]))
    return out.to(query.dtype), lse


def _math_backward(grad_out, query, key, value, bias, out, lse, causal, scale):
    work = torch.promote_types(query.dtype, torch.float32)
    q, k, v, g, o = (x.to(work) for x in (query, key, value, grad_out, out))
    heads, kv_heads = q.shape[1], k.shape[1]
    probs = torch.exp(_scores(q, k, None if bias is None else bias.to(work), causal, scale) - lse.to(work).unsqueeze(-1))
    grad_v = torch.matmul(probs.transpose(-1, -2), g)
    grad_p = torch.matmul(g, _expand_heads(v, heads).transpose(-1, -2))
    grad_s = probs * (grad_p - (g * o).sum(-1, keepdim=True))
    grad_q = torch.matmul(grad_s, _expand_heads(k, heads)) * scale
    grad_k = torch.matmul(grad_s.transpose(-1, -2), q) * scale
    if heads != kv_heads:  # sum the query heads that share a key/value head
        grad_k = grad_k.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
        grad_v = grad_v.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
    return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)


# -- the kernels -----------------------------------------------------------------------------------------------------
def _kernel_name(query: torch.Tensor, bias: torch.Tensor | None) -> str:
    if query.device.type == "cpu":
        return "cpu_flash"
    if query.device.type == "cuda":
        if bias is None and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
            return "cuda_flash"
        if query.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return "cuda_efficient"
    return "math"


def _aligned_bias(bias: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The efficient kernel reads a (B, H, Lq, Lk) bias whose rows start 16-element aligned: pad, slice, expand."""
    length = bias.shape[-1]
    padded = torch.nn.functional.pad(bias, (0, -length % 16))[..., :length]
    return padded.expand(query.shape[0], query.shape[1], query.shape[2], length)


def _forward(kernel, query, key, value, bias, causal, scale):
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, attn_mask=bias, scale=scale
        )
        return out, lse, KernelState(kernel)
    if kernel == "cuda_flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, causal, False, scale=scale
        )
        return out, lse, KernelState(kernel, (cum_q, cum_k, max_q, max_k, seed, offset))
    if kernel == "cuda_efficient":
        heads = query.shape[1]
        key, value = _expand_heads(key, heads), _expand_heads(value, heads)  # this kernel has no grouped heads
        full_bias = None if bias is None else _aligned_bias(bias, query, key)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            query, key, value, full_bias, True, 0.0, causal, scale=scale
        )
        # Its log-sum-exp may be padded along the queries: the backward wants it back in that shape
        return out, lse[..., : query.shape[2]], KernelState(kernel, (lse.shape, seed, offset))
    out, lse = math_attention(query, key, value, bias, causal, scale)
    return out, lse, KernelState("math")


def _backward(state, grad_out, query, key, value, bias, out, lse, causal, scale):
    kernel = state.kernel
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    if kernel == "cuda_flash":
        cum_q, cum_k, max_q, max_k, seed, offset = state.extra
        # The kernel reads the log-sum-exp as contiguous (B, H, L) whatever its strides; the packed one is token-major
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, key, value, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
    if kernel == "cuda_efficient":
        lse_shape, seed, offset = state.extra
        heads, kv_heads = query.shape[1], key.shape[1]
        full_lse = lse.new_zeros(lse_shape)
        full_lse[..., : lse.shape[-1]] = lse
        full_bias = None if bias is None else _aligned_bias(bias, query, key)
        grad_q, grad_k, grad_v, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, query, _expand_heads(key, heads), _expand_heads(value, heads), full_bias, out, full_lse, seed,
            offset, 0.0, [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        if heads != kv_heads:
            grad_k = grad_k.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
            grad_v = grad_v.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
        return grad_q, grad_k, grad_v
    return _math_backward(grad_out, query, key, value, bias, out, lse, causal, scale)


# -- first-use check -------------------------------------------------------------------------------------------------
_verified: dict[tuple, bool] = {}


def _kernel_works(kernel: str, query: torch.Tensor, bias: torch.Tensor | None, causal: bool) -> bool:
    """
    Whether `kernel` matches [`math_attention`] (forward, log-sum-exp and backward) on a small problem of the same
    device, dtype, head layout and mask kind. Runs once per combination; the CPU kernel is covered by the test suite.
    A kernel that raises or disagrees is replaced by the math path, with one warning.
    """
    if kernel == "cpu_flash":
        return True
    key = (kernel, query.device, query.dtype, query.shape[-1], bias is not None, causal)
    if kernel == "math":  # no fused kernel for this device or dtype: say so once
        if key not in _verified:
            _verified[key] = True
            warnings.warn(f"rloo_efficient: no fused attention kernel for {query.device.type} ({query.dtype}); prefix "
                          "attention uses the math path there (its scores in memory).", stacklevel=4)  # fmt: skip
        return True
    if key not in _verified:
        _verified[key] = _check(kernel, query.device, query.dtype, query.shape[-1], bias is not None, causal)
        if not _verified[key]:
            warnings.warn(
                f"rloo_efficient: the {kernel} attention kernel did not match the reference on {query.device} "
                f"({query.dtype}); prefix attention uses the slower math path there.",
                stacklevel=4,
            )
    return _verified[key]


def _check(kernel, device, dtype, dim, with_bias, causal) -> bool:
    generator = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):  # (B, L, H, D) laid out, used transposed, as the model hands them over
        return torch.randn(*shape, generator=generator).to(device, dtype).transpose(1, 2)

    q, k, v, g = rand(2, 24, 4, dim), rand(2, 24, 2, dim), rand(2, 24, 2, dim), rand(2, 24, 4, dim)
    bias = None
    if with_bias:
        bias = torch.zeros(2, 1, 1, 24, dtype=dtype, device=device)
        bias[0, ..., -5:] = torch.finfo(dtype).min
    scale = dim**-0.5
    try:
        out, lse, state = _forward(kernel, q, k, v, bias, causal, scale)
        token_major = lse.transpose(1, 2).contiguous().transpose(1, 2)  # as the packed forward keeps it
        grads = _backward(state, g, q, k, v, bias, out, token_major, causal, scale)
    except RuntimeError:
        return False
    ref_out, ref_lse = math_attention(q, k, v, bias, causal, scale)
    ref_grads = _math_backward(g, q, k, v, bias, ref_out, ref_lse, causal, scale)
    tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    pairs = [(out, ref_out), (lse, ref_lse), *zip(grads, ref_grads, strict=True)]
    return all(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol) for a, b in pairs)


# -- the entry points ------------------------------------------------------------------------------------------------
def _bias_in(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The bias in the query's dtype; its masking value clamped to that dtype's range (another dtype's minimum would
    overflow to -inf, and a row with every key masked would turn NaN)."""
    if bias is None or bias.dtype == dtype:
        return bias
    return bias.to(dtype).clamp(min=torch.finfo(dtype).min)


def attention_forward(query, key, value, bias, causal: bool, scale: float):
    """`(output, lse, state)`: attention of `query` over `key`/`value` (see the module docstring for shapes)."""
    bias = _bias_in(bias, query.dtype)
    kernel = _kernel_name(query, bias)
    if not _kernel_works(kernel, query, bias, causal):
        kernel = "math"
    return _forward(kernel, query, key, value, bias, causal, scale)


def attention_backward(state: KernelState, grad_out, query, key, value, bias, out, lse, causal: bool, scale: float):
    """`(grad_query, grad_key, grad_value)` given the output and log-sum-exp of the whole (merged) attention."""
    return _backward(state, grad_out, query, key, value, _bias_in(bias, query.dtype), out, lse, causal, scale)
