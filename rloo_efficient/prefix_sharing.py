"""
Each prompt once per group: grouping rows by prompt, and the packed shared-prefix forward.

Stock TRL scores a batch as `B` rows `[left-padded prompt | completion | right padding]`, so a group of `k`
completions carries `k` copies of its prompt through every forward. Here a group becomes one packed row

    [prompt[:-1] | prompt[-1], c_1[:-1] | prompt[-1], c_2[:-1] | ... ]       (p - 1 + sum_j n_j tokens)
     shared body  segment 1              segment 2

where `n_j` is completion `j`'s number of scored tokens. Each segment starts with a copy of the prompt's last token:
its hidden state is the one stock TRL reads at the prompt's last position to score the completion's first token,
so each segment scores its own completion's tokens `c_j[0..n_j-1]` through `shift_labels`, with no position
predicting two different labels. A completion's last token predicts nothing and is left out, as its logit is never
read by stock TRL either. Position ids continue from the prompt (`p - 1, p, ...` in each segment), and a 4-D mask
lets a token see the shared body and the earlier tokens of its own segment only. With rotary embeddings, attention
depends on relative positions only, so every scored log-prob equals stock TRL's to floating-point tolerance.
"""

import json
from dataclasses import dataclass

import torch
from torch import nn


def prompt_key(prompt) -> str:
    """A hashable key for a prompt: the string itself, or the JSON of a conversation."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def group_ids_for(prompts: list) -> torch.Tensor:
    """`(B,)` long tensor: rows with the same prompt string get the same id, numbered by first appearance."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(prompt_key(p), len(index)) for p in prompts], dtype=torch.long)


def shuffle_groups_dict(batch: dict, group_ids: torch.Tensor) -> dict:
    """
    Shuffles the rows of `batch` keeping each group's rows together, drawing the same `torch.randperm(B)` that
    TRL's `shuffle_sequence_dict` draws (so the random generator advances identically): groups are ordered by
    their first row in that permutation, and rows within a group by their order in it.
    """
    batch_size = len(group_ids)
    permutation = torch.randperm(batch_size)
    rank = torch.empty_like(permutation)
    rank[permutation] = torch.arange(batch_size)  # rank[row] = where the row lands in the row shuffle
    group_rank = {}
    for row in permutation.tolist():
        group_rank.setdefault(int(group_ids[row]), len(group_rank))
    order = sorted(range(batch_size), key=lambda row: (group_rank[int(group_ids[row])], int(rank[row])))
    order_t = torch.tensor(order, dtype=torch.long)

    def take(value):
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            return value if value.ndim == 0 else value[order_t.to(value.device)]
        if isinstance(value, list):
            return [value[i] for i in order]
        return value

    return {key: take(value) for key, value in batch.items()}


