"""
Each prompt once per group: the batch's group structure, and the packed shared-prefix forward.

Stock TRL scores a batch as `B` rows `[left-padded prompt | completion | right padding]`, so a group of `k`
completions carries `k` copies of its prompt through every forward. Here a micro-batch becomes one flat sequence

    [body_1 | body_2 | ... | body_G | segment_1 | segment_2 | ... | segment_S]
     each prompt less its last token,   each scored row: [prompt[-1], c[0], ..., c[n-2]]
     right-padded to the longest body   right-padded to the longest segment

Each segment starts with a copy of its prompt's last token: its hidden state is the one stock TRL reads at the
prompt's last position to score the completion's first token, so each segment scores its own completion's tokens
`c[0..n-1]` through `shift_labels`, and no position predicts two labels. Every token keeps the position id it has in
stock TRL's row (its column), so rotary embeddings see the same angles. The model call carries a
[`prefix_attention.PackedLayout`]: prompt bodies attend causally within themselves; segment tokens attend to their
group's body and their own earlier tokens (see [`prefix_attention`]). Rows with nothing to score (a masked truncated
completion) are left out: stock TRL's log-probs for them are all zero, and so are ours.

The structure (which rows share a prompt, prompt lengths, scored lengths) is known on the host from TRL's token lists
once per generation batch ([`RowGroups`]); it travels with the batch as a small CPU tensor, and each micro-batch's
index tensors are built from it with NumPy and sent to the device in one copy. Nothing reads a device value back.
"""

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch

from .prefix_attention import NO_MASK, LAYOUT_KWARG, PackedLayout, SplitLayout


ROWS_KEY = "rloo_rows"  # the batch key of the (B, 3) CPU tensor of [group id, prompt length, scored length] per row


def prompt_key(prompt) -> str:
    """A hashable key for a prompt: the string itself, or the JSON of a conversation, its images by their content
    (two images of the same size with other pixels are other prompts; the same pixels in two objects are one)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=_content_key)


def _content_key(value) -> str:
    """What stands for a non-JSON value in a prompt's key: an image (PIL, or an array) by its mode, size and a digest
    of its pixels; anything else by its text."""
    if hasattr(value, "tobytes") and hasattr(value, "size"):
        mode, size = getattr(value, "mode", getattr(value, "dtype", "")), getattr(value, "shape", value.size)
        return f"<image {mode} {tuple(size) if not isinstance(size, int) else size} {hashlib.sha1(value.tobytes()).hexdigest()}>"
    return str(value)


def prompt_images(prompts: list) -> list | None:
    """Each conversational prompt's images (its content blocks of type "image"), or None when no prompt has one."""
    images = [[part.get("image") for message in prompt if isinstance(message.get("content"), list)
               for part in message["content"] if isinstance(part, dict) and part.get("type") == "image"]
              if isinstance(prompt, list) else [] for prompt in prompts]  # fmt: skip
    return images if any(images) else None


def group_ids_for(prompts: list) -> torch.Tensor:
    """`(B,)` long tensor: rows with the same prompt (string, or token list) get the same id, by first appearance."""
    index: dict = {}
    keys = [tuple(p) if isinstance(p, list) and all(isinstance(t, int) for t in p) else prompt_key(p) for p in prompts]
    return torch.tensor([index.setdefault(key, len(index)) for key in keys], dtype=torch.long)


def row_groups(prompt_ids: list[list[int]], scored_lengths: list[int], images: list | None = None) -> torch.Tensor:
    """
    The `(B, 3)` CPU tensor of [group id, prompt length, scored completion length] per row: rows with the same prompt
    tokens share a group, and with `images` (each row's, or None) the same images too: an image's tokens are the same
    placeholders whatever its pixels ([`prompt_key`] tells images apart by their content). Built once per generation
    batch from TRL's token lists; it is shuffled and split with the batch like any other field.
    """
    keys = [list(ids) for ids in prompt_ids]
    if images is not None:
        keys = [prompt_key([ids, image]) for ids, image in zip(keys, images, strict=True)]
    groups = group_ids_for(keys)
    lengths = torch.tensor([[len(ids), n] for ids, n in zip(prompt_ids, scored_lengths, strict=True)], dtype=torch.long)
    return torch.cat([groups.unsqueeze(1), lengths.view(-1, 2)], dim=1)


