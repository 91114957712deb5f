"""
The prefix tree over a micro-batch's rows: the one structure every packed forward reads.

Stock TRL holds a micro-batch as `B` rows `[left-padded prompt | completion | right padding]`: each prompt once per
row, each row padded to the longest. Here the rows' real tokens form a radix tree: a node is a run of tokens that every
row through it agrees on, and a row is a path from a root. The rows of a group share their prompt (groups are the
depth-2 case); prompts that open alike (a system prompt) share that opening; completions that open alike share it too.
A node is kept only where it saves enough tokens ([`MIN_SAVED_TOKENS`]); a smaller one is copied into its branches.

The packed sequence holds each node's tokens once, nodes in depth-first order (a node's subtree follows it), with no
padding. A position predicts the token after it, and two rows that part after a node predict different tokens there:
so every node but a root opens with a copy of its parent's last token, and a node of the tree over tokens `[s, e)`
holds the inputs `[s - 1, e - 1)` (with `shift`; a reward model reads hidden states, not predictions, and packs
`[s, e)`). Every position then predicts one token, inside its own node. With `ends` each row's last token is an input
too (an end marker after it), for a loss over every token stock's batch holds (the MoE load-balancing loss).

Everything here runs on the host, in NumPy, from the token lists TRL holds, in time linear in the rows' tokens (and a
sort of the rows); nothing reads a device value. [`tree.parts.TreeLayout`] turns it into the index tensors the
attention and recurrent layers use.
"""

from dataclasses import dataclass

import numpy as np


# A node shared by `b` branches saves `(b - 1) * length` tokens, and costs each layer one more attention part (a
# gather of its descendants' queries, a kernel call and a merge: about twenty operators) where it adds a level. Below
# this many saved tokens the node is copied into its branches. On CPU a level costs nothing measurable down to 28 saved
# tokens (experiments/bench_tree.py --threshold: kept / copied 0.9-1.15, the run-to-run spread, up to 896 saved tokens,
# 0.28 at 1,792; results/tree_threshold.md); the bound is for the GPU, where twenty launches per layer outweigh the
# linear layers' work on a few dozen tokens (not measured there yet). A template's opening tokens are not worth a level.
MIN_SAVED_TOKENS = 64
END = -1  # the end marker after a row (token ids are >= 0)


def ranges(starts, counts) -> np.ndarray:
    """Concatenated ranges `[starts[i], starts[i] + counts[i])`, without a loop."""
    counts = np.asarray(counts, dtype=np.int64)
    offsets = np.cumsum(counts) - counts
    return np.repeat(np.asarray(starts, dtype=np.int64) - offsets, counts) + np.arange(int(counts.sum()))


class _Node:
    """A node of the radix tree over the rows: tokens `[start, end)` of each row in `rows` (which agree there)."""

    __slots__ = ("start", "end", "rows", "children", "ended")

    def __init__(self, start: int, end: int, rows: np.ndarray):
        self.start, self.end, self.rows = start, end, rows
        self.children: list[_Node] = []
        self.ended: list[int] = []  # rows whose sequence ends with this node


