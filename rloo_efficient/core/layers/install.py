"""Installing rloo_efficient's layers on a model: its attention modules on our backend, its recurrent layers on their
forks (calls without a packed layout or a decoding cache still run the model's own), and its forwards holding one
layer's autocast weight casts at a time ([`casts`])."""

from torch import nn

from ..attention.backend import install_attention
from .casts import release_casts_per_layer
from .recurrent import install as install_forks


def install(model: nn.Module) -> int:
    """
    Points every attention module of `model` at our attention function ([`attention.backend`]), routes a hybrid's
    recurrent layers to their forks ([`layers.recurrent`]) and releases autocast's weight casts after each decoder layer
    ([`layers.casts`]); idempotent. Once done, a call only routes again a recurrent layer whose routing a
    kernelization reset (transformers >= 5.25; a pass over the model's recurrent layers, none for a model without).
    Returns the number of attention modules.
    """
    count = getattr(model, "_rloo_prefix_attention_modules", None)
    if count is not None:
        install_forks(model)
        return count
    install_forks(model)
    release_casts_per_layer(model)
    model._rloo_prefix_attention_modules = install_attention(model)
    return model._rloo_prefix_attention_modules


def installed(model: nn.Module) -> bool:
    return any(hasattr(module, "_rloo_base_config") for module in model.modules())