def group_shuffle_order(group_ids: torch.Tensor, permutation: torch.Tensor) -> np.ndarray:
    """
    `(B,)` row order that keeps each group's rows together while following a row shuffle `permutation` (the one TRL's
    `shuffle_sequence_dict` draws): groups ordered by their first row in the permutation, rows within a group by their
    order in it.
    """
    group_ids, permutation = group_ids.numpy(), permutation.numpy()
    rank = np.empty_like(permutation)
    rank[permutation] = np.arange(len(permutation))  # rank[row] = where the row lands in the row shuffle
    first = np.full(int(group_ids.max()) + 1, len(permutation))
    np.minimum.at(first, group_ids, rank)  # each group's first place in the shuffle
    return np.lexsort((rank, first[group_ids]))


@dataclass
class PackedBatch:
    """A micro-batch packed as one flat sequence, and where its scored log-probs go in stock TRL's `(B, C)` layout."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N)
    shift_labels: torch.Tensor  # (1, N) the token each position predicts, -100 where none is scored
    unpack_index: torch.Tensor  # (B*C,) flat position of each (row, column) log-prob; N (a zero) where unscored
    layout: PackedLayout
    num_rows: int  # B
    num_cols: int  # C, the padded completion width
    num_real_tokens: int  # tokens that are not padding
    token_weights: torch.Tensor | None = None  # (1, N) int64: how many times stock's batch holds each token
    source_index: torch.Tensor | None = None  # (N,) flat index into stock's (B, P + C) batch of each packed token
    first_rows: np.ndarray | None = None  # (G,) host: the stock row each group's body is taken from, in body order
    group_source_index: torch.Tensor | None = None  # (N,) flat index into a (G, P + C) array, one row per group

    @property
    def num_tokens(self) -> int:
        """Tokens the model processes, padding included."""
        return self.input_ids.shape[1]

    def model_inputs(self) -> dict:
        """Keyword arguments for `model(..., fused_lm_head=True)`."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": NO_MASK,
            "position_ids": self.position_ids,
            "shift_labels": self.shift_labels,
            LAYOUT_KWARG: self.layout,
        }

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`(1, N)` per-position values (zero where unscored) -> `(B, C)` in stock TRL's layout, differentiably."""
        values = torch.cat([packed.view(-1), packed.new_zeros(1)])
        return values.index_select(0, self.unpack_index).view(self.num_rows, self.num_cols)


def _split_layout(counts: np.ndarray, row_length: int) -> tuple[int | None, int, np.ndarray | None, np.ndarray | None]:
    """(rows_per_group or None, slots, gather, scatter) of groups holding `counts` consecutive rows of `row_length`."""
    groups = len(counts)
    if (counts == counts[0]).all():
        return int(counts[0]), int(counts[0]) * row_length, None, None
    slots = int(counts.max()) * row_length
    queries = counts * row_length  # each group's flat queries, consecutive
    starts = np.cumsum(queries) - queries
    slot = np.arange(slots)
    gather = np.where(slot[None, :] < queries[:, None], starts[:, None] + slot[None, :], int(queries.sum()))
    group_of_query = np.repeat(np.arange(groups), queries)
    scatter = group_of_query * slots + (np.arange(int(queries.sum())) - np.repeat(starts, queries))
    return None, slots, gather.reshape(-1), scatter


