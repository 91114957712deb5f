"""
Runs of a packed forward's flat sequence, on the host: the length buckets its kernel calls take ([`length_buckets`],
[`bucketed_blocks`]), their padded blocks ([`padded_blocks`]), and the orders the layers read a tree in: its recurrent
levels ([`level_order`]) and, where it is one row's path, one causal call ([`chain_of`]).
"""

import numpy as np

from .radix import Tree


# Nodes in one call are at least 1 / BUCKET_RATIO as long as its longest (measured on CPU: experiments/bench_tree.py
# --buckets, results/tree_buckets.md: on the reasoning shape 1.5 and 2 take the same time, 4 takes 1.24x and one padded
# call 1.41x; 2 makes fewer calls), or shorter where the call's padding stays within SMALL_PADDING slots in all: each
# call costs a gather, a kernel and a scatter (about twenty operators, each a launch on a GPU), and a few short nodes
# are not worth them (one call for ragged completions of at most 512 tokens, not one per power of two of their
# lengths: tests/test_op_count.py)
BUCKET_RATIO = 2.0
SMALL_PADDING = 256


def one_run(starts: np.ndarray, lengths: np.ndarray) -> tuple[int, int] | None:
    """`(first, tokens)` where the runs `[starts, starts + lengths)` are of one length and follow each other."""
    if len(starts) == 0 or (lengths != lengths[0]).any() or (np.diff(starts) != lengths[0]).any():
        return None
    return int(starts[0]), int(lengths.sum())


def padded_blocks(starts: np.ndarray, lengths: np.ndarray, tokens: int,
                  width: int | None = None) -> tuple[np.ndarray, ...]:  # fmt: skip
    """Host `(gather, scatter)` `(n, L)` of runs `[starts, starts + lengths)` of the flat sequence."""
    width = int(lengths.max()) if width is None else width
    slot = np.arange(width)[None, :]
    inside = slot < lengths[:, None]
    gather = starts[:, None] + np.minimum(slot, np.maximum(lengths[:, None] - 1, 0))
    return gather, np.where(inside, gather, tokens)


def length_buckets(nodes: np.ndarray, lengths: np.ndarray, ratio: float) -> list[np.ndarray]:
    """`nodes` split into runs of similar `lengths` (one per node): longest first, each run within `ratio` of its
    longest, or padded by at most [`SMALL_PADDING`] slots in all."""
    order = np.argsort(-lengths, kind="stable")
    nodes, lengths = nodes[order], lengths[order]
    runs, first, padding = [], 0, 0
    for i in range(1, len(nodes) + 1):
        if i < len(nodes):
            padding += int(lengths[first] - lengths[i])
            if lengths[i] * ratio > lengths[first] or padding <= SMALL_PADDING:
                continue
        runs.append(nodes[first:i])
        first, padding = i, 0
    return runs


def grouped(items: list, key):
    """Consecutive runs of `items` with the same `key(item)`: `(key, run)` each."""
    runs: list = []
    for item in items:
        if runs and runs[-1][0] == key(item):
            runs[-1][1].append(item)
        else:
            runs.append((key(item), [item]))
    return runs


def concatenated(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The flat tokens of the runs `[starts, starts + lengths)`, one after another."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))


def contiguous(starts: np.ndarray, lengths: np.ndarray) -> tuple[int, int] | None:
    """`(first, tokens)` where the runs follow each other in the flat sequence."""
    if len(starts) == 0 or (starts[1:] != starts[:-1] + lengths[:-1]).any():
        return None
    return int(starts[0]), int(lengths.sum())


def ancestor_paths(tree: Tree) -> list[np.ndarray]:
    """Each node's ancestors in `tree`, root first (depth-first order: a parent comes before its children)."""
    paths: list[np.ndarray] = []
    for parent in tree.parent:
        paths.append(np.append(paths[parent], parent) if parent >= 0 else np.zeros(0, dtype=np.int64))
    return paths


def bucketed_blocks(starts: np.ndarray, lengths: np.ndarray, tokens: int,
                    ratio: float = BUCKET_RATIO) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:  # fmt: skip
    """Runs `[starts, starts + lengths)` of a flat sequence of `tokens`, bucketed by length as the nodes are: per
    bucket, `(its runs' indices, gather, scatter)` on the host (see [`tree.parts.Blocks`])."""
    runs = length_buckets(np.arange(len(starts)), lengths, ratio) if len(starts) else []
    return [(run, *padded_blocks(starts[run], lengths[run], tokens)) for run in runs]


def level_order(tree: Tree, ratio: float = BUCKET_RATIO) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """The recurrent layers' levels of `tree`: per depth its nodes' length buckets, and each node's row in the final
    states of every depth's buckets concatenated (the order a recurrent layer's forward leaves them in)."""
    all_nodes = np.arange(len(tree.start))
    runs_by_depth, order, offset = [], np.zeros(len(all_nodes), dtype=np.int64), 0
    for depth in range(int(tree.depth.max()) + 1 if len(all_nodes) else 0):
        level = all_nodes[tree.depth == depth]
        runs = length_buckets(level, tree.length[level], ratio)
        order[np.concatenate(runs)] = offset + np.arange(len(level))
        offset += len(level)
        runs_by_depth.append(runs)
    return runs_by_depth, order


def chain_of(tree: Tree, held_reads: list[tuple] = (), image_nodes: np.ndarray | None = None) -> tuple | None:
    """[`tree.parts.TreeLayout.chain`]: the held runs `(slot, first, count)` read by every token of a tree that is one
    path with consecutive positions (one row alone: a source's prompt and completion, a held row's completion), the
    runs' keys its positions before the path's first; None for any other tree (several rows, image nodes)."""
    if len(tree.start) == 0 or (image_nodes is not None and len(image_nodes)):
        return None
    order = np.argsort(tree.start, kind="stable")
    start, position = tree.start[order], tree.position[order]
    if tree.parent[order[0]] != -1 or (tree.parent[order[1:]] != order[:-1]).any() or (
            position - position[0] != start).any():  # fmt: skip
        return None
    reads = sorted((depth, slot, k_first, k_count, key_end)
                   for slot, _, depth, q_first, q_count, k_first, k_count, key_end in held_reads
                   if (q_first, q_count) == (0, tree.num_tokens))  # fmt: skip
    if len(reads) != len(held_reads):  # a held node read by part of the path
        return None
    expected = 0  # the position of the next key: the held runs, then the path, one after another
    for _, _, _, count, key_end in reads:
        if key_end - count + 1 != expected:
            return None
        expected = key_end + 1
    if reads and position[0] != expected:
        return None
    return tuple((int(slot), int(first), int(count)) for _, slot, first, count, _ in reads)
