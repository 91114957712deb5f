"""
Forwards holding one layer's low-precision weight copies at a time ([`release_casts_per_layer`]).

Under autocast a float32 weight is cast to bf16 (or fp16) at each use, and autocast keeps the cast of every weight
that requires grad in a cache until the outermost autocast region exits: through a whole forward, every layer's copy.
TRL loads the policy and the reference in float32 under bf16, so that each no-grad forward (generation's prefill and
decoding steps, the log-prob passes, a reward model) ended holding a bf16 copy of all the model's weights: on an H200
at Qwen3-0.6B's shape, 1.2 of ours' 2.2 GiB generation peak above the fixed state (results/gpu.md). The cache saves
nothing there: a forward uses each weight once. Released after each decoder layer, the copies live one layer at a
time; the same casts run, the same numbers come out.

With grad on, a layer's backward keeps what it saved of its casts (whatever the cache holds), and under gradient
checkpointing it saves nothing and casts again when it recomputes: released there too, a checkpointed training
forward no longer ends holding every layer's copy (stock's one-row training peak on the H200 did: 0.82 of its 1.48 GiB
above the fixed state).
"""

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer


def _release(module, args, output) -> None:
    if not torch.compiler.is_compiling():
        torch.clear_autocast_cache()


def release_casts_per_layer(model: nn.Module) -> int:
    """After each decoder layer of `model` (transformers' `GradientCheckpointingLayer`s) the autocast cache is cleared.
    Idempotent (per layer: two models may hold one); returns the number of layers that release: the outermost (a layer
    inside another releases with it), none where two layers share a weight."""
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    inner = {id(module) for layer in layers for module in layer.modules() if module is not layer}
    layers = [layer for layer in layers if id(layer) not in inner]
    # A weight two layers share (Zamba's shared block) is cast once for both in stock's forward, and its gradient
    # summed on that cast. The cache is one for the whole thread: any layer's release between the two uses, not only
    # the sharing layers', would cast it again (its gradient summed in float32 over two casts), so nothing releases
    seen: set[int] = set()
    for layer in layers:
        own = {id(parameter) for parameter in layer.parameters()}
        if own & seen:
            return 0
        seen |= own
    for layer in layers:
        if not getattr(layer, "_rloo_releases_casts", False):
            layer.register_forward_hook(_release)
            layer._rloo_releases_casts = True
    return len(layers)
