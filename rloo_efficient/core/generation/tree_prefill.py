"""
Generation's prefill over the prompts' prefix tree.

Stock `generate` prefills its `B` left-padded rows, each prompt `k` times and padded to the longest. The shared prefill
([`generation.generate`]) forwards each distinct prompt once; here the distinct prompts are forwarded as their radix tree
([`tree.radix`]), through the packed forward and tree attention the log-prob and training forwards use: a system prompt that
opens every prompt once per call, each task once, the histories of a tool turn's rows sharing their system prompt and
task, none of it padded. Each attention layer's keys and values, as the module hands them to its attention call (what
its cache would store), are laid out as the cache of the padded batch would hold them, and `generate` continues from
that cache exactly as from [`generation.generate.prefill_prompts`]'s.

Positions are what `generate` computes for the padded batch (`cumsum(mask) - 1`): each token's position in its own
prompt, the same in every prompt through a node. The left padding's keys and values are zeros, masked wherever read.
"""

import inspect
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

from ..attention.backend import capturing_keys
from ..layers.install import install
from ..tree.layout import LAYOUT_KWARG, NO_MASK, tree_layout
from ..tree.radix import MIN_SAVED_TOKENS, Tree, build_tree, ranges
from .prompt_cache import ReadDtypeCache, prefix_cache_unsupported_reason


# Cache layers filled from the keys and values the attention calls see: per-row keys and values (a sliding layer keeps
# its window itself), and layers that hold nothing (Gemma 4's layers reading another's)
_TREE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, DummyLayer)


def tree_prefill_reason(model: nn.Module) -> str | None:
    """Why the distinct prompts cannot be prefilled as their prefix tree for `model` (each is then prefilled once in a
    padded batch), or None. Found once per model."""
    if "_rloo_tree_prefill_reason" not in vars(model):
        config = model.config.get_text_config(decoder=True)
        kinds = {type(layer) for layer in DynamicCache(config=config).layers}
        reason = None
        if not kinds <= set(_TREE_LAYERS):
            reason = "its cache keeps recurrent states, which the tree's packed forward does not return"
        model._rloo_tree_prefill_reason = reason or prefix_cache_unsupported_reason(model)
    return model._rloo_tree_prefill_reason


@dataclass(frozen=True)
class TreePlan:
    """The distinct prompts' prefix tree for a prefill, on the host ([`plan_tree_prefill`])."""

    tree: Tree
    tokens: np.ndarray  # (N,) each packed token
    slots: np.ndarray  # (U * columns,) each (prompt, column) of the padded cache: its packed token, N at padding
    prompts: int  # U
    columns: int  # width - 1


def plan_tree_prefill(prompt_ids: list[list[int]], first: list[int], width: int,
                      min_saved: int = MIN_SAVED_TOKENS) -> TreePlan | None:  # fmt: skip
    """
    The prefix tree of the distinct prompts `first` of a `(B, width)` left-padded batch, over what a prefill forwards
    (each prompt's first `width - 1` columns: all its tokens but the last), or None where it would forward fewer than
    `min_saved` tokens less than the padded batch, or nothing. On the host, from the token lists.
    """
    sequences = [prompt_ids[row][:-1] for row in first]
    columns = width - 1
    tree = build_tree(sequences, shift=False, min_saved=min_saved)
    if tree.num_tokens == 0 or len(first) * columns - tree.num_tokens < min_saved:
        return None
    lengths = np.array([len(sequence) for sequence in sequences], dtype=np.int64)
    flat = np.concatenate([np.asarray(sequence, dtype=np.int64) for sequence in sequences])
    starts = np.cumsum(lengths) - lengths
    tokens = flat[starts[tree.token_row] + tree.token_position]
    slots = np.full(len(first) * columns, tree.num_tokens, dtype=np.int64)
    slots[ranges(np.arange(len(first)) * columns + columns - lengths, lengths)] = np.concatenate(tree.row_inputs)
    return TreePlan(tree, tokens, slots, len(first), columns)


def generating_model(model: nn.Module) -> nn.Module:
    """The module whose forward `generate` calls for `model`: a PEFT model's base model (`PeftModel.generate` hands
    generation to it, whose layers hold the adapters), else `model` itself. So a prefill runs as stock's generation:
    under mixed precision accelerate wraps the forward of the model it prepared (a PEFT model's, whose `generate`
    never calls it) in autocast, and a PEFT model's stock generation runs without."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether `model`'s forward (a PEFT model's base's) takes `logits_to_keep`."""
    return "logits_to_keep" in inspect.signature(generating_model(model).forward).parameters


def forward_capturing(model: nn.Module, tokens: torch.Tensor, layout, capture, layers: set[int], what: str) -> None:
    """
    One packed forward of `tokens` `(N,)` over `layout` ([`tree.parts.TreeLayout`]), the model called as `generate`
    calls it ([`generating_model`]: a mixed-precision wrapper on its `forward` applies where it does there), its head
    on one position only, each attention layer handing its keys and values to `capture(layer_idx, key, value)`
    ([`capturing_keys`]). Raises where a cache layer of `layers` handed none (its attention did not go through ours);
    `what` names the caller.
    """
    install(model)
    seen = set()

    def record(index: int, key: torch.Tensor, value: torch.Tensor) -> None:
        seen.add(index)
        capture(index, key, value)

    # A tensor of positions, not a count: Gemma 4 reads an integer `logits_to_keep` as the tokens to keep altogether
    head = {}
    if takes_logits_to_keep(model):
        head["logits_to_keep"] = torch.zeros(1, dtype=torch.long, device=tokens.device)
    with capturing_keys(record):
        generating_model(model)(input_ids=tokens.view(1, -1), attention_mask=NO_MASK,
                                position_ids=layout.positions.view(1, -1), use_cache=False, **{LAYOUT_KWARG: layout},
                                **head)  # fmt: skip
    missing = sorted(layers - seen)
    if missing:
        raise RuntimeError(f"The {what} saw no keys for the cache layers {missing}: their attention did not go "
                           "through rloo_efficient's attention function.")  # fmt: skip


@torch.no_grad()
def tree_prefill(model: nn.Module, plan: TreePlan, cache: DynamicCache | None = None) -> DynamicCache:
    """
    The cache [`generation.generate.prefill_prompts`] returns for the distinct prompts of `plan`, from one packed
    forward over their prefix tree. The model is called as `generate` calls it ([`generating_model`]: the keys are
    computed in the precision stock's are), its head on one position only.
    Each layer's keys and values are laid out as they arrive, so that no more than one layer's packed copy is alive.
    `cache`: the empty cache to fill (default: the model's own kind).
    """
    device = next(model.parameters()).device
    layout, (tokens, slots) = tree_layout(plan.tree, device, parts=[plan.tokens, plan.slots], recurrent=False)
    cache = ReadDtypeCache(config=model.config.get_text_config(decoder=True)) if cache is None else cache
    stored = {index for index, layer in enumerate(cache.layers) if not isinstance(layer, DummyLayer)}

    def lay_out(index: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if index not in stored:
            return
        # (1, Hkv, N, D) -> (U, Hkv, columns, D), token-major as a model's own prefill lays out its keys
        keys, values = (torch.cat([x[0].transpose(0, 1), x.new_zeros(1, x.shape[1], x.shape[3])]).index_select(
            0, slots).view(plan.prompts, plan.columns, x.shape[1], x.shape[3]).transpose(1, 2) for x in (key, value))
        cache.update(keys, values, index)

    forward_capturing(model, tokens, layout, lay_out, stored, "tree prefill")
    return cache
