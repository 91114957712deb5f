"""
Reward models scored over the prefix tree of their rows, in their own tokenization, with no padding.

Stock TRL scores completions with a reward model by rendering prompt + completion as text, tokenizing it with the
reward model's tokenizer and running the model on the `B` rows, right-padded: `k` copies of each prompt. Here the rows
are tokenized as stock tokenizes them and packed as their prefix tree ([`tree.radix`], without the shift a predicting forward
needs: a reward model reads hidden states): every run of tokens rows share once, found in the reward tokenization
(never assumed to be the prompt: a tokenizer may merge tokens across the prompt/completion boundary), attending through
[`attention.backend`]. Each row's score is read where stock's sequence-classification pooling reads it, at the row's
last non-padding token, and the model's score head is applied there.
"""

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..layers.families import attention_reason, rope_reason
from ..tree.layout import LAYOUT_KWARG, NO_MASK, tree_layout
from ..tree.parts import TreeLayout
from ..tree.radix import MIN_SAVED_TOKENS, build_tree


# -- packing the reward batch ----------------------------------------------------------------------------------------
@dataclass
class RewardBatch:
    """The rows of a reward batch packed as their prefix tree, and where each row's score is read."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N)
    score_index: torch.Tensor  # (B,) flat position of each row's last non-padding token
    layout: TreeLayout
    shared_prefix_lengths: list[int]  # per prompt group, the common token prefix of its rows

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def common_prefixes(rows: list[list[int]], prompt_groups: list[int]) -> list[int]:
    """Per prompt group (in order of first appearance), the common token prefix of its rows."""
    found: dict[int, list[int]] = {}
    for row, group in zip(rows, prompt_groups, strict=True):
        if group not in found:
            found[group] = list(row)
            continue
        prefix = found[group]
        same = next((i for i, (a, b) in enumerate(zip(prefix, row)) if a != b), min(len(prefix), len(row)))
        found[group] = prefix[:same]
    return [len(prefix) for prefix in found.values()]


def pack_reward_rows(rows: list[list[int]], prompt_groups: list[int], pad_token_id: int, device,
                     min_saved: int = MIN_SAVED_TOKENS, recurrent: bool = True) -> RewardBatch | str:  # fmt: skip
    """
    Packs reward rows (each one's unpadded tokens) as their prefix tree, or returns why the batch cannot be packed.
    `prompt_groups` (which rows share a prompt) only names what is reported; the tree finds what the rows share.
    `recurrent`: whether the reward model has recurrent layers.
    """
    if any(len(row) == 0 for row in rows):
        return "a reward text has no token"
    tree = build_tree(rows, shift=False, min_saved=min_saved)
    # Stock's pooling: the rightmost token that is not padding (the first position when there is none)
    last = [max((i for i, token in enumerate(row) if token != pad_token_id), default=0) for row in rows]
    score_index = np.array([inputs[i] for inputs, i in zip(tree.row_inputs, last, strict=True)], dtype=np.int64)
    flat_rows = np.concatenate([np.asarray(row, dtype=np.int64) for row in rows])
    starts = np.cumsum([0, *(len(row) for row in rows)])[:-1]
    positions = tree.token_position
    tokens = flat_rows[starts[tree.token_row] + positions]
    layout, (tokens_t, positions_t, score_t) = tree_layout(tree, device, parts=[tokens, positions, score_index],
                                                           recurrent=recurrent)  # fmt: skip
    return RewardBatch(tokens_t.view(1, -1), positions_t.view(1, -1), score_t, layout,
                       common_prefixes(rows, prompt_groups))  # fmt: skip


@contextlib.contextmanager
def captured_output(module: nn.Module):
    """Within the block, `captured[0]` is `module`'s last output."""
    captured = []
    handle = module.register_forward_hook(lambda _, __, output: captured.insert(0, output))
    try:
        yield captured
    finally:
        handle.remove()


def scores_at(root: nn.Module, inner: nn.Module, score: nn.Module | None, index: torch.Tensor, **inputs) -> torch.Tensor:
    """
    First score of each row, read at the flat positions `index`. The model is called at its `root` (as prepared by
    accelerate), so that FSDP and DeepSpeed gather what they shard, and the per-position values are captured where
    `inner` (the transformers model) makes them. With `score` None, `inner` is a sequence classifier and its own score
    head is read; otherwise it is a causal LM (a Hydra policy, asked for one position's logits only) whose backbone's
    hidden states go through `score`.
    """
    if score is None:
        with captured_output(inner.score) as captured:
            root(**inputs)
        return captured[0].flatten(0, 1).index_select(0, index)[:, 0]
    with captured_output(getattr(inner, inner.base_model_prefix)) as captured:
        root(**inputs, logits_to_keep=1)
    return score(captured[0].last_hidden_state.flatten(0, 1).index_select(0, index))[:, 0]


def packed_scores(root: nn.Module, inner: nn.Module, score: nn.Module | None, batch: RewardBatch) -> torch.Tensor:
    """`(B,)` first score of each packed row (see [`scores_at`])."""
    return scores_at(root, inner, score, batch.score_index, input_ids=batch.input_ids, attention_mask=NO_MASK,
                     position_ids=batch.position_ids, use_cache=False, **{LAYOUT_KWARG: batch.layout})  # fmt: skip


def padded_scores(root, inner, score, input_ids, attention_mask, pad_token_id) -> torch.Tensor:
    """What a transformers `...ForSequenceClassification` model returns for stock's padded batch, for a Hydra policy:
    the score head at each row's last non-padding token."""
    indices = torch.arange(input_ids.shape[-1], device=input_ids.device, dtype=torch.int32)
    last = (indices * (input_ids != pad_token_id).to(torch.int32)).argmax(-1)
    flat = torch.arange(input_ids.shape[0], device=input_ids.device) * input_ids.shape[-1] + last
    return scores_at(root, inner, score, flat, input_ids=input_ids, attention_mask=attention_mask, use_cache=False)


def reward_model_reason(model: nn.Module) -> str | None:
    """Why a reward model's scores cannot be computed exactly from packed rows, or None when they can. (TRL hands a
    reward model text only, so a multimodal checkpoint's classifier scores text as a text model does.)"""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "score") or not hasattr(model, getattr(model, "base_model_prefix", "")):
        return f"{type(model).__name__} is not a transformers sequence-classification model"
    if config.is_encoder_decoder:
        return f"{type(model).__name__} is not a decoder-only model"
    reason = attention_reason(model)
    if reason is not None:
        return reason
    if config.get_text_config().pad_token_id is None:
        return "it has no padding token, which stock's pooling needs"
    return rope_reason(model)