@dataclass
class PackedBatch:
    """A micro-batch packed one prompt group per row, and where its scored log-probs go in the `(B, C)` layout."""

    input_ids: torch.Tensor  # (G, L) packed tokens, G groups
    position_ids: torch.Tensor  # (G, L)
    segment_ids: torch.Tensor  # (G, L) 0: shared prompt body, s >= 1: completion segment s, -1: padding
    shift_labels: torch.Tensor  # (G, L) the token each position predicts, -100 where none is scored
    rows: torch.Tensor  # (N,) original row of each scored position (row-major over the packed batch)
    cols: torch.Tensor  # (N,) completion column of each scored position
    num_rows: int  # B
    num_cols: int  # C, the padded completion width

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens the model processes."""
        return int((self.segment_ids >= 0).sum())

    def attention_mask(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """
        `(G, 1, L, L)` mask: query `i` sees key `j <= i` when `j` is in the shared body or in `i`'s segment. Padding
        sees only itself (no fully masked row). Boolean (True = attend) when `dtype` is None, else additive
        (0 or the dtype's minimum), for attention implementations that add the mask to the scores.
        """
        seg = self.segment_ids
        length = seg.size(1)
        causal = torch.ones(length, length, dtype=torch.bool, device=seg.device).tril()
        seg_q, seg_k = seg.unsqueeze(2), seg.unsqueeze(1)  # (G, L, 1), (G, 1, L)
        allowed = causal & (seg_q >= 0) & ((seg_k == 0) | (seg_k == seg_q))
        allowed |= torch.eye(length, dtype=torch.bool, device=seg.device)
        allowed = allowed.unsqueeze(1)
        if dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )

    def model_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """
        Keyword arguments for `model(..., fused_lm_head=True)`. The mask is additive in the model's dtype: SDPA would
        convert a boolean mask to that form inside every layer and save each copy for backward, while one additive
        mask is shared by all layers (L^2 elements once instead of once per layer). Under autocast the compute dtype
        is not the weights', so the mask stays boolean there.
        """
        device_type = self.input_ids.device.type
        if torch.is_autocast_enabled(device_type):
            mask = self.attention_mask(None if _attn_implementation(model) == "sdpa" else torch.float32)
        else:
            mask = self.attention_mask(next(model.parameters()).dtype)
        return {
            "input_ids": self.input_ids,
            "attention_mask": mask,
            "position_ids": self.position_ids,
            "shift_labels": self.shift_labels,
        }

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`(G, L)` per-position values (zero where unscored) -> `(B, C)` in stock TRL's layout, differentiably."""
        values = packed[self.shift_labels != -100]  # row-major, the order `rows`/`cols` were built in
        out = packed.new_zeros(self.num_rows, self.num_cols)
        return out.index_put((self.rows, self.cols), values)


def pack_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    group_ids: torch.Tensor,
    pad_token_id: int,
) -> PackedBatch:
    """
    Packs stock TRL's `(B, P + C)` scoring batch (left-padded prompts, right-padded completions, the last
    `logits_to_keep` columns being the completion) one group per row. Rows with the same `group_ids` value must
    share their prompt; this is checked, since sharing a prompt that differs would silently change the result.
    """
    device = input_ids.device
    num_rows, width = input_ids.shape
    prompt_width = width - logits_to_keep
    prompt_ids, completion_ids = input_ids[:, :prompt_width], input_ids[:, prompt_width:]
    prompt_mask, completion_mask = attention_mask[:, :prompt_width].bool(), attention_mask[:, prompt_width:].bool()
    completion_lengths = completion_mask.sum(1).tolist()

    groups: dict[int, list[int]] = {}
    for row, gid in enumerate(group_ids.tolist()):
        groups.setdefault(gid, []).append(row)

    packed_tokens, packed_positions, packed_segments, packed_labels = [], [], [], []
    rows, cols = [], []
    for members in groups.values():
        first = members[0]
        for row in members[1:]:
            if not (torch.equal(prompt_ids[row], prompt_ids[first]) and torch.equal(prompt_mask[row], prompt_mask[first])):
                raise ValueError(f"Rows {first} and {row} are grouped together but their prompts differ.")
        prompt = prompt_ids[first][prompt_mask[first]]
        p = prompt.numel()
        if p == 0:
            raise ValueError(f"Row {first} has an empty prompt: there is no token to condition its completion on.")
        tokens = [prompt[:-1]]
        positions = [torch.arange(p - 1, device=device)]
        segments = [torch.zeros(p - 1, dtype=torch.long, device=device)]
        labels = [torch.full((p - 1,), -100, dtype=torch.long, device=device)]
        segment = 0
        for row in members:
            n = completion_lengths[row]
            if n == 0:  # nothing scored (masked truncated completion): stock TRL's log-probs are all zero
                continue
            if not completion_mask[row, :n].all():
                raise ValueError(f"Row {row}'s completion mask is not a prefix of ones; cannot pack it.")
            segment += 1
            completion = completion_ids[row, :n]
            tokens.append(torch.cat([prompt[-1:], completion[:-1]]))
            positions.append(torch.arange(p - 1, p - 1 + n, device=device))
            segments.append(torch.full((n,), segment, dtype=torch.long, device=device))
            labels.append(completion)
            rows.extend([row] * n)
            cols.extend(range(n))
        packed_tokens.append(torch.cat(tokens))
        packed_positions.append(torch.cat(positions))
        packed_segments.append(torch.cat(segments))
        packed_labels.append(torch.cat(labels))

    length = max(1, max(t.numel() for t in packed_tokens))

    def right_pad(seqs, value):
        out = torch.full((len(seqs), length), value, dtype=torch.long, device=device)
        for i, seq in enumerate(seqs):
            out[i, : seq.numel()] = seq
        return out

    return PackedBatch(
        input_ids=right_pad(packed_tokens, pad_token_id),
        position_ids=right_pad(packed_positions, 0),
        segment_ids=right_pad(packed_segments, -1),
        shift_labels=right_pad(packed_labels, -100),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        cols=torch.tensor(cols, dtype=torch.long, device=device),
        num_rows=num_rows,
        num_cols=logits_to_keep,
    )


