"""
The recurrent kernels the forks ([`layers.recurrent`]) call, trusted only once checked. transformers binds each model's
`torch_chunk_gated_delta_rule`, `mamba2_chunk_scan` and `causal_conv1d_fn` to the fused kernels where
flash-linear-attention, mamba-ssm or causal-conv1d are installed, and to its torch reference otherwise. A fork relies on
what its stock use never exercises in training: an initial state, and the gradient flowing back into it. So at its first
use on a device and dtype, each kernel runs a small problem with an initial state against its torch reference
(`inspect.unwrap` of transformers' wrapper), forward and backward (the output, the final state, and every input's
gradient, the initial state's included); a kernel that disagrees or raises is replaced by its reference there, with one
warning naming it. Out-of-memory errors and device faults propagate.
"""

import inspect
import warnings

import torch

from ..attention.checks import NOT_RECOVERABLE, apart


# Largest error allowed against the reference, relative to the reference's largest value: the fused kernels compute in
# float32 (as the torch references do) in other block orders, and half-precision outputs round to 1 part in 256 (bf16)
# or 2048 (fp16); a missing state, a wrong decay or a wrong gradient is off by far more
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-3, torch.float64: 1e-3}
_trusted: dict[tuple, object] = {}  # (kernel, device, dtype) -> the function to call


def _problem(name: str, device, dtype) -> tuple[tuple, dict, dict[str, torch.Tensor]]:
    """A small problem for kernel `name` with an initial state, called as transformers calls it (the leading tensors
    positional, the rest by keyword): `(args, kwargs, the inputs whose gradients are compared)`."""
    generator = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, low=None, high=None, dtype=dtype):
        x = torch.randn(*shape, generator=generator) if low is None else low + (high - low) * torch.rand(
            *shape, generator=generator)  # fmt: skip
        return x.to(device, dtype).requires_grad_(True)

    if name == "gated delta rule":  # 2 rows of 70 tokens (past a 64-token chunk), 4 value heads on 2 key heads
        q, k, v = rand(2, 70, 2, 8), rand(2, 70, 2, 8), rand(2, 70, 4, 8)
        g, beta, state = rand(2, 70, 4, low=-0.5, high=0.0, dtype=torch.float32), rand(2, 70, 4, low=0.0, high=1.0), (
            rand(2, 4, 8, 8, dtype=torch.float32))  # fmt: skip
        kwargs = dict(g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return (q, k, v), kwargs, dict(query=q, key=k, value=v, g=g, beta=beta, initial_state=state)
    if name == "kimi delta rule":  # Gated DeltaNet with a log-decay per channel: 2 rows of 70 tokens, 2 heads of 8
        q, k, v = rand(2, 70, 2, 8), rand(2, 70, 2, 8), rand(2, 70, 2, 8)
        g, beta, state = rand(2, 70, 2, 8, low=-0.5, high=0.0, dtype=torch.float32), rand(2, 70, 2, low=0.0, high=1.0), (
            rand(2, 2, 8, 8, dtype=torch.float32))  # fmt: skip
        kwargs = dict(g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return (q, k, v), kwargs, dict(query=q, key=k, value=v, g=g, beta=beta, initial_state=state)
    if name == "mamba2 scan":  # 2 rows of 40 tokens in chunks of 16, 4 heads of 8 in 2 groups, a state of 8
        x, dt, B, C = rand(2, 40, 4, 8), rand(2, 40, 4, low=0.0, high=0.2), rand(2, 40, 2, 8), rand(2, 40, 2, 8)
        A, D, state = rand(4, low=-1.0, high=-0.1, dtype=torch.float32), rand(4, dtype=torch.float32), rand(
            2, 4, 8, 8, dtype=torch.float32)  # fmt: skip
        kwargs = dict(chunk_size=16, D=D, z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                      initial_states=state, return_final_states=True)  # fmt: skip
        return (x, dt, A, B, C), kwargs, dict(hidden_states=x, dt=dt, B=B, C=C, initial_states=state)
    x, weight, bias = rand(2, 16, 40), rand(16, 4), rand(16)  # a depthwise causal convolution
    return (x, weight, bias), dict(activation="silu"), dict(hidden_states=x, weight=weight, bias=bias)


def check(name: str, function, reference, device, dtype) -> str | None:
    """None when `function` agrees with `reference` on kernel `name`'s problem (forward and backward), else why not."""
    results = []
    for candidate in (function, reference):
        args, kwargs, inputs = _problem(name, device, dtype)
        try:
            out = candidate(*args, **kwargs)
            outputs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
            generator = torch.Generator(device="cpu").manual_seed(1)
            loss = sum((o.float() * torch.randn(o.shape, generator=generator).to(o.device)).sum() for o in outputs)
            grads = torch.autograd.grad(loss, list(inputs.values()), allow_unused=True)
        except NOT_RECOVERABLE:
            raise
        except Exception as error:  # noqa: BLE001 (any failure of a fused kernel sends it to the reference)
            if candidate is reference:
                raise
            return f"raised {type(error).__name__}: {error}"
        if any(grad is None for grad in grads):
            missing = [key for key, grad in zip(inputs, grads, strict=True) if grad is None]
            return f"gave no gradient to {', '.join(missing)}"
        results.append([o.detach().float() for o in outputs] + [grad.float() for grad in grads])
    if len(results[0]) != len(results[1]):
        return f"returned {len(results[0]) - len(inputs)} outputs, its reference {len(results[1]) - len(inputs)}"
    names = [f"output {i}" for i in range(len(results[1]) - len(inputs))] + [f"{key}'s gradient" for key in inputs]
    for what, got, expected in zip(names, *results, strict=True):
        error = float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-12))
        if not error <= TOLERANCE[dtype]:
            return f"its {what} is off by {error:.1e} of its largest value (allowed {TOLERANCE[dtype]:.0e})"
    return None


def trusted(name: str, function, device, dtype):
    """`function` (a model module's kernel) on this device and dtype once it passed [`check`], else its reference."""
    reference = inspect.unwrap(function)
    if reference is function:  # no fused kernel behind it
        return function
    key = (name, function, device, dtype)
    if key not in _trusted:
        with apart():  # the first use may be a no-grad scoring pass, or a forward gradient checkpointing replays
            reason = check(name, function, reference, device, dtype)
        if reason is not None:
            warnings.warn(f"rloo_efficient: the {name} kernel on {device} ({str(dtype).removeprefix('torch.')}) "
                          f"{reason}; its torch reference runs there instead.", stacklevel=3)  # fmt: skip
        _trusted[key] = function if reason is None else reference
    return _trusted[key]
