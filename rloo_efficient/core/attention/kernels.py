"""
Attention that also returns its log-sum-exp, forward and backward, on the fused kernel each device has.

[`attention.tree`] and [`attention.backend`]'s decoding split attention into parts (a node's own tokens, each ancestor
read by its subtree; a prompt stored once per group and a row's own tokens) and merge them by log-sum-exp. The merge
needs each part's log-sum-exp, which `scaled_dot_product_attention` does not return, so the parts call the kernels
underneath it ([`choose_kernel`], after PyTorch's own `sdp_utils.cpp`):

- CPU: `aten._scaled_dot_product_flash_attention_for_cpu` (any float dtype, grouped-query heads, an additive mask);
- CUDA, half precision without a mask, sm80 to sm121, head_dim a multiple of 8 up to 256:
  `aten._scaled_dot_product_flash_attention` (grouped-query heads native), and for a causal call under a sliding
  window `aten._flash_attention_forward`, which takes the window;
- CUDA otherwise (float32, a mask, older GPUs), sm50 to sm121, head_dim aligned for its GEMMs:
  `aten._scaled_dot_product_efficient_attention`. It has no grouped-query heads: for non-causal calls whose mask
  depends on the key only (a prompt's keys read by its completions, decoding) the query heads that share a key/value
  head are folded into the query length instead of copying the keys and values to every query head;
- anywhere else: [`math_attention`], which materializes the scores.

Sequences of several lengths packed one after another (the prefix tree's nodes; each tree level's keys read by their
subtrees) go to flash's variable-length entry point on CUDA ([`attention.varlen`]), with no padding.

[`attention.checks`] checks each configuration at its first use and falls back to the math path where a kernel fails.

The backward is the kernels' own, called with the MERGED output and log-sum-exp (as ring attention does): then each
part's gradients are exactly its share of the gradients of attention over the concatenated keys, and the sum over the
parts is the full gradient. Shapes: `query` (B, H, Lq, D), `key`/`value` (B, Hkv, Lk, D) with H a multiple of Hkv
(head h reads key/value head h // (H // Hkv)); `bias` None or additive, broadcastable to (B, 1, Lq, Lk) in the
query's dtype; `lse` (B, H, Lq). `causal` aligns the first query with the first key (Lq == Lk where it is used).
"""

import functools
from dataclasses import dataclass, field

import torch


aten = torch.ops.aten


# -- the math reference ----------------------------------------------------------------------------------------------
def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _scores(query, key, bias, causal, scale, softcap=None):
    """The scores, and with `softcap` (Gemma 2: `c tanh(s / c)` before the mask) their slope `1 - tanh^2` (else
    None)."""
    scores = torch.matmul(query, _expand_heads(key, query.shape[1]).transpose(-1, -2)).mul_(scale)
    slope = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        slope = 1 - capped * capped
        scores = capped * softcap
    if bias is not None:
        scores = scores + bias
    if causal:  # aligned at the last query and key, as flash's (the same as the first where lq == lk)
        lq, lk = scores.shape[-2:]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril(lk - lq)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return scores, slope


def math_attention(query, key, value, bias, causal, scale, softcap=None):
    """(output, lse) with materialized scores, in float32 at least: the reference the kernels are checked against, and
    the one path with a `softcap` (no fused kernel of PyTorch's applies one)."""
    work = torch.promote_types(query.dtype, torch.float32)
    q, k, v = query.to(work), key.to(work), value.to(work)
    scores, _ = _scores(q, k, None if bias is None else bias.to(work), causal, scale, softcap)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), _expand_heads(v, q.shape[1]))
    return out.to(query.dtype), lse


