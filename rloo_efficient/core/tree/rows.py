"""
The batch's rows, as the packed forwards read them: each row's group, prompt length, scored completion length and
tokens, in one small CPU tensor built once per generation batch from the token lists TRL holds, which TRL's shuffle
and split carry with the batch as a host array per row (`rloo_rows`: [`carried`]); and what tells prompts apart
(their tokens, their images' pixels).
"""

import hashlib
import json

import numpy as np
import torch


PAD = -1  # after a row's tokens in that tensor


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


def row_groups(prompt_ids: list[list[int]], scored_lengths: list[int], images: list | None = None,
               completion_ids: list[list[int]] | None = None) -> torch.Tensor:  # fmt: skip
    """
    The `(B, 3 + W)` CPU tensor of [group id, prompt length, scored completion length, the row's tokens] per row: its
    prompt and the scored part of its completion, then [`PAD`]. Rows with the same prompt tokens share a group, and
    with `images` (each row's, or None) the same images too: an image's tokens are the same placeholders whatever its
    pixels ([`prompt_key`] tells images apart by their content). Without `completion_ids`, no two rows' completions
    are taken to agree (nothing after the prompts is shared). Built once per generation batch from TRL's token lists;
    it is shuffled and split with the batch like any other field.
    """
    keys = [list(ids) for ids in prompt_ids]
    if images is not None:
        keys = [prompt_key([ids, image]) for ids, image in zip(keys, images, strict=True)]
    groups = group_ids_for(keys).numpy()
    count = len(prompt_ids)
    if completion_ids is None:  # a token no other row has: each completion its own
        completion_ids = [[-2 - row] * n for row, n in enumerate(scored_lengths)]
    rows = [list(ids) + list(completion)[:n] for ids, completion, n in
            zip(prompt_ids, completion_ids, scored_lengths, strict=True)]  # fmt: skip
    width = max((len(row) for row in rows), default=0)
    table = np.full((count, 3 + width), PAD, dtype=np.int64)
    table[:, 0] = groups
    table[:, 1] = [len(ids) for ids in prompt_ids]
    table[:, 2] = scored_lengths
    for row, tokens in enumerate(rows):
        table[row, 3 : 3 + len(tokens)] = tokens
    return torch.from_numpy(table)


class CarriedRows(list):
    """
    The rows of a [`row_groups`] tensor as the batch carries them: a list of host arrays, one per row, which TRL's
    shuffle and split take row by row as they take any list (a tensor field would be copied by each shuffle). TRL's
    shuffle indexes it with each entry of its permutation, a host tensor: read through NumPy, a host read with no
    operator (a tensor's `item()` would count as a device read in the operator counts); a device's entry is read as
    any list reads it.
    """

    def __getitem__(self, key):
        if isinstance(key, torch.Tensor) and key.ndim == 0 and key.device.type == "cpu":
            key = int(key.numpy())
        return super().__getitem__(key)


def carried(rows: torch.Tensor) -> CarriedRows:
    """A [`row_groups`] tensor as the batch carries it ([`CarriedRows`]); [`table_of`] gives the tensor back."""
    return CarriedRows(rows.numpy())


def table_of(rows: list[np.ndarray]) -> torch.Tensor:
    """The [`row_groups`] tensor of rows a batch carried ([`carried`]), in their order."""
    return torch.from_numpy(np.stack(rows)) if len(rows) else torch.empty(0, 3, dtype=torch.int64)


def row_tokens(rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """`(group, prompt length, scored length, each row's tokens)` of a [`row_groups`] tensor, on the host."""
    table = rows.numpy()
    group, plen, scored = table[:, 0], table[:, 1], table[:, 2]
    return group, plen, scored, [table[row, 3 : 3 + plen[row] + scored[row]] for row in range(len(table))]


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


def scored_lengths(completion_ids: list[list[int]], ends: set | None) -> list[int]:
    """Completion tokens stock TRL scores per row: all of them, or with `ends` (TRL's `mask_truncated_completions`:
    its end and padding tokens) none for a completion that does not end in one of them (truncated)."""
    if ends is None:
        return [len(ids) for ids in completion_ids]
    return [len(ids) if ids and ids[-1] in ends else 0 for ids in completion_ids]