def host_layout(counts: np.ndarray, body: np.ndarray, row_length: int, span: int, parts: list[np.ndarray], device,
                dtype) -> tuple[PackedLayout, list[torch.Tensor]]:  # fmt: skip
    """
    The [`PackedLayout`] of `G = len(counts)` groups, group `g` a body of `body[g]` tokens (right-padded to the
    longest) and `counts[g]` consecutive rows of `row_length` tokens; built on the host. The integer arrays `parts`
    travel to `device` with the layout's own indices in one copy; returns the layout and the parts there.
    """
    groups, body_width = len(counts), int(body.max())
    rows_per_group, slots, gather, scatter = _split_layout(counts, row_length)
    padded = bool((body < body_width).any())  # bodies of different lengths: the rows must not see the padding
    arrays = [*parts, body, *([] if gather is None else [gather, scatter])]
    host = torch.from_numpy(np.concatenate(arrays).astype(np.int64))
    if device.type != "cpu":
        host = host.pin_memory()
    on_device = list(host.to(device, non_blocking=True).split([array.size for array in arrays]))
    gather_t = scatter_t = bias = None
    if gather is not None:
        scatter_t, gather_t = on_device.pop(), on_device.pop()
    lengths = on_device.pop()
    if padded:  # the bias built where it is used, from the bodies' lengths: no blocking copy
        bias = torch.full((groups, body_width), torch.finfo(dtype).min, dtype=dtype, device=device)
        bias.masked_fill_(torch.arange(body_width, device=device) < lengths[:, None], 0.0)
        bias = bias.view(groups, 1, 1, body_width)
    split = SplitLayout(groups, rows_per_group, slots, gather_t, scatter_t, bias)
    return PackedLayout(split, body_width, int(counts.sum()), row_length, span, lengths), on_device


