"""
The fused attention kernels, trusted only once checked: each configuration (kernel, device, dtype, heads, head_dim,
mask, and its use) runs forward and backward at its first use on problems shaped like that use, against a float64
reference computed with autocast off ([`check_kernel`]); a kernel that disagrees, or raises then or later (forward or
backward), is replaced by the math path for that configuration, with one warning naming the kernel and the reason.
Out-of-memory errors and device faults propagate. [`attention_forward`] and [`attention_backward`] are what the
backend calls.

A first use is usually inside a model's forward, and that forward may be one gradient checkpointing replays (GRPO's
defaults: no scoring pass, so the first forward is the checkpointed training one). Every check runs [`apart`] from it.
"""

import contextlib
import contextvars
import warnings

import torch

from .kernels import KernelState, backward, choose_kernel, forward, math_attention, math_backward, window_bias
from .varlen import math_varlen_backward, math_varlen_forward, varlen_backward, varlen_forward, varlen_kernel


# -- first-use check and fallback ------------------------------------------------------------------------------------
def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def apart():
    """
    The block runs as a program of its own, apart from the model's forward that calls it: with gradients on (a check
    runs its backward; the caller may be a no-grad or inference-mode pass), and with its own saved tensors.
    Non-reentrant gradient checkpointing packs every tensor a forward saves through its saved-tensor hooks and checks
    that the recomputation saves as many; a check runs at the first use only, so its saved tensors must not reach
    those hooks (they reach our identity hooks, the innermost). Nothing it computes joins the model's graph.
    """
    hooks = contextlib.nullcontext()
    if torch._C._autograd._saved_tensors_hooks_is_enabled():  # disabled (torch.compile's tracing): none can run
        hooks = torch.autograd.graph.saved_tensors_hooks(_same, _same)
    with torch.inference_mode(False), torch.enable_grad(), hooks:
        yield


# Largest error allowed against the float64 reference, relative to the reference's largest magnitude, per dtype: about
# 5 units in the last place for half precision (the CPU kernel measured at most 1.2: bf16 9.5e-3 in a key gradient,
# fp16 1.3e-3), and room for other accumulation orders in float32 (1.7e-6 measured). A wrong layout, scale, mask or
# log-sum-exp is off by more than 0.1.
TOLERANCE = {torch.bfloat16: 4e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-10}
# The log-sum-exp is compared absolutely (it sets the merge's weights: an error e scales them by up to exp(e)). Every
# kernel computes it in float32 from the same inputs as the reference: 1e-4 off measured for half precision inputs.
LSE_TOLERANCE = {torch.bfloat16: 1e-3, torch.float16: 1e-3, torch.float32: 1e-5, torch.float64: 1e-10}
# The problems a check runs, (query length, key length) per use: long enough to pass one kernel block (64 to 256 keys)
# and reach the split-key paths, one query length a multiple of 32 (the efficient kernel pads its log-sum-exp to one);
# decoding has one query per row (flash then swaps grouped heads into it)
PROBLEMS = {"causal": ((24, 24), (256, 256)), "prefix": ((12, 24), (64, 300)), "decode": ((1, 24), (1, 300)),
            "causal window": ((24, 24), (256, 256))}  # fmt: skip
CHECK_WINDOW = 7  # the window of the "causal window" problems: shorter than both, not a divisor of either

