"""
A no-grad pass's chunks ([`scoring_chunks`]): TRL chunks a log-prob pass by rows, so that at one or two rows per chunk
each group's prompt is forwarded by every chunk holding one of its rows. Here the rows are merged into chunks no
larger than one of stock's forwards, each split group's prompt held ([`tree.holds.plan_holds`]): kept only where
every prompt they count as held is ([`prompts_held`]). Where every forward gathers parameters from all processes,
which chunks' own forwards encode images must agree too ([`chunks_encoding`]).
"""

from typing import TYPE_CHECKING

import numpy as np


if TYPE_CHECKING:
    from .holds import HoldPlan


def scoring_chunks(group: np.ndarray, plen: np.ndarray, scored: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """
    A no-grad pass's rows (TRL's order) as consecutive `(start, end)` chunks, each forwarding at most `budget` tokens
    (what one of stock's chunks forwards: its rows times the batch's width). A group whose prompt and rows fit what is
    left of the chunk goes in whole, its prompt forwarded there; any other is split over two chunks at least, so that
    its prompt is held (forwarded alone, at most a row's width) and its rows count only their scored tokens. Stock
    chunks by rows whatever their prompts: at one row per chunk a group's `k` rows take `k` forwards, here about two.
    The caller keeps these chunks only where every prompt they count as held is ([`prompts_held`]).
    """
    rows = len(group)
    total = {}  # each group's scored tokens
    last = {}  # each group's last row
    for row in range(rows):
        key = int(group[row])
        total[key] = total.get(key, 0) + int(scored[row])
        last[key] = row
    chunks, start, tokens, first_row, held = [], 0, 0, {}, set()
    for row in range(rows):
        key = int(group[row])
        if key not in first_row:
            first_row[key] = row
            if tokens + int(plen[row]) + total[key] > budget:
                held.add(key)
        cost = int(scored[row]) + (int(plen[row]) if key not in held and first_row[key] == row else 0)
        whole_here = key in held and row == last[key] and first_row[key] >= start
        if row > start and (tokens + cost > budget or whole_here):  # (a held group never lies in one chunk)
            chunks.append((start, row))
            start, tokens = row, 0
        tokens += cost
    chunks.append((start, rows))
    return chunks


def prompts_held(plan: "HoldPlan | None", chunks: list[tuple[int, int]], group: np.ndarray, plen: np.ndarray,
                 scored: np.ndarray) -> bool:  # fmt: skip
    """Whether every row of a group whose rows `chunks` split reads its prompt held (all of it but its last token, the
    row's first own input), as [`scoring_chunks`] counted it."""
    chunk_of = np.repeat(np.arange(len(chunks)), [end - start for start, end in chunks])
    split = {int(g) for g in np.unique(group) if len(np.unique(chunk_of[group == g])) > 1}
    for index, (start, end) in enumerate(chunks):
        rows = np.arange(start, end)
        members = rows[scored[start:end] > 0] if scored[start:end].any() else rows
        for row in members:
            if int(group[row]) in split and (plan is None or plan.chunks[index].skip[row - start] < plen[row] - 1):
                return False
    return True


def chunks_encoding(plan: "HoldPlan | None", chunks: list[tuple[int, int]], scored: np.ndarray,
                    with_images: np.ndarray, full: bool) -> np.ndarray:  # fmt: skip
    """Per chunk `(start, end)` of `scored` rows (`with_images`: the rows with images), whether its own forward encodes
    images: a member row (as [`tree.holds.plan_holds`] counts them, `full` alike) reading no held prompt has images.
    Those forwards call the vision tower, the others not: where every forward gathers parameters from all processes,
    they must agree too."""
    out = np.zeros(len(chunks), dtype=np.int64)
    for index, (start, end) in enumerate(chunks):
        members = np.arange(end - start) if full or not scored[start:end].any() else np.flatnonzero(scored[start:end])
        key = plan.chunks[index].key[members] if plan is not None else np.full(len(members), -1)
        out[index] = bool((with_images[start + members] & (key < 0)).any())
    return out
