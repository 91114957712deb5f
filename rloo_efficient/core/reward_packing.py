"""
Reward models scored inside the group: each group's shared prefix once.

Stock TRL scores completions with a reward model by rendering prompt + completion as text, tokenizing it with the
reward model's tokenizer and running the model on the `B` rows: `k` copies of each prompt. Here the rows of a group
(the same prompt) are tokenized as stock tokenizes them, their longest common token prefix is found (never assumed to
be the prompt: a tokenizer may merge tokens across the prompt/completion boundary), and the batch is packed as the
policy's forwards pack it ([`packing`]): the common prefix less its last token once per group, then each row's
remainder opened by a copy of that last token, attending through [`prefix_attention`]. Each row's score is read where
stock's sequence-classification pooling reads it, at the row's last non-padding token, and the model's score head is
applied there.
"""

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .families import attention_reason, rope_reason
from .packing import host_layout
from .prefix_attention import LAYOUT_KWARG, NO_MASK, PackedLayout


# -- packing the reward batch ----------------------------------------------------------------------------------------
@dataclass
class RewardBatch:
    """The rows of a reward batch packed as one flat sequence, and where each row's score is read."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N)
    score_index: torch.Tensor  # (B,) flat position of each row's last non-padding token
    layout: PackedLayout
    shared_prefix_lengths: list[int]  # per group, the common token prefix of its rows

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack_reward_rows(rows: list[list[int]], prompt_groups: list[int], pad_token_id: int, device,
                     dtype) -> RewardBatch | str:  # fmt: skip
    """
    Packs reward rows (each one's unpadded tokens) whose `prompt_groups` say which share a prompt, or returns why the
    batch cannot be packed. A group whose rows share no first token is split into rows of their own. Array operations
    over all rows at once, on the host (where the tokenizer put them).
    """
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    if (lengths == 0).any():
        return "a reward text has no token"
    rows_count, longest = len(rows), int(lengths.max())
    valid = np.arange(longest)[None, :] < lengths[:, None]
    matrix = np.full((rows_count, longest), -1, dtype=np.int64)
    matrix[valid] = np.concatenate([np.asarray(row, dtype=np.int64) for row in rows])
    # Prompt groups in order of first appearance; each row's common prefix with its group's first row
    _, first_of_id, id_of_row = np.unique(np.asarray(prompt_groups), return_index=True, return_inverse=True)
    appearance = np.argsort(first_of_id)  # ids in order of their first row
    rank = np.empty(len(first_of_id), dtype=np.int64)
    rank[appearance] = np.arange(len(first_of_id))
    group_of_row = rank[id_of_row.reshape(-1)]
    leader = first_of_id[appearance][group_of_row]
    same = (matrix == matrix[leader]) & valid & valid[leader]
    common = np.where(same.all(axis=1), longest, same.argmin(axis=1))
    group_shared = np.full(len(first_of_id), longest, dtype=np.int64)
    np.minimum.at(group_shared, group_of_row, common)
    # Rows in group order (row order within); a group sharing nothing is split into rows of their own
    order = np.lexsort((np.arange(rows_count), group_of_row))
    group_sorted = group_of_row[order]
    alone = group_shared[group_sorted] == 0
    starts = np.ones(rows_count, dtype=bool)
    starts[1:] = (group_sorted[1:] != group_sorted[:-1]) | alone[1:]
    group_of_slot = np.cumsum(starts) - 1
    counts = np.bincount(group_of_slot)
    shared = np.where(alone, lengths[order], group_shared[group_sorted])[starts]
    body = shared - 1  # the shared prefix less its last token, which opens every row's segment
    opening = np.repeat(body, counts)  # each slot's segment starts at this token of its row
    body_width = int(body.max())
    row_length = int((lengths[order] - opening).max())

    body_columns = np.arange(body_width)[None, :]
    body_tokens = np.where(body_columns < body[:, None], matrix[order[starts]][:, :body_width], pad_token_id)
    columns = opening[:, None] + np.arange(row_length)[None, :]
    in_row = columns < lengths[order][:, None]
    row_tokens = np.where(in_row, matrix[order[:, None], np.minimum(columns, longest - 1)], pad_token_id)
    tokens = np.concatenate([body_tokens.reshape(-1), row_tokens.reshape(-1)])
    positions = np.concatenate([np.broadcast_to(body_columns, body_tokens.shape).reshape(-1), columns.reshape(-1)])
    # Stock's pooling: the rightmost token that is not padding (the first position when there is none)
    real = valid & (matrix != pad_token_id)
    last = np.where(real.any(axis=1), longest - 1 - real[:, ::-1].argmax(axis=1), 0)[order]
    slot_start = len(counts) * body_width + np.arange(rows_count) * row_length
    score_index = np.empty(rows_count, dtype=np.int64)
    score_index[order] = np.where(last >= opening, slot_start + last - opening, group_of_slot * body_width + last)
    layout, (tokens_t, positions_t, score_t) = host_layout(counts, body, row_length, longest,
                                                           [tokens, positions, score_index], device, dtype)  # fmt: skip
    return RewardBatch(tokens_t.view(1, -1), positions_t.view(1, -1), score_t, layout, shared.tolist())


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
