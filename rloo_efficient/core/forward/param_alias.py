"""
A held prompt's forward reading the trainable parameters through aliases ([`aliased_parameters`]), so that their
gradients reach the parameters as they arrive.

A prompt held across micro-batches is backpropagated inside the last reader's backward ([`attention.held`]): one
backward over two graphs, the reader's and the prompt's, both reaching every parameter. Autograd runs a parameter's
gradient accumulation once all of its inputs have arrived, and it runs the nodes of the newer graph (the reader's)
first: each parameter's gradient from the reader waits, in full and in float32, until the prompt's backward reaches that
parameter. At Qwen3-0.6B's shape on an H200 that was 2.18 GiB, a whole set of gradients, at the one-row training peak
(results/gpu.md, fifth session). Through aliases, the prompt's graph ends at leaves of its own: the reader's
accumulation runs as soon as its gradient is ready, and each alias's gradient is added to its parameter's when it
arrives. The same sums, in another order.

Only where nothing else watches a parameter's gradient accumulation (one process, no DDP, DeepSpeed or FSDP: their
hooks on it would fire before the prompt's part is added). A parameter with hooks of its own (PEFT's OSF projects
each gradient, a layer-wise optimizer steps on it) is left as it is: its gradients meet in autograd's order, as
before.
"""

import contextlib

import torch
from torch import nn


def _add_to(parameter: torch.Tensor):
    def hook(alias: torch.Tensor) -> None:
        grad, alias.grad = alias.grad, None
        if grad is None:  # (added in place already: [`in_place_grads`])
            return
        if parameter.grad is None:
            parameter.grad = grad
        else:
            parameter.grad.add_(grad)

    return hook


def watched(parameter: torch.Tensor) -> bool:
    """Whether hooks watch `parameter`'s gradient (they would not see what its alias adds)."""
    return bool(parameter._backward_hooks or getattr(parameter, "_post_accumulate_grad_hooks", None))


def alias_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The parameter `tensor` is an alias of (its gradient added to the parameter's as it arrives), or None."""
    return getattr(tensor, "_alias_of", None)


@contextlib.contextmanager
def aliased_parameters(module: nn.Module):
    """`module`'s trainable parameters replaced, inside the block, by leaves sharing their storage, each adding its
    gradient to its parameter's as it arrives. A parameter two modules share (tied embeddings) has one alias."""
    aliases: dict[int, torch.Tensor] = {}
    swapped = []
    for owner in module.modules():
        for name, parameter in owner._parameters.items():
            if parameter is None or not parameter.requires_grad or watched(parameter):
                continue
            if id(parameter) not in aliases:
                alias = parameter.detach().requires_grad_(True)
                alias.register_post_accumulate_grad_hook(_add_to(parameter))
                alias._alias_of = parameter
                aliases[id(parameter)] = alias
            swapped.append((owner, name, parameter))
    for owner, name, parameter in swapped:
        owner._parameters[name] = aliases[id(parameter)]
    try:
        yield
    finally:
        for owner, name, parameter in swapped:
            owner._parameters[name] = parameter
