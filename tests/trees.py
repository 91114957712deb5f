"""
Random rows that share prefixes the way RL batches do (a system prompt before every task, groups of completions of one
prompt, completions that open alike, rows that end inside another's tokens, one-token runs), and stock TRL's padded
batch of them: what the prefix-tree tests feed the packed forwards.
"""

import random

import torch

from rloo_efficient.core.tree.rows import row_groups


def random_rows(seed: int, max_depth: int = 4, max_children: int = 3, max_run: int = 9, vocab: int = 64,
                ends_inside: bool = True) -> list[list[int]]:  # fmt: skip
    """Rows as the paths of a random tree of token runs (depth 1 to `max_depth`, runs of 1 to `max_run` tokens); with
    `ends_inside`, some rows also stop at an inner run or inside one."""
    rng = random.Random(seed)
    depth = rng.randint(1, max_depth)
    rows: list[list[int]] = []

    def grow(prefix: list[int], level: int) -> None:
        run = prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_run))]
        if level == depth - 1 or rng.random() < 0.2:
            rows.append(run)
            return
        if ends_inside and rng.random() < 0.3:
            rows.append(run[: rng.randint(len(prefix) + 1, len(run))])  # a row ending at or inside this run
        for _ in range(rng.randint(1, max_children)):
            grow(run, level + 1)

    for _ in range(rng.randint(1, 2)):  # one tree, or two that share nothing
        grow([], 0)
    return rows


def stock_batch(prompts: list[list[int]], completions: list[list[int]], scored: list[int] | None = None):
    """Stock TRL's `(B, P + C)` batch (left-padded prompts, right-padded completions), its 2-D attention mask, the
    completion width `C`, and the rows' structure ([`row_groups`], with the completions' tokens). `scored` (default:
    every completion token) is how many of each completion's tokens stock's mask holds."""
    scored = [len(c) for c in completions] if scored is None else scored
    width_p = max(len(p) for p in prompts)
    width_c = max(1, max(len(c) for c in completions))
    ids, mask = [], []
    for prompt, completion, n in zip(prompts, completions, scored, strict=True):
        ids.append([0] * (width_p - len(prompt)) + prompt + completion + [0] * (width_c - len(completion)))
        mask.append([0] * (width_p - len(prompt)) + [1] * (len(prompt) + n) + [0] * (width_c - n))
    return torch.tensor(ids), torch.tensor(mask), width_c, row_groups(prompts, scored, None, completions)


def split_rows(rows: list[list[int]], seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each row cut at a random point into a prompt (at least one token) and a completion (maybe empty)."""
    rng = random.Random(seed)
    cuts = [rng.randint(1, len(row)) for row in rows]
    return [row[:cut] for row, cut in zip(rows, cuts)], [row[cut:] for row, cut in zip(rows, cuts)]