def pack_groups(
    input_ids: torch.Tensor,
    logits_to_keep: int,
    rows: torch.Tensor,
    dtype: torch.dtype,
    token_weights: bool = False,
    group_sources: bool = False,
) -> PackedBatch | str:
    """
    Packs stock TRL's `(B, P + C)` scoring batch (left-padded prompts, right-padded completions, the last
    `logits_to_keep` columns being the completion) by its `rows` ([`row_groups`], a CPU tensor). Returns the
    [`PackedBatch`], or the reason the batch cannot be packed (then the stock forward runs). `dtype`: the attention's
    compute dtype, for the padding bias.

    With `token_weights` (for a loss over every token stock's batch holds, the MoE load-balancing loss), every token
    stock's attention mask holds is also an input here, weighted by how many times stock's batch holds it: a segment
    also takes its row's last completion token (which predicts nothing), a group whose completions are all unscored
    keeps one segment of its prompt's last token, and [`PackedBatch.token_weights`] counts a prompt token once per row
    of its group in the micro-batch (scored or not) and a completion token once.

    With `group_sources`, [`PackedBatch.group_source_index`] gives each packed token's (group, column) in a `(G, P + C)`
    array of one row per group, in body order (for what is the same for every row of a group: Qwen's 3-D positions).
    """
    device = input_ids.device
    num_rows, width = input_ids.shape
    prompt_width = width - logits_to_keep
    group, plen, scored = rows.numpy().T  # host values, read without dispatching a tensor operator
    row_index = np.flatnonzero(scored > 0)
    if len(row_index) == 0:
        return "no completion token is scored in this micro-batch"
    if token_weights:  # a group with no scored row keeps its first row, for its prompt's tokens
        ids, first_row, group_rows = np.unique(group, return_index=True, return_counts=True)
        unscored = ~np.isin(ids, group[row_index])
        row_index = np.union1d(row_index, first_row[unscored])
    # Rows grouped by prompt, groups in order of first appearance, rows in batch order within a group
    _, first_seen, group_rank = np.unique(group[row_index], return_index=True, return_inverse=True)
    group_rank = np.argsort(np.argsort(first_seen))[group_rank]
    order = np.lexsort((row_index, group_rank))
    row_index, group_rank = row_index[order], group_rank[order]
    counts = np.bincount(group_rank)
    first = row_index[np.cumsum(counts) - counts]  # one row per group
    prompt_len = plen[first]
    if (plen[row_index] != prompt_len[group_rank]).any():
        raise ValueError("Rows grouped together have prompts of different lengths: the grouping is wrong.")
    if (prompt_len == 0).any():
        return "an empty prompt has no token to condition its completion on"
    n = scored[row_index]  # labels per segment
    m = n + 1 if token_weights else n  # inputs per segment: [prompt[-1], c[0], ..., c[m - 2]]
    body = prompt_len - 1
    body_width, row_length = int(body.max()), int(m.max())
    groups, num_segments = len(first), len(row_index)

    # Flat index into input_ids (and, for labels, N_in = the -100 sentinel) of every packed position
    flat_width = num_rows * width
    j = np.arange(body_width)
    in_body = j[None, :] < body[:, None]
    body_col = np.where(in_body, prompt_width - prompt_len[:, None] + j[None, :], prompt_width - 1)
    body_tokens = first[:, None] * width + body_col
    body_pos = body_col
    c = np.arange(row_length)
    in_row, labeled = c[None, :] < m[:, None], c[None, :] < n[:, None]
    seg_col = prompt_width - 1 + c[None, :]  # [prompt[-1], c[0], ...] sit in these columns of stock's row
    seg_tokens = row_index[:, None] * width + np.where(in_row, seg_col, prompt_width - 1)
    seg_labels = np.where(labeled, row_index[:, None] * width + seg_col + 1, flat_width)
    tokens = np.concatenate([body_tokens.reshape(-1), seg_tokens.reshape(-1)])
    labels = np.concatenate([np.full(body_tokens.size, flat_width), seg_labels.reshape(-1)])
    positions = np.concatenate([body_pos.reshape(-1), np.broadcast_to(seg_col, seg_tokens.shape).reshape(-1)])
    total = tokens.size
    # Where each (row, column) log-prob of stock's (B, C) layout is: its segment position, or the zero at N
    unpack = np.full((num_rows, logits_to_keep), total, dtype=np.int64)
    seg_start = groups * body_width + np.arange(num_segments)[:, None] * row_length
    cols = np.broadcast_to(c, labeled.shape)
    unpack[np.broadcast_to(row_index[:, None], labeled.shape)[labeled], cols[labeled]] = (
        seg_start + c[None, :])[labeled]  # fmt: skip
    parts = [tokens, labels, positions, unpack.reshape(-1)]
    if group_sources:
        seg_cols = np.where(in_row, seg_col, prompt_width - 1)
        parts.append(np.concatenate([(np.arange(groups)[:, None] * width + body_col).reshape(-1),
                                     (group_rank[:, None] * width + seg_cols).reshape(-1)]))  # fmt: skip
    if token_weights:
        stock_rows = group_rows[np.searchsorted(ids, group[first])]  # each group's rows in stock's micro-batch
        body_weight = np.where(in_body, stock_rows[:, None], 0)
        # The prompt's last token: once per stock row; the group's first segment counts the rows without a segment
        opening = np.ones(num_segments, dtype=np.int64)
        opening[np.cumsum(counts) - counts] += stock_rows - counts
        seg_weight = np.where(c[None, :] == 0, opening[:, None], 1) * in_row
        parts.append(np.concatenate([body_weight.reshape(-1), seg_weight.reshape(-1)]))

    layout, on_device = host_layout(counts, body, row_length, int((prompt_len[group_rank] + n).max()), parts, device,
                                    dtype)  # fmt: skip
    weights = on_device.pop().view(1, total) if token_weights else None
    group_source = on_device.pop() if group_sources else None
    index, label_index, position_ids, unpack_index = on_device
    ids = torch.cat([input_ids.view(-1), input_ids.new_full((1,), -100)])
    gathered = ids.index_select(0, torch.cat([index, label_index]))
    return PackedBatch(
        input_ids=gathered[:total].view(1, total),
        position_ids=position_ids.view(1, total),
        shift_labels=gathered[total:].view(1, total),
        unpack_index=unpack_index,
        layout=layout,
        num_rows=num_rows,
        num_cols=logits_to_keep,
        num_real_tokens=int(body.sum() + m.sum()),
        token_weights=weights,
        source_index=index,
        first_rows=first,
        group_source_index=group_source,
    )
