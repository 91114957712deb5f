"""
The MoE load-balancing loss of a packed batch, exactly as stock TRL computes it on its padded rows.

TRL 1.16 adds `router_aux_loss_coef * aux_loss` to the training loss whenever the model's config has a router
coefficient (`output_router_logits` among its attributes, a non-zero coefficient), and computes `aux_loss` in its fused
head with Mixtral's `load_balancing_loss_func` over every layer's router logits and every token its 2-D attention mask
holds: each prompt token once per row of its group. Routing is a function of each token's own hidden state, so a
packed token routes as each of its copies in stock's rows does; the loss only counts tokens, so weighting each packed
token by how many times stock's batch holds it ([`forward.packing.pack_rows`] with `token_weights`) gives stock's loss. The
router logits are captured where transformers records them (the model's `_can_record_outputs["router_logits"]`: a
module class and an output index), by our own forward hooks, active only during the packed forward (not during
gradient checkpointing's recomputation).
"""

import contextlib

import torch
from torch import nn


def router_recorder(model: nn.Module) -> tuple[type, int] | None:
    """`(module class, output index)` where transformers records `model`'s router logits, or None."""
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None and getattr(recorder, "target_class", None) is not None:
            return recorder.target_class, recorder.index
    return None


def aux_loss_reason(model: nn.Module) -> str | None:
    """Why the packed forward cannot give stock TRL's load-balancing loss for `model`, or None when it can."""
    text_config = model.config.get_text_config()
    if router_recorder(model) is None:
        return f"{type(model).__name__} records no router logits for the MoE load-balancing loss"
    if getattr(text_config, "num_experts", None) is None or getattr(text_config, "num_experts_per_tok", None) is None:
        return "its config names no num_experts / num_experts_per_tok, which TRL's load-balancing loss reads"
    return None  # (router jitter: [`layers.families.jitter_reason`], checked for every packed forward)


@contextlib.contextmanager
def recording_router_logits(model: nn.Module, on_record=None):
    """Within the block, the returned list collects every router's logits `(N, E)` in call order (one entry per MoE
    layer and forward), each passed through `on_record` as it is recorded where given. Only the block's own forwards
    are recorded: gradient checkpointing's recomputation, in the backward, records nothing."""
    target, index = router_recorder(model)
    recorded: list[torch.Tensor] = []

    def hook(module, args, output):
        logits = output[index] if isinstance(output, (tuple, list)) else output
        recorded.append(logits if on_record is None else on_record(logits))

    handles = [module.register_forward_hook(hook) for module in model.modules() if isinstance(module, target)]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def weighted_aux_loss(router_logits: list[torch.Tensor], token_weights: torch.Tensor, text_config,
                      held_logits: list[list[torch.Tensor]] = (), held_weights: list[torch.Tensor] = ()) -> torch.Tensor:  # fmt: skip
    """
    TRL's load-balancing loss (Mixtral's `load_balancing_loss_func`, TRL 1.16's fused head) over the packed tokens'
    `router_logits` (one `(N, E)` per layer), each token weighted by `token_weights` `(1, N)` (the count of its
    copies in stock's batch) where stock's attention mask weights it 0 or 1. Held tokens ([`tree.holds`]) count too:
    per slot, each layer's router logits `held_logits` `(Ns, E)` and the micro-batch's rows holding each token
    `held_weights` `(Ns,)`.
    """
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    if held_logits:
        router_logits = [torch.cat([own, *(slot[layer] for slot in held_logits)])
                         for layer, own in enumerate(router_logits)]  # fmt: skip
        token_weights = torch.cat([token_weights.view(-1), *held_weights]).view(1, -1)
    return load_balancing_loss_func(tuple(router_logits), text_config.num_experts, text_config.num_experts_per_tok,
                                    token_weights.float())  # fmt: skip