def math_backward(grad_out, query, key, value, bias, out, lse, causal, scale, softcap=None):
    work = torch.promote_types(query.dtype, torch.float32)
    q, k, v, g, o = (x.to(work) for x in (query, key, value, grad_out, out))
    heads, kv_heads = q.shape[1], k.shape[1]
    scores, slope = _scores(q, k, None if bias is None else bias.to(work), causal, scale, softcap)
    probs = torch.exp(scores - lse.to(work).unsqueeze(-1))
    grad_v = torch.matmul(probs.transpose(-1, -2), g)
    grad_p = torch.matmul(g, _expand_heads(v, heads).transpose(-1, -2))
    grad_s = probs * (grad_p - (g * o).sum(-1, keepdim=True))
    if slope is not None:  # through the cap: d(c tanh(s / c)) / ds
        grad_s = grad_s * slope
    grad_q = torch.matmul(grad_s, _expand_heads(k, heads)) * scale
    grad_k = torch.matmul(grad_s.transpose(-1, -2), q) * scale
    if heads != kv_heads:  # sum the query heads that share a key/value head
        grad_k = grad_k.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
        grad_v = grad_v.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
    return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)


# -- which kernel ----------------------------------------------------------------------------------------------------
# PyTorch's hardware ranges for its flash and memory-efficient kernels (aten/src/ATen/native/transformers/cuda/
# sdp_utils.cpp: check_flash_attention_hardware_support, check_mem_efficient_hardware_support)
FLASH_CAPABILITY = ((8, 0), (12, 1))
EFFICIENT_CAPABILITY = ((5, 0), (12, 1))
HALF = (torch.float16, torch.bfloat16)


@functools.cache
def device_capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device `index` (once per device)."""
    return torch.cuda.get_device_capability(index)


def choose_kernel(query: torch.Tensor, bias: torch.Tensor | None) -> str:
    """The fused kernel for a call, by device, dtype, head_dim, mask and compute capability ("math" when none)."""
    device, dtype, dim = query.device, query.dtype, query.shape[-1]
    if device.type == "cpu":
        return "cpu_flash"
    if device.type != "cuda":
        return "math"
    capability = device_capability(device.index if device.index is not None else torch.cuda.current_device())
    half = dtype in HALF
    # Flash's backward raises for head_dim in (192, 224] on sm86-89 and sm120-121
    flash_backward_fails = 192 < dim <= 224 and ((8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1))
    low, high = FLASH_CAPABILITY
    if half and bias is None and low <= capability <= high and dim % 8 == 0 and dim <= 256 and not flash_backward_fails:
        return "cuda_flash"
    # The efficient kernel's GEMMs need head_dim aligned: 8 elements in half precision on tensor cores (sm70 on),
    # 4 in float32 from sm80 (minimum_gemm_alignment); bfloat16 from sm80
    alignment = 8 if half and capability >= (7, 0) else 4 if capability >= (8, 0) else 1
    dtype_supported = dtype in (torch.float32, torch.float16) or (dtype == torch.bfloat16 and capability >= (8, 0))
    low, high = EFFICIENT_CAPABILITY
    if dtype_supported and low <= capability <= high and dim % alignment == 0:
        return "cuda_efficient"
    return "math"


# -- the kernels -----------------------------------------------------------------------------------------------------
@dataclass
class KernelState:
    """What a kernel's backward needs from its forward beyond the tensors (random-number state, padded shapes)."""

    kernel: str
    config: tuple = ()  # the configuration ([`_configuration`]), to switch it to the math path if the backward fails
    extra: tuple = field(default_factory=tuple)
    folded: bool = False  # grouped-query heads folded into the query length (see [`_fold`])
    window: int | None = None  # a causal call under a sliding window (keys in (i - w, i])
    softcap: float | None = None  # the math path's scores capped (Gemma 2)


# Kernels without grouped-query heads that get them folded (non-causal calls; tests add the CPU kernel to run the fold)
FOLDED_KERNELS = ("cuda_efficient",)


def _folds(kernel: str, query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor | None, causal: bool) -> bool:
    """Whether the call's heads are folded: a kernel without grouped heads, no causal mask, and a bias (if any) that
    depends on the key only (under a sliding window it depends on the query too)."""
    key_only_bias = bias is None or bias.shape[-2] == 1
    return kernel in FOLDED_KERNELS and not causal and key_only_bias and query.shape[1] != key.shape[1]


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """
    `(B, H, L, *rest)` -> `(B, Hkv, (H / Hkv) L, *rest)`: query head h = kv (H / Hkv) + j, row l lands in row j L + l
    of key/value head kv. Without a causal mask, and with a bias that depends on the key only, attention is the same
    per query whatever row it sits in; the keys and values are read as they are, once per key/value head. A copy of
    the queries (not of the keys and values, which are as many tokens per group and (H / Hkv) times smaller).
    """
    return x.reshape(x.shape[0], kv_heads, -1, *x.shape[3:])


