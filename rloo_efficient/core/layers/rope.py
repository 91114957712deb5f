"""
Rotary embeddings that choose their frequencies per forward: LongRoPE (Phi-3.5, Phi-4-mini) takes its long factors when
the call's longest position reaches `original_max_position_embeddings`, its short ones otherwise, for every token of
the call alike.

Stock's calls and ours hold other positions: stock TRL scores a padded `(B, P + C)` batch whose position ids run to
`P + C - 1` in every chunk, and `generate` prefills a `(B, W)` prompt batch to `W - 1`; a packed forward holds only the
tokens it needs (no trailing padding) and the shared prefill forwards `W - 1` columns, sometimes in several calls.
[`rope_length`] makes each of our calls choose what the stock call it stands for chooses.
"""

import contextlib
import functools

import torch
from torch import nn


def longrope_modules(model: nn.Module) -> list[nn.Module]:
    """The rotary modules of `model` that choose LongRoPE's factors per call (one rope type for every layer), found
    once per model: every packed call asks."""
    if "_rloo_longrope" not in vars(model):
        model._rloo_longrope = [module for module in model.modules() if getattr(module, "rope_type", None) ==
                                "longrope" and hasattr(module, "original_inv_freq")]  # fmt: skip
    return model._rloo_longrope


def _undated(forward):
    """The rotary forward inside transformers' `dynamic_rope_update` (found through `functools.wraps`' chain, past
    `torch.no_grad`), or None where the forward has no such update."""
    while hasattr(forward, "__wrapped__"):
        inner = forward.__wrapped__
        code = getattr(forward, "__code__", None)  # (wraps copies the names: the code tells the wrapper apart)
        if code is not None and code.co_filename.endswith("modeling_rope_utils.py"):
            return inner
        forward = inner
    return None


def pinnable(model: nn.Module) -> bool:
    """Whether every LongRoPE module of `model` has transformers' update around a plain rotary forward."""
    return all(_undated(type(module).forward) is not None for module in longrope_modules(model))


def _fixed(module: nn.Module):
    """`module`'s rotary forward without the update: its frequencies as they are."""
    forward = functools.partial(_undated(type(module).forward), module)

    def fixed(x, position_ids, **kwargs):
        with torch.no_grad():
            return forward(x, position_ids, **kwargs)

    return fixed


@contextlib.contextmanager
def rope_length(model: nn.Module, length: int | None):
    """
    Within: every LongRoPE module of `model` uses the frequencies a stock forward whose longest position is
    `length - 1` chooses, whatever positions our calls hold (`length` None: as they are). The choice is made once, by
    transformers' own update (on the device, without reading it back), then the update is off until the end.
    """
    modules = longrope_modules(model) if length is not None else []
    for module in modules:
        buffer = module.inv_freq
        type(module).forward(module, buffer, torch.full((1, 1), length - 1, device=buffer.device))
        module.forward = _fixed(module)
    try:
        yield
    finally:
        for module in modules:
            del module.forward