# Exceptions that are not a kernel's problem: the math path would run out of memory sooner, or on a broken device
NOT_RECOVERABLE = (torch.OutOfMemoryError, *((torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()))
# configuration -> None when its kernel is used, else why the math path runs instead
_status: dict[tuple, str | None] = {}
# The attention-logit cap of the layer being run (Gemma 2), or None: no fused kernel of PyTorch's applies one
_softcap: contextvars.ContextVar = contextvars.ContextVar("rloo_softcap", default=None)


@contextlib.contextmanager
def softcapped(softcap: float | None):
    """Within the block, every attention call caps its scores at `softcap` (`c tanh(s / c)`, before the mask) on the
    math path, the exact one for it (eager attention, which stock's Gemma 2 runs, computes the same): the fused and
    variable-length kernels step aside. A call's state keeps its cap for the backward, which runs outside."""
    token = _softcap.set(softcap)
    try:
        yield
    finally:
        _softcap.reset(token)


def _configuration(kernel: str, query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor | None, causal: bool,
                   window: int | None = None) -> tuple:  # fmt: skip
    use = ("causal window" if window else "causal") if causal else "decode" if query.shape[2] == 1 else "prefix"
    masked = None if bias is None else "by key" if bias.shape[-2] == 1 else "by query"  # padding, or a window
    return (kernel, query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1], masked, use)


def configuration(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, masked: str | None,
                  use: str) -> tuple:  # fmt: skip
    """The configuration a call of this kind gets, its kernel chosen as for a real call (`use`: "causal", "causal
    window", "prefix" or "decode", or a variable-length call's "varlen causal", "varlen causal window" or "varlen";
    `masked`: None, "by key" (prompt padding) or "by query" (a sliding window)). A variable-length use where no kernel
    runs one gets the kernel None."""
    query = torch.empty(1, heads, 1, dim, device=device, dtype=dtype)
    bias = torch.empty(1, 1, 1, 1, device=device, dtype=dtype) if masked else None
    kernel = varlen_kernel(query) if use.startswith("varlen") else choose_kernel(query, bias)
    return (kernel, device, dtype, heads, kv_heads, dim, masked, use)


def describe(config: tuple) -> str:
    kernel, device, dtype, heads, kv_heads, dim, masked, use = config
    return (f"{kernel or 'no kernel'} on {device} ({str(dtype).removeprefix('torch.')}, {heads}/{kv_heads} heads, "
            f"head_dim {dim}, {use}{', masked ' + masked if masked else ''})")  # fmt: skip