def _unfold(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of [`_fold`]."""
    return x.reshape(x.shape[0], heads, -1, *x.shape[3:])


def _aligned_bias(bias: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The efficient kernel reads a (B, H, Lq, Lk) bias whose rows start 16-element aligned: pad, slice, expand."""
    length = bias.shape[-1]
    padded = torch.nn.functional.pad(bias, (0, -length % 16))[..., :length]
    return padded.expand(query.shape[0], query.shape[1], query.shape[2], length)


def _flash_window_forward(query, key, value, scale, window):
    """
    Causal attention within each of B blocks `(B, H, L, D)` (token-major views), keys in (i - w, i]: flash's
    variable-length entry point takes a window; the blocks are its sequences, all of length L (a block's padding comes
    after its tokens, so causality keeps it out of sight).
    """
    blocks, heads, length, dim = query.shape
    cumulative = torch.arange(0, (blocks + 1) * length, length, dtype=torch.int32, device=query.device)
    q, k, v = (x.transpose(1, 2).reshape(blocks * length, x.shape[1], dim) for x in (query, key, value))
    out, lse, rng_state, unused, _ = aten._flash_attention_forward(
        q, k, v, cumulative, cumulative, length, length, 0.0, True, False, scale=scale, window_size_left=window - 1,
        window_size_right=0,
    )  # fmt: skip
    # out (B L, H, D) -> (B, H, L, D); lse (H, B L) -> (B, H, L), views
    out = out.view(blocks, length, heads, dim).transpose(1, 2)
    return out, lse.view(heads, blocks, length).transpose(0, 1), (cumulative, rng_state, unused)


def _flash_window_backward(extra, grad_out, query, key, value, out, lse, scale, window):
    cumulative, rng_state, unused = extra
    blocks, heads, length, dim = query.shape
    flat = lambda x: x.transpose(1, 2).reshape(blocks * length, x.shape[1], dim)  # noqa: E731
    grad_q, grad_k, grad_v = aten._flash_attention_backward(
        flat(grad_out), flat(query), flat(key), flat(value), flat(out),
        lse.transpose(0, 1).reshape(heads, blocks * length).contiguous(), cumulative, cumulative, length, length,
        0.0, True, rng_state, unused, scale=scale, window_size_left=window - 1, window_size_right=0,
    )  # fmt: skip
    return tuple(x.view(blocks, length, -1, dim).transpose(1, 2) for x in (grad_q, grad_k, grad_v))


def _kernel_forward(kernel, query, key, value, bias, causal, scale, window=None, softcap=None):
    if window is not None:  # a causal call under a window: flash's own (elsewhere the caller splits it into chunks)
        if kernel != "cuda_flash":
            raise ValueError(f"{kernel} applies no sliding window: only cuda_flash does.")
        out, lse, extra = _flash_window_forward(query, key, value, scale, window)
        return out, lse, KernelState(kernel, extra=extra, window=window)
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, attn_mask=bias, scale=scale
        )
        return out, lse, KernelState(kernel)
    if kernel == "cuda_flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, causal, False, scale=scale
        )
        return out, lse, KernelState(kernel, extra=(cum_q, cum_k, max_q, max_k, seed, offset))
    if kernel == "cuda_efficient":
        heads = query.shape[1]
        key, value = _expand_heads(key, heads), _expand_heads(value, heads)  # causal calls only: others are folded
        full_bias = None if bias is None else _aligned_bias(bias, query, key)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            query, key, value, full_bias, True, 0.0, causal, scale=scale
        )
        # Its log-sum-exp is padded along the queries (to a multiple of 32): the backward wants it back in that shape
        return out, lse[..., : query.shape[2]], KernelState(kernel, extra=(lse.shape[-1], seed, offset))
    out, lse = math_attention(query, key, value, bias, causal, scale, softcap)
    return out, lse, KernelState("math", softcap=softcap)