def _attn_implementation(model: nn.Module) -> str:
    return getattr(model.config.get_text_config(), "_attn_implementation", None) or "eager"


# -- when packing is exact -------------------------------------------------------------------------------------------
_MASKABLE_ATTENTION = ("sdpa", "eager")


def unsupported_reason(model: nn.Module) -> str | None:
    """
    Why the packed forward cannot reproduce stock TRL's log-probs for `model`, or None when it can. Per-batch
    conditions (a sliding window shorter than the sequence) are checked by [`sliding_window_exceeded`].
    """
    text_config = model.config.get_text_config()
    if is_multimodal(model):
        return f"{type(model).__name__} is multimodal; its image tokens are not packed"
    if getattr(text_config, "rope_parameters", None) is None and getattr(text_config, "rope_theta", None) is None:
        return (
            f"{text_config.model_type} has no rotary position embeddings; with absolute positions, stock TRL's "
            f"left padding shifts every token's position, which a packed row cannot reproduce"
        )
    attn = _attn_implementation(model)
    if attn not in _MASKABLE_ATTENTION:
        return f"attention implementation {attn!r} takes no custom 4-D mask (use 'sdpa' or 'eager')"
    return dropout_reason(model)


def dropout_reason(model: nn.Module) -> str | None:
    """Active dropout draws a mask per token: a shared forward would draw different ones than stock TRL."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            return (
                f"dropout is active ({name}, p={module.p}); shared rows draw different dropout masks "
                f"(set disable_dropout=True)"
            )
    text_config = model.config.get_text_config()
    for key in ("attention_dropout", "hidden_dropout", "dropout"):
        if (getattr(text_config, key, 0.0) or 0.0) > 0:
            return f"dropout is active ({key}={getattr(text_config, key)}); set disable_dropout=True"
    return None


def is_multimodal(model: nn.Module) -> bool:
    config = model.config
    return config.get_text_config() is not config or getattr(config, "vision_config", None) is not None


def sliding_window(model: nn.Module) -> int | None:
    """The sliding window some of `model`'s attention layers apply, or None when none does."""
    text_config = model.config.get_text_config()
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if window is None or getattr(text_config, "use_sliding_window", True) is False:
        return None
    return window if layer_types is None or "sliding_attention" in layer_types else None


def sliding_window_exceeded(model: nn.Module, longest_sequence: int) -> str | None:
    """The reason to use the stock path for a batch whose longest prompt + completion exceeds a sliding window."""
    window = sliding_window(model)
    if window is not None and longest_sequence > window:
        return (
            f"a sequence of {longest_sequence} tokens exceeds the sliding window ({window}); the packed mask does not "
            f"reproduce the window"
        )
    return None