def _radix(sequences: list[np.ndarray], keys: np.ndarray) -> _Node:
    """The radix tree of `sequences`, under an empty root; rows with different `keys` share nothing."""
    count = len(sequences)
    order = sorted(range(count), key=lambda row: (keys[row], sequences[row].tolist()))
    lengths = np.array([len(sequences[row]) for row in order], dtype=np.int64)
    common = np.zeros(count, dtype=np.int64)  # common[i]: the common prefix of sorted rows i - 1 and i
    for i in range(1, count):
        a, b = sequences[order[i - 1]], sequences[order[i]]
        if keys[order[i - 1]] == keys[order[i]]:
            m = min(len(a), len(b))
            differ = np.flatnonzero(a[:m] != b[:m])
            common[i] = differ[0] if differ.size else m
    order = np.asarray(order, dtype=np.int64)

    def build(lo: int, hi: int, start: int) -> _Node:
        end = int(lengths[lo]) if hi - lo == 1 else int(common[lo + 1 : hi].min())
        node = _Node(start, end, order[lo:hi])
        cuts = [lo, *(lo + 1 + np.flatnonzero(common[lo + 1 : hi] == end)).tolist(), hi]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            if b - a == 1 and lengths[a] == end:
                node.ended.append(int(order[a]))
            else:
                node.children.append(build(a, b, end))
        return node

    root = _Node(0, 0, order)
    cuts = [0, *(np.flatnonzero(common[1:] == 0) + 1).tolist(), count]
    root.children = [build(a, b, 0) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    return root


def _worth_keeping(node: _Node, start: int, min_saved: int) -> bool:
    """Whether a node with branches keeps its tokens once (else each branch gets a copy of them)."""
    branches = len(node.children) + len(node.ended)
    return (branches - 1) * (node.end - start) >= min_saved


def _pruned(node: _Node, min_saved: int, keep_roots: bool, depth: int = 0) -> list[_Node]:
    """The node (its start already moved up where its parent was copied into it) and its subtree, with each node not
    [`_worth_keeping`] copied into its branches: returns what stands in its place."""
    kept = []
    if node.children and depth > 0 and not (keep_roots and depth == 1) and not _worth_keeping(
        node, node.start, min_saved):  # fmt: skip
        for child in node.children:
            child.start = node.start
            kept += _pruned(child, min_saved, keep_roots, depth)
        kept += [_Node(node.start, node.end, np.array([row])) for row in node.ended]
        return kept
    children = []
    for child in node.children:
        children += _pruned(child, min_saved, keep_roots, depth + 1)
    node.children = children
    return [node]


@dataclass(frozen=True)
class Tree:
    """
    The packed sequence of a prefix tree, on the host: `M` nodes in depth-first order, each a run of the flat sequence
    holding the inputs `[position[n], position[n] + length[n])` of the rows through it (the same tokens in each).
    """

    num_rows: int  # B
    num_tokens: int  # N, the flat sequence's length (no padding)
    start: np.ndarray  # (M,) each node's first flat token
    length: np.ndarray  # (M,)
    depth: np.ndarray  # (M,) its number of ancestors
    parent: np.ndarray  # (M,) -1 for a root
    root: np.ndarray  # (M,) its root (itself for a root)
    subtree_end: np.ndarray  # (M,) the flat end of its subtree (its descendants are [start + length, subtree_end))
    position: np.ndarray  # (M,) the position in its rows of its first token (its position id)
    row: np.ndarray  # (M,) a row through it, whose tokens it holds
    weight: np.ndarray  # (M,) how many rows pass through it
    row_inputs: list[np.ndarray]  # per row, the flat index of each of its inputs, in order
    real_tokens: int  # the radix tree's own tokens (each shared run once, no copy of a parent's last token)

    @property
    def token_row(self) -> np.ndarray:
        """`(N,)` a row holding each flat token."""
        return np.repeat(self.row, self.length)

    @property
    def token_position(self) -> np.ndarray:
        """`(N,)` each flat token's position in its rows."""
        return ranges(self.position, self.length)

    @property
    def token_weight(self) -> np.ndarray:
        """`(N,)` how many rows hold each flat token."""
        return np.repeat(self.weight, self.length)


def build_tree(sequences: list, keys=None, shift: bool = True, ends: bool = False,
               min_saved: int = MIN_SAVED_TOKENS, keep_roots: bool = False) -> Tree:  # fmt: skip
    """
    The packed prefix tree of `sequences` (each row's real tokens, a list or array of ints).

    Args:
        keys: per row, rows that may share tokens (default: all). Rows whose prompts hold images of other pixels carry
            other keys: their placeholder tokens agree, their images do not.
        shift: each position predicts the next token (each node opens with its parent's last token); else a node holds
            its own tokens.
        ends: each row's last token is an input too (with `shift`).
        min_saved: a node is kept only where it saves at least this many tokens ([`MIN_SAVED_TOKENS`]).
        keep_roots: each key's first node is kept whatever it saves (it holds images, encoded once).
    """
    rows = [np.asarray(sequence, dtype=np.int64) for sequence in sequences]
    if ends:
        rows = [np.append(row, END) for row in rows]
    keys = np.zeros(len(rows), dtype=np.int64) if keys is None else np.asarray(keys)
    root = _radix(rows, keys)
    real_tokens = _count(root, rows)
    roots = []
    for child in root.children:
        roots += _pruned(child, min_saved, keep_roots, 1)

    starts, lengths, depths, parents, roots_of, ends_of, positions, reps, weights = ([] for _ in range(9))
    inputs_of: list[list[tuple[int, int]]] = [[] for _ in rows]  # per row, (flat start, count) of its inputs

    def visit(node: _Node, parent: int, depth: int, flat: int) -> int:
        first = max(node.start - 1, 0) if shift else node.start
        last = node.end - 1 if shift else node.end
        if last > first:  # an empty node (a root's one token, before its children's copies) is not materialized
            index = len(starts)
            starts.append(flat), lengths.append(last - first), depths.append(depth), parents.append(parent)
            roots_of.append(index if parent < 0 else roots_of[parent])
            positions.append(first), reps.append(int(node.rows[0])), weights.append(len(node.rows)), ends_of.append(0)
            for row in node.rows:
                inputs_of[row].append((flat, last - first))
            parent, depth, flat = index, depth + 1, flat + last - first
        for child in node.children:
            flat = visit(child, parent, depth, flat)
        if last > first:
            ends_of[index] = flat
        return flat

    total = 0
    for node in roots:
        total = visit(node, -1, 0, total)
    row_inputs = [ranges(*np.array(parts, dtype=np.int64).reshape(-1, 2).T) for parts in inputs_of]
    as_array = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    return Tree(len(rows), total, as_array(starts), as_array(lengths), as_array(depths), as_array(parents),
                as_array(roots_of), as_array(ends_of), as_array(positions), as_array(reps), as_array(weights),
                row_inputs, real_tokens)  # fmt: skip


def _count(node: _Node, rows: list[np.ndarray]) -> int:
    """Tokens in a radix (sub)tree, each node's once (an end marker is not a token)."""
    marker = node.end > node.start and rows[node.rows[0]][node.end - 1] == END
    return node.end - node.start - marker + sum(_count(child, rows) for child in node.children)