def _kernel_backward(state, grad_out, query, key, value, bias, out, lse, causal, scale):
    kernel = state.kernel
    if state.window is not None and kernel == "cuda_flash":
        return _flash_window_backward(state.extra, grad_out, query, key, value, out, lse, scale, state.window)
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    if kernel == "cuda_flash":
        cum_q, cum_k, max_q, max_k, seed, offset = state.extra
        # The kernel reads the log-sum-exp as contiguous (B, H, L) whatever its strides; the packed one is token-major
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, key, value, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset,
            scale=scale,
        )  # fmt: skip
    if kernel == "cuda_efficient":
        padded_length, seed, offset = state.extra
        heads, kv_heads = query.shape[1], key.shape[1]
        # Contiguous (B, H, padded) as its check wants (head and batch strides multiples of 8): `pad` by nothing would
        # return a copy with the token-major strides of the packed forward's log-sum-exp
        full_lse = lse.new_zeros(*lse.shape[:-1], padded_length)
        full_lse[..., : lse.shape[-1]] = lse
        out = _token_major_dense(out)
        full_bias = None if bias is None else _aligned_bias(bias, query, key)
        grad_q, grad_k, grad_v, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, query, _expand_heads(key, heads), _expand_heads(value, heads), full_bias, out, full_lse, seed,
            offset, 0.0, [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        if heads != kv_heads:  # sum the query heads that shared a key/value head
            grad_k = grad_k.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
            grad_v = grad_v.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
        return grad_q, grad_k, grad_v
    return math_backward(grad_out, query, key, value, bias, out, lse, causal, scale, state.softcap)


def _token_major_dense(x: torch.Tensor) -> torch.Tensor:
    """`x` (B, H, L, D) laid out as dense (B, L, H, D): the efficient kernel's backward reads its `out` argument with a
    row stride of H * D whatever its strides say (kernel_backward.h: `o_strideM`); a folded output is head-major."""
    batch, heads, length, dim = x.shape
    if (x.stride(1), x.stride(2), x.stride(3)) == (dim, heads * dim, 1) or length == 1 and x.stride(1) == dim:
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def window_bias(length: int, window: int | None, dtype, device, keys: int | None = None) -> torch.Tensor | None:
    """`(L, K)`: the keys at distance `w` or more behind query i hidden from it beyond the causal mask (None without a
    window); with `K = keys` longer than `L`, query i sits at key `i + K - L` (aligned at the last query and key)."""
    if window is None:
        return None
    keys = length if keys is None else keys
    distance = torch.arange(keys - length, keys, device=device).view(-1, 1) - torch.arange(keys, device=device)
    return torch.zeros((), dtype=dtype, device=device).masked_fill(distance >= window, torch.finfo(dtype).min)


def forward(kernel, query, key, value, bias, causal, scale, config=(), window=None, softcap=None):
    """`(out, lse, state)` from `kernel`, grouped-query heads folded into the query length where it needs them; a
    `softcap` on the math path only."""
    if softcap is not None:
        if kernel != "math":
            raise ValueError(f"{kernel} applies no softcap: only the math path does.")
        return _kernel_forward(kernel, query, key, value, bias, causal, scale, softcap=softcap)
    if _folds(kernel, query, key, bias, causal):
        heads, kv_heads = query.shape[1], key.shape[1]
        out, lse, state = _kernel_forward(kernel, _fold(query, kv_heads), key, value, bias, causal, scale)
        state.folded = True
        out, lse = _unfold(out, heads), _unfold(lse, heads)
    else:
        out, lse, state = _kernel_forward(kernel, query, key, value, bias, causal, scale, window)
    state.config = config
    return out, lse, state


def backward(state, grad_out, query, key, value, bias, out, lse, causal, scale):
    if state.folded:
        heads, kv_heads = query.shape[1], key.shape[1]
        grad_q, grad_k, grad_v = _kernel_backward(state, _fold(grad_out, kv_heads), _fold(query, kv_heads), key,
                                                   value, bias, _fold(out, kv_heads), _fold(lse, kv_heads), causal,
                                                   scale)  # fmt: skip
        return _unfold(grad_q, heads), grad_k, grad_v
    return _kernel_backward(state, grad_out, query, key, value, bias, out, lse, causal, scale)
