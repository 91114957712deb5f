"""
Held prompts under FSDP2 (`fully_shard`): which sharded module each held tensor was computed in.

FSDP2 gathers a module's parameters for its backward when a gradient reaches the module's output (a hook on the
outputs of each forward), and frees them again after it. A held prompt's gradient enters its layers elsewhere: at the
keys and values (router logits, recurrent states) the later micro-batches read, inside each layer. Every layer of the
source forward but its last also gets a gradient at its output (the next layer's held keys read it), which gathers it
before its insides run; the last layer gets none (nothing reads its output), so its parameters would stay freed. Each
held tensor is therefore guarded ([`attention.held.Capture.guard`]): before the backward node that made it runs, the
sharded module it was computed in gathers its parameters (a no-op where they are gathered). FSDP's post-backward for
that forward (registered on its inputs, whose gradient comes last) reduces the gradient and frees them as usual. The
source's backward runs after the reading micro-batch's own (its graph is older: autograd runs the newest ready node
first), on every process in the same order, as the processes' agreed plans make the same forwards and backwards.

This holds where each sharded unit's parameters are gathered by its own guard or output: units directly under the
root (accelerate's wrapping: each decoder layer, each vision block), the root's parameters staying gathered through
the backward. A unit nested inside another (a layer's MoE block sharded apart from its layer) is not: the enclosing
unit's parameters (its norms) would stay freed for the last layer, and under checkpointing the recomputation would
leave the nested unit gathered after the backward ([`nested_units`]: training does not hold there).
"""

import contextlib

import torch.nn as nn


def _units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`model`'s FSDP2 modules, by name (the root's: "")."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (a build without distributed)
        return []
    return [(name, module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def nested_units(model: nn.Module) -> bool:
    """Whether an FSDP2 unit of `model` sits inside another one than `model` itself (the root)."""
    names = [name for name, _ in _units(model) if name]
    return any(name.startswith(other + ".") for name in names for other in names)


@contextlib.contextmanager
def running_owner(model: nn.Module | None):
    """Within the block, a function returning the innermost FSDP2 module of `model` whose forward is running (None
    outside them, or for a model FSDP2 does not shard)."""
    modules = [module for _, module in _units(model)] if model is not None else []
    if not modules:
        yield None
        return
    stack: list[nn.Module] = []

    def enter(module, args) -> None:
        stack.append(module)

    def leave(module, args, output) -> None:  # (a hook returning a value would replace the module's output)
        stack.pop()

    handles = [hook for module in modules
               for hook in (module.register_forward_pre_hook(enter), module.register_forward_hook(leave))]  # fmt: skip
    try:
        yield lambda: stack[-1] if stack else None
    finally:
        for handle in handles:
            handle.remove()