def check_kernel(config: tuple) -> str | None:
    """
    Runs the configuration's kernel, forward and backward (with a token-major log-sum-exp, as the packed forward hands
    it over), on problems shaped like its use, and compares every output with a float64 reference computed with
    autocast off. Returns None when all agree within [`TOLERANCE`], else what went wrong (a mismatch, or the exception
    the kernel raised).
    """
    kernel, device, dtype, heads, kv_heads, dim, masked, use = config
    if use.startswith("varlen"):
        return check_varlen(config)
    causal = use.startswith("causal")
    window = CHECK_WINDOW if use == "causal window" else None
    generator = torch.Generator(device="cpu").manual_seed(0)

    def rand(batch, length, count):  # (B, L, h, D) laid out, used transposed, as the model hands them over
        return torch.randn(batch, length, count, dim, generator=generator, dtype=torch.float64).to(device, dtype)

    for query_length, key_length in PROBLEMS[use]:
        shapes = ((query_length, heads), (key_length, kv_heads), (key_length, kv_heads), (query_length, heads))
        q, k, v, g = (rand(2, length, count).transpose(1, 2) for length, count in shapes)
        bias = None
        if masked == "by key":  # the first row's first keys are padding, as a shorter prompt's
            bias = torch.zeros(2, 1, 1, key_length, dtype=dtype, device=device)
            bias[0, ..., : key_length // 4] = torch.finfo(dtype).min
        elif masked == "by query":  # a mask per query, as a sliding window's (every query keeps two keys in three)
            hidden = (torch.arange(key_length) - torch.arange(query_length).view(-1, 1)).remainder(3) == 1
            bias = torch.zeros(2, 1, query_length, key_length, dtype=dtype)
            bias = bias.masked_fill(hidden, torch.finfo(dtype).min).to(device)
        scale = dim**-0.5
        try:
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                out, lse, state = forward(kernel, q, k, v, bias, causal, scale, window=window)
                grads = ()
                if use != "decode":  # decoding runs no backward
                    token_major = lse.transpose(1, 2).contiguous().transpose(1, 2)
                    grads = backward(state, g, q, k, v, bias, out, token_major, causal, scale)
        except Exception as error:  # noqa: BLE001  (any other failure sends this configuration to the math path)
            return _failure(error)
        if window is not None:  # the reference's mask: the window beyond the causal one
            bias = window_bias(query_length, window, dtype, device).view(1, 1, query_length, query_length)
        exact = [None if x is None else x.detach().to("cpu", torch.float64) for x in (q, k, v, g, bias)]
        with torch.autocast("cpu", enabled=False):
            ref_out, ref_lse = math_attention(*exact[:3], exact[4], causal, scale)
            ref_grads = math_backward(exact[3], *exact[:3], exact[4], ref_out, ref_lse, causal, scale) if grads else ()
        mismatch = _mismatch((out, lse, *grads), (ref_out, ref_lse, *ref_grads), dtype)
        if mismatch:
            return f"{mismatch} at {query_length} queries x {key_length} keys"
    return None


def _mismatch(got: tuple, want: tuple, dtype: torch.dtype) -> str | None:
    """How a kernel's (output, log-sum-exp, *gradients) miss the float64 reference's, or None within tolerance."""
    names = ("output", "log-sum-exp", "query gradient", "key gradient", "value gradient")
    for name, value, reference in zip(names, got, want):
        error = (value.detach().to("cpu", torch.float64) - reference).abs().max().item()
        tolerance, unit = LSE_TOLERANCE[dtype], ""
        if name != "log-sum-exp":
            error, tolerance, unit = error / reference.abs().max().item(), TOLERANCE[dtype], " of its largest value"
        if not error <= tolerance:  # NaN fails too
            return f"did not match the float64 reference: {name} off by {error:.1e}{unit} (tolerance {tolerance:.0e})"
    return None


# The variable-length problems: (query lengths, key lengths) of the sequences one call packs, side by side: one token,
# sequences longer than a kernel block (queries and keys), others of other lengths (causal: queries = keys); and a
# level whose subtrees are all one token (flash then swaps grouped heads into the query length)
VARLEN_PROBLEMS = {"causal": [((24, 1, 200, 7), (24, 1, 200, 7)),
                              # keys opening with ancestors' (held, or in the tree: a folded call), the causal mask
                              # aligned at the last query and key
                              ((24, 1, 200, 7), (324, 65, 205, 7))],
                   "prefix": [((12, 300, 1), (300, 64, 3)), ((1, 1, 1), (24, 300, 5))]}  # fmt: skip


def check_varlen(config: tuple) -> str | None:
    """[`check_kernel`] for a variable-length configuration (`use` "varlen causal", "varlen causal window" or
    "varlen"): one packed call of sequences of several lengths, forward and backward (the log-sum-exp handed back
    transposed, as the packed forward holds it), against the float64 reference, sequence by sequence."""
    kernel, device, dtype, heads, kv_heads, dim, _, use = config
    causal = use.startswith("varlen causal")
    window = CHECK_WINDOW if use == "varlen causal window" else None
    generator = torch.Generator(device="cpu").manual_seed(0)

    def rand(length, count):
        return torch.randn(length, count, dim, generator=generator, dtype=torch.float64).to(device, dtype)

    def offsets(lengths):
        return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

    for query_lengths, key_lengths in VARLEN_PROBLEMS["causal" if causal else "prefix"]:
        q, g = rand(sum(query_lengths), heads), rand(sum(query_lengths), heads)
        k, v = rand(sum(key_lengths), kv_heads), rand(sum(key_lengths), kv_heads)
        cu_q, cu_k = offsets(query_lengths), offsets(key_lengths)
        scale = dim**-0.5
        try:
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                out, lse, state = varlen_forward(kernel, q, k, v, cu_q, cu_k, max(query_lengths), max(key_lengths),
                                                 causal, scale, window)  # fmt: skip
                if out.shape != q.shape or lse.shape != (heads, q.shape[0]):  # another layout: not this contract
                    return (f"returned output {tuple(out.shape)} and log-sum-exp {tuple(lse.shape)} for queries "
                            f"{tuple(q.shape)}")  # fmt: skip
                grads = varlen_backward(state, g, q, k, v, out, lse.t().contiguous().t(), causal, scale)
                if [tuple(x.shape) for x in grads] != [tuple(x.shape) for x in (q, k, v)]:
                    return f"returned gradients of shapes {[tuple(x.shape) for x in grads]}"
        except Exception as error:  # noqa: BLE001
            return _failure(error)
        exact = [x.to("cpu", torch.float64) for x in (q, k, v, g)]
        with torch.autocast("cpu", enabled=False):
            ref_out, ref_lse = math_varlen_forward(*exact[:3], cu_q.cpu(), cu_k.cpu(), causal, scale, window)
            ref_grads = math_varlen_backward(exact[3], *exact[:3], ref_out, ref_lse, cu_q.cpu(), cu_k.cpu(), causal,
                                             scale, window)  # fmt: skip
        mismatch = _mismatch((out, lse, *grads), (ref_out, ref_lse, *ref_grads), dtype)
        if mismatch:
            return f"{mismatch} at queries {query_lengths} x keys {key_lengths}"
    return None


def _usable(config: tuple) -> bool:
    """Whether `config`'s fused kernel is used: checked at its first use; one warning when it is not."""
    kernel, device, dtype = config[:3]
    if kernel == "math":
        if config not in _status:  # no fused kernel for this device or dtype: say so once
            _status[config] = "no fused kernel"
            warnings.warn(f"rloo_efficient: no fused attention kernel for {device.type} ({dtype}); prefix "
                          "attention uses the math path there (its scores in memory).", stacklevel=4)  # fmt: skip
        return False
    if config not in _status:
        with apart():
            reason = check_kernel(config)
        _status[config] = None
        if reason is not None:
            _disable(config, reason)
    return _status[config] is None


def _disable(config: tuple, reason: str) -> None:
    """Sends `config` to its fallback from now on (the math path; chunks with a mask for a window), one warning."""
    if _status.get(config) is None:
        _status[config] = reason
        instead = ("chunks with a mask there" if config[-1] == "causal window" else
                   "its padded length buckets there" if config[-1].startswith("varlen") else
                   "the slower math path there (its scores in memory)")  # fmt: skip
        warnings.warn(f"rloo_efficient: the {describe(config)} attention kernel {reason}; prefix attention uses "
                      f"{instead}.", stacklevel=4)  # fmt: skip


def _failure(error: Exception) -> str:
    """What a kernel's exception says, for its warning; out-of-memory and device errors propagate (the math path
    needs more memory, and a device fault leaves the device unusable: neither is the kernel's to recover from)."""
    if isinstance(error, NOT_RECOVERABLE):
        raise error
    return f"raised {type(error).__name__}: {error}"


# -- the entry points ------------------------------------------------------------------------------------------------
def _bias_in(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The bias in the query's dtype; its masking value clamped to that dtype's range (another dtype's minimum would
    overflow to -inf, and a row with every key masked would turn NaN)."""
    if bias is None or bias.dtype == dtype:
        return bias
    return bias.to(dtype).clamp(min=torch.finfo(dtype).min)


def windowed_forward(query, key, value, scale: float, window: int):
    """
    `(output, lse, state)` of causal blocks under a sliding `window` from a kernel that applies the window itself
    (flash on CUDA), or None where there is none, or it failed its check or raises (then disabled, with one warning):
    the caller splits the blocks into chunks with a mask instead ([`attention.windows.band_forward`]), never the math
    path's (L, L) scores.
    """
    kernel = choose_kernel(query, None)
    config = _configuration(kernel, query, key, None, True, window)
    if kernel != "cuda_flash" or _softcap.get() is not None or not _usable(config):
        return None
    try:
        return forward(kernel, query, key, value, None, True, scale, config, window)
    except Exception as error:  # noqa: BLE001
        _disable(config, _failure(error))
        return None


def windowed_backward(state: KernelState, grad_out, query, key, value, out, lse, scale: float):
    """The gradients of [`windowed_forward`]'s blocks, or None if its kernel raises (then disabled, one warning)."""
    try:
        return backward(state, grad_out, query, key, value, None, out, lse, True, scale)
    except Exception as error:  # noqa: BLE001
        _disable(state.config, _failure(error))
        return None


def attention_forward(query, key, value, bias, causal: bool, scale: float):
    """`(output, lse, state)`: attention of `query` over `key`/`value` (see the module docstring for shapes)."""
    bias = _bias_in(bias, query.dtype)
    softcap = _softcap.get()
    if softcap is not None:
        return forward("math", query, key, value, bias, causal, scale, softcap=softcap)
    kernel = choose_kernel(query, bias)
    config = _configuration(kernel, query, key, bias, causal)
    if _usable(config):
        try:
            return forward(kernel, query, key, value, bias, causal, scale, config)
        except Exception as error:  # noqa: BLE001  (a kernel that raises after its check: the math path, not a crash)
            _disable(config, _failure(error))
    return forward("math", query, key, value, bias, causal, scale, config)


def attention_backward(state: KernelState, grad_out, query, key, value, bias, out, lse, causal: bool, scale: float):
    """`(grad_query, grad_key, grad_value)` given the output and log-sum-exp of the whole (merged) attention."""
    bias = _bias_in(bias, query.dtype)
    if state.kernel != "math":
        try:
            return backward(state, grad_out, query, key, value, bias, out, lse, causal, scale)
        except Exception as error:  # noqa: BLE001  (the math backward is exact for any forward's output)
            _disable(state.config, _failure(error))
    return math_backward(grad_out, query, key, value, bias, out, lse, causal, scale, state.softcap)


def varlen_config(query: torch.Tensor, key: torch.Tensor, causal: bool, window: int | None = None) -> tuple | None:
    """
    The configuration of variable-length calls ([`attention.kernels.varlen_forward`]) on packed `query` (Tq, H, D) and
    `key` (Tk, Hkv, D), where a kernel runs them and passed its first-use check; None where none does or it failed (the
    caller pads its sequences into length buckets instead). `window`: a causal call's sliding window.
    """
    kernel = varlen_kernel(query)
    if kernel is None or _softcap.get() is not None:
        return None
    use = ("varlen causal window" if window else "varlen causal") if causal else "varlen"
    config = (kernel, query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1], None, use)
    return config if _usable(config) else None


def varlen_attention_forward(config: tuple, query, key, value, cu_q, cu_k, max_q: int, max_k: int, causal: bool,
                             scale: float, window: int | None = None):  # fmt: skip
    """`(output, lse, state)` of packed sequences on `config`'s kernel, or None if it raises (then disabled, one
    warning): the caller pads this call's sequences into its length buckets, as it will every later call."""
    try:
        return varlen_forward(config[0], query, key, value, cu_q, cu_k, max_q, max_k, causal, scale, window, config)
    except Exception as error:  # noqa: BLE001
        _disable(config, _failure(error))
        return None


def varlen_attention_backward(state: KernelState, grad_out, query, key, value, out, lse, causal: bool, scale: float):
    """`(grad_query, grad_key, grad_value)` of packed sequences given the merged output and `lse` (H, Tq); the math
    reference's if the kernel raises (then disabled, one warning), as [`attention_backward`] falls back."""
    if state.kernel != "math_varlen":
        try:
            return varlen_backward(state, grad_out, query, key, value, out, lse, causal, scale)
        except Exception as error:  # noqa: BLE001  (the reference's backward is exact for any forward's output)
            _disable(state.config, _failure(error))
        state = KernelState("math_varlen", state.config, state.extra[:2], window=state.window)
    return varlen_backward(state, grad_out, query, key, value, out, lse, causal, scale)
