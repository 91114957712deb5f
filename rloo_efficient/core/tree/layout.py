"""
A [`tree.radix.Tree`] as the index tensors the layers of a packed forward read: the attention's parts and the recurrent
layers' levels. Built on the host in NumPy, sent to the device in one copy, passed in the model call's keyword
arguments (`rloo_prefix_layout=`), which transformers hands to every attention and recurrent layer and which gradient
checkpointing's recomputation receives again.

A token attends to its ancestors' tokens and causally within its own node. The attention is computed in parts, each one
batched kernel call over padded blocks gathered from the flat sequence (the flat sequence itself has no padding):

- the nodes' own tokens, causal: nodes bucketed by length (within a factor [`BUCKET_RATIO`] of their bucket's longest,
  so that padding costs at most that factor squared of a block's work, or a few short nodes with at most
  [`SMALL_PADDING`] padding slots in all);
- per tree level `l`: each node at depth `l` with descendants, its tokens read (all of them) by every token of its
  subtree below it (contiguous in the depth-first flat order); the nodes bucketed alike by their subtrees' sizes.

On a device with a variable-length kernel (CUDA: [`VARLEN_DEVICES`]) the layout also carries the same parts as
variable-length calls ([`Packed`]): the nodes as the flat sequence's sequences, and per level the nodes' subtrees and
tokens gathered without padding, with their offsets; and, where copying each node's ancestors' keys costs little
([`FOLD_COPIES`]), the whole attention as one call, each node reading its ancestors' keys joined before its own.

The parts are merged by log-sum-exp ([`attention.tree`]). The number of kernel calls per layer is the number of
buckets, a few per level: it does not grow with the number of rows or nodes. A recurrent layer runs level by level,
each level's nodes bucketed by length: each node starts from its parent's final state and convolution tail
([`layers.recurrent`]).
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from .radix import Tree


# The model call's keyword that carries the layout to every attention and recurrent layer (transformers passes its
# keyword arguments down, and gradient checkpointing's recomputation receives them again)
LAYOUT_KWARG = "rloo_prefix_layout"
# A 4-D attention mask is returned as-is by transformers' mask builders: the packed forward needs none, so it passes
# this empty placeholder and no (L, L) mask is ever built
NO_MASK = torch.empty(1, 1, 0, 0)


# Nodes in one call are at least 1 / BUCKET_RATIO as long as its longest (measured on CPU: experiments/bench_tree.py
# --buckets, results/tree_buckets.md: on the reasoning shape 1.5 and 2 take the same time, 4 takes 1.24x and one padded
# call 1.41x; 2 makes fewer calls), or shorter where the call's padding stays within SMALL_PADDING slots in all: each
# call costs a gather, a kernel and a scatter (about twenty operators, each a launch on a GPU), and a few short nodes
# are not worth them (one call for ragged completions of at most 512 tokens, not one per power of two of their
# lengths: tests/test_op_count.py)
BUCKET_RATIO = 2.0
SMALL_PADDING = 256
# Devices whose layouts also carry the variable-length calls ([`Packed`]): flash's on CUDA, where it runs
# ([`attention.checks.varlen_config`]); elsewhere the length buckets, which the CPU kernel needs
VARLEN_DEVICES = ("cuda",)
# At most this many runs of keys (a held prompt's, a row's own) are joined by one concatenation of views: past it one
# gather (the rows of a large micro-batch), as a view costs host time per run where the gather is one operator
MAX_JOINED_RUNS = 8
# On a variable-length device the whole attention is one causal call per layer where each node's keys can be its
# ancestors' (held or in the tree) joined before its own ([`TreeLayout.held_nodes`]): no level's call, no log-sum-exp
# merge (with its backward, about a dozen operators per level and layer, each a launch a small micro-batch's GPU waits
# for). It copies each node's ancestors' keys and values (and sums their gradients back), so only where those copies,
# in tokens, are at most this many times the flat sequence. An estimate of where the bytes break even: the copies move
# about 24 bytes per copied token, key/value head and dimension (half precision; forward, checkpointing's recompute,
# backward); a level's merge about 150 per query token, query head and dimension (float32, several operators each
# way); with 4 query heads per key/value head and half the flat tokens reading a level, about 12 copies per flat token
FOLD_COPIES = 4


@dataclass(frozen=True)
class Blocks:
    """Padded blocks gathered from the flat sequence: `gather` (n, L) flat token of each slot (a real token of the
    block at its padding), `scatter` (n, L) the same with N (a dump row) at the padding, `padding` (n, L) bool. `run`:
    `(first, n L)` where the blocks are the flat sequence's tokens `[first, first + n L)` in order, with no padding (one
    node, or nodes of one length one after another): then they are a view of it, with no gather and no scatter."""

    gather: torch.Tensor
    scatter: torch.Tensor
    padding: torch.Tensor
    run: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.gather.shape)


def _run(starts: np.ndarray, lengths: np.ndarray) -> tuple[int, int] | None:
    """`(first, tokens)` where the runs `[starts, starts + lengths)` are of one length and follow each other."""
    if len(starts) == 0 or (lengths != lengths[0]).any() or (np.diff(starts) != lengths[0]).any():
        return None
    return int(starts[0]), int(lengths.sum())


@dataclass(frozen=True)
class Part:
    """Level `l` of the tree: each of its `A` nodes with descendants (keys, `(A, Kmax)`) read by its subtree below it
    (queries, `(A, Qmax)`); `key_length` (A,) its tokens, `key_end_position` (A,) the position of its last token."""

    queries: Blocks
    keys: Blocks
    key_length: torch.Tensor
    key_end_position: torch.Tensor
    padded_keys: bool  # whether some node is shorter than the longest (a key padding bias is needed)
    depth: int = 0  # the level's


@dataclass(frozen=True)
class HistoryPart:
    """A length bucket of nodes whose rows continue a cache held from an earlier call ([`generation.turn_cache`]): their tokens
    (queries, `(n, L)`) read their row's held keys, in row `rows` (n,) of the layer's cache: its columns `[first,
    first + count)` (each (n,)), all within the columns `span` = `(lo, hi)` the part reads; the held keys of every row
    end at `first_end` or after (a window of `w` reads from `first_end - (w - 1)` on: the queries all follow them)."""

    queries: Blocks
    rows: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor
    span: tuple[int, int]
    first_end: int


@dataclass(frozen=True)
class Rows:
    """Flat tokens one after another, unpadded: `scatter` (T,) their indices, or None where they are one `run`
    `(first, T)` of the flat sequence (read and written as [`Blocks`] are)."""

    scatter: torch.Tensor | None
    run: tuple[int, int] | None


@dataclass(frozen=True)
class Packed:
    """One variable-length kernel call ([`attention.kernels.varlen_forward`]): sequence `i` reads the keys `[cu_k[i],
    cu_k[i + 1])` of `keys` from the queries `[cu_q[i], cu_q[i + 1])` of `queries`; `cu_q`/`cu_k` (n + 1,) int32;
    `max_q`/`max_k` the longest sequence's."""

    queries: Rows
    keys: Rows
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    depth: int = 0  # a level's (its [`Part`]s', which pad the same call where the kernel fails)
    # Host: the keys as runs `(source, first, count)` one after another, `source` -1 for the flat sequence and `s` for
    # slot `s` (a few where a node reads its held prompt: then they are joined without an index)
    pieces: tuple[tuple[int, int, int], ...] | None = None


@dataclass(frozen=True)
class HeldPart:
    """Held nodes of one depth read by one length bucket of a forward's tokens ([`tree.holds`]): like a [`Part`], with
    the keys in slot `slot` of the held state the forward reads (`tokens` long: the keys' dump row)."""

    slot: int
    tokens: int
    queries: Blocks
    keys: Blocks
    key_length: torch.Tensor
    key_end_position: torch.Tensor
    padded_keys: bool


@dataclass(frozen=True)
class Level:
    """Nodes of one depth in one length bucket, for the recurrent layers: their tokens `(n, L)`, lengths, and each
    one's parent's index among the nodes of the depth above (its buckets' nodes in order; -1 at the roots)."""

    blocks: Blocks
    length: torch.Tensor  # (n,)
    parent: torch.Tensor  # (n,)
    real: torch.Tensor  # (n, L) bool


@dataclass(frozen=True)
class TreeLayout:
    """The packed forward's structure (see the module docstring); `memo` holds what every layer derives alike from it
    (a window's tails and biases, the recurrent forks' index), built by the first layer that needs it."""

    tokens: int  # N
    buckets: tuple[Blocks, ...]  # the nodes' own tokens, causal, by length
    image_buckets: tuple[Blocks, ...]  # nodes holding an image's tokens (Gemma's image blocks attend both ways)
    parts: tuple[Part, ...]  # per level with descendants, from the roots down, its nodes bucketed by subtree size
    levels: tuple[tuple[Level, ...], ...]  # the nodes of each depth by length bucket, from the roots down (recurrent
    # layers only: empty for a model without them)
    assemble: torch.Tensor | None  # (N,) each token's slot in the levels' blocks, flattened and concatenated
    positions: torch.Tensor  # (N,) each token's position in its rows
    span: int  # the longest row: a sliding window at least this long masks nothing
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    # Gemma's image prompts: each token's image block (N,) (-1 for text), whose tokens attend to each other both ways
    # on "all" layers or the "sliding" ones ([`attention.windows.block_bias`])
    token_blocks: torch.Tensor | None = None
    blocks_on: str = "all"
    # A continued prefill's nodes reading their rows' held keys (no gradient), merged after the parts
    history: tuple[HistoryPart, ...] = ()
    # The same attention as variable-length calls, for devices with such a kernel ([`VARLEN_DEVICES`]): every node's
    # own tokens, causal, as one call over the flat sequence (None where image nodes need their bias), and each
    # level's part, its nodes' subtrees reading their tokens; no padding, no gather of the nodes
    packed_nodes: Packed | None = None
    packed_parts: tuple[Packed, ...] = ()
    # Nodes held by an earlier forward and read here ([`tree.holds`]): their parts, the held state they read
    # ([`attention.held.HeldReads`], set by the caller), and per root bucket of the levels the row of each root's held
    # parent's state in the slots' concatenated states (its last row, zeros, for a root without one)
    held_parts: tuple[HeldPart, ...] = ()
    # Where the variable-length kernel runs and the copies allow ([`FOLD_COPIES`]): each node's own causal call with its
    # held ancestors' keys, then its ancestors' in the tree, before its own (aligned at its last query and key: every
    # ancestor's key, then its own causally), keys gathered from [the flat sequence | each slot's, in slot order]: the
    # nodes, the levels' parts and the held parts in one call
    held_nodes: Packed | None = None
    # Host: where the nodes are one row's path (each the previous one's child, in flat order, reading held nodes only
    # before the first), the held keys it reads first, `(slot, first, count)` each by depth (empty: none): then its
    # attention is one causal call over [those keys | the flat sequence] ([`chain_of`]); None where it is not
    chain: tuple[tuple[int, int, int], ...] | None = None
    held: object = None
    held_roots: tuple[torch.Tensor, ...] = ()
    # Host: each node's row in the recurrent layers' concatenated final states ([`level_order`])
    state_order: np.ndarray | None = None


def _blocks(starts: np.ndarray, lengths: np.ndarray, tokens: int, width: int | None = None) -> tuple[np.ndarray, ...]:
    """Host `(gather, scatter)` `(n, L)` of runs `[starts, starts + lengths)` of the flat sequence."""
    width = int(lengths.max()) if width is None else width
    slot = np.arange(width)[None, :]
    inside = slot < lengths[:, None]
    gather = starts[:, None] + np.minimum(slot, np.maximum(lengths[:, None] - 1, 0))
    return gather, np.where(inside, gather, tokens)


def _buckets(nodes: np.ndarray, lengths: np.ndarray, ratio: float) -> list[np.ndarray]:
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


def _grouped(items: list, key):
    """Consecutive runs of `items` with the same `key(item)`: `(key, run)` each."""
    runs: list = []
    for item in items:
        if runs and runs[-1][0] == key(item):
            runs[-1][1].append(item)
        else:
            runs.append((key(item), [item]))
    return runs


def _concatenated(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The flat tokens of the runs `[starts, starts + lengths)`, one after another."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))


def _contiguous(starts: np.ndarray, lengths: np.ndarray) -> tuple[int, int] | None:
    """`(first, tokens)` where the runs follow each other in the flat sequence."""
    if len(starts) == 0 or (starts[1:] != starts[:-1] + lengths[:-1]).any():
        return None
    return int(starts[0]), int(lengths.sum())


def _paths(tree: Tree) -> list[np.ndarray]:
    """Each node's ancestors in `tree`, root first (depth-first order: a parent comes before its children)."""
    paths: list[np.ndarray] = []
    for parent in tree.parent:
        paths.append(np.append(paths[parent], parent) if parent >= 0 else np.zeros(0, dtype=np.int64))
    return paths


def bucketed_blocks(starts: np.ndarray, lengths: np.ndarray, tokens: int,
                    ratio: float = BUCKET_RATIO) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:  # fmt: skip
    """Runs `[starts, starts + lengths)` of a flat sequence of `tokens`, bucketed by length as the nodes are: per
    bucket, `(its runs' indices, gather, scatter)` on the host (see [`Blocks`])."""
    runs = _buckets(np.arange(len(starts)), lengths, ratio) if len(starts) else []
    return [(run, *_blocks(starts[run], lengths[run], tokens)) for run in runs]


def level_order(tree: Tree, ratio: float = BUCKET_RATIO) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """The recurrent layers' levels of `tree`: per depth its nodes' length buckets, and each node's row in the final
    states of every depth's buckets concatenated (the order a recurrent layer's forward leaves them in)."""
    all_nodes = np.arange(len(tree.start))
    runs_by_depth, order, offset = [], np.zeros(len(all_nodes), dtype=np.int64), 0
    for depth in range(int(tree.depth.max()) + 1 if len(all_nodes) else 0):
        level = all_nodes[tree.depth == depth]
        runs = _buckets(level, tree.length[level], ratio)
        order[np.concatenate(runs)] = offset + np.arange(len(level))
        offset += len(level)
        runs_by_depth.append(runs)
    return runs_by_depth, order


def chain_of(tree: Tree, held_reads: list[tuple] = (), image_nodes: np.ndarray | None = None) -> tuple | None:
    """[`TreeLayout.chain`]: the held runs `(slot, first, count)` read by every token of a tree that is one path with
    consecutive positions (one row alone: a source's prompt and completion, a held row's completion), the runs' keys its
    positions before the path's first; None for any other tree (several rows, image nodes)."""
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


class _Sent:
    """The host arrays a layout sends to its device in one copy, appended by each section's plan in order, and read
    back in the same order once there (`take`)."""

    def __init__(self, tree: Tree):
        self.tree = tree
        self.arrays: list[np.ndarray] = []
        self._taken = None

    def blocks_of(self, nodes, starts=None, lengths=None) -> tuple:
        """Plans [`Blocks`] of `nodes` (or of the runs `[starts, starts + lengths)`): `(shape, run)`."""
        starts = self.tree.start[nodes] if starts is None else starts
        lengths = self.tree.length[nodes] if lengths is None else lengths
        gather, scatter = _blocks(starts, lengths, self.tree.num_tokens)
        self.arrays.extend([gather, scatter])
        return gather.shape, _run(starts, lengths)

    def packed_of(self, query_starts, query_lengths, key_starts, key_lengths) -> tuple:
        """Plans a [`Packed`] call: `(query run, key run, max_q, max_k)` (a run's indices are not sent)."""
        planned = []
        for starts, lengths in ((query_starts, query_lengths), (key_starts, key_lengths)):
            run = _contiguous(starts, lengths)
            if run is None:  # the tokens' indices, sent; a run needs none
                self.arrays.append(_concatenated(starts, lengths))
            planned.append(run)
        self.arrays.extend([np.concatenate([[0], np.cumsum(query_lengths)]),
                            np.concatenate([[0], np.cumsum(key_lengths)])])  # fmt: skip
        return (*planned, int(query_lengths.max()), int(key_lengths.max()))

    def send(self, device, extra: list[np.ndarray]) -> list[torch.Tensor]:
        """Copies every array (then `extra`'s) to `device` at once; returns `extra`'s there."""
        sizes = [a.size for a in [*self.arrays, *extra]]
        host = torch.from_numpy(np.concatenate([a.reshape(-1) for a in [*self.arrays, *extra]]).astype(np.int64))
        if torch.device(device).type != "cpu":
            host = host.pin_memory()
        flat = host.to(device, non_blocking=True).split(sizes)
        self._taken = iter(flat[: len(self.arrays)])
        return list(flat[len(self.arrays) :])

    def take(self, shape=None) -> torch.Tensor:
        value = next(self._taken)
        return value if shape is None else value.view(shape)

    def blocks(self, planned, dump: int | None = None) -> Blocks:
        """The [`Blocks`] `blocks_of` planned; padding where the scatter is the `dump` row (default: N)."""
        shape, run = planned
        gather, scatter = self.take(shape), self.take(shape)
        return Blocks(gather, scatter, scatter == (self.tree.num_tokens if dump is None else dump), run)

    def packed(self, planned, depth: int = 0) -> Packed:
        query_run, key_run, max_q, max_k = planned
        queries, keys = (Rows(None if run else self.take(), run) for run in (query_run, key_run))
        return Packed(queries, keys, self.take().to(torch.int32), self.take().to(torch.int32), max_q, max_k, depth)


def _below(tree: Tree) -> tuple[np.ndarray, np.ndarray]:
    """Where each node's descendants start in the flat sequence, and how many tokens its subtree holds below it (the
    queries of its level's part)."""
    below = tree.start + tree.length
    return below, tree.subtree_end - below


def _plan_parts(sent: _Sent, ratio: float) -> list[tuple]:
    """Each level's parts: its nodes with descendants, bucketed by their queries' work (their subtrees' tokens)."""
    tree = sent.tree
    all_nodes = np.arange(len(tree.start))
    below, queries = _below(tree)
    planned = []
    for depth in range(int(tree.depth.max()) + 1 if len(all_nodes) else 0):
        level = all_nodes[(tree.depth == depth) & (queries > 0)]
        for nodes in _buckets(level, queries[level], ratio) if len(level) else []:
            query_plan = sent.blocks_of(nodes, below[nodes], queries[nodes])
            key_plan = sent.blocks_of(nodes)
            sent.arrays.extend([tree.length[nodes], tree.position[nodes] + tree.length[nodes] - 1])
            planned.append((query_plan, key_plan, bool((tree.length[nodes] < tree.length[nodes].max()).any()),
                            depth))  # fmt: skip
    return planned


def _plan_packed_nodes(sent: _Sent) -> tuple:
    """The variable-length call of every node's own tokens: the flat sequence itself (the nodes one after another,
    depth-first)."""
    tree = sent.tree
    order = np.argsort(tree.start, kind="stable")
    planned = sent.packed_of(tree.start[order], tree.length[order], tree.start[order], tree.length[order])
    if planned[:2] != ((0, tree.num_tokens), (0, tree.num_tokens)):  # the call reads the flat sequence itself
        raise ValueError("The tree's nodes do not cover its flat sequence one after another.")
    return planned


def _plan_packed_parts(sent: _Sent) -> list[tuple]:
    """Each level's part as one variable-length call: its nodes' subtrees reading their tokens."""
    tree = sent.tree
    all_nodes = np.arange(len(tree.start))
    below, queries = _below(tree)
    planned = []
    for depth in range(int(tree.depth.max()) + 1):
        level = all_nodes[(tree.depth == depth) & (queries > 0)]
        level = level[np.argsort(tree.start[level], kind="stable")]
        if len(level):
            planned.append((sent.packed_of(below[level], queries[level], tree.start[level], tree.length[level]),
                            depth))  # fmt: skip
    return planned


def _plan_held_parts(sent: _Sent, held_reads: list[tuple], ratio: float) -> list[tuple]:
    """The held parts: per slot and depth (a token reads one held node per depth), the nodes bucketed by their
    queries."""
    reads_by = sorted(((slot, depth, slot_tokens, *rest) for slot, slot_tokens, depth, *rest in held_reads),
                      key=lambda read: read[:2])  # fmt: skip
    planned = []
    for (slot, _), reads in _grouped(reads_by, lambda read: read[:2]):
        slot_tokens = reads[0][2]
        read = np.array([r[3:] for r in reads], dtype=np.int64).reshape(-1, 5)
        for run in _buckets(np.arange(len(read)), read[:, 1], ratio):
            q_first, q_count, k_first, k_count, key_end = read[run].T
            query_plan = sent.blocks_of(None, q_first, q_count)
            gather, scatter = _blocks(k_first, k_count, slot_tokens)
            sent.arrays.extend([gather, scatter, k_count, key_end])
            planned.append((slot, slot_tokens, query_plan, (gather.shape, _run(k_first, k_count)),
                            bool((k_count < k_count.max()).any())))  # fmt: skip
    return planned


def _plan_fold(sent: _Sent, held_reads: list[tuple]) -> tuple | None:
    """[`TreeLayout.held_nodes`]: each node's keys, its held ancestors', its ancestors' in the tree, then its own,
    where the copies stay within [`FOLD_COPIES`]: `(max_q, max_k, runs joined or None)`, or None."""
    tree = sent.tree
    n = tree.num_tokens
    if not (held_reads or (tree.depth > 0).any()):
        return None
    order = np.argsort(tree.start, kind="stable")
    ancestor_runs, copies = [], 0  # each node's ancestors' keys, held then in the tree; what a fold would copy
    paths = _paths(tree)  # each node's ancestors in the tree, root first
    for node in order:
        start = int(tree.start[node])
        held = sorted((depth, slot, k_first, k_count) for slot, _, depth, q_first, q_count, k_first, k_count, _
                      in held_reads if q_first <= start < q_first + q_count)  # fmt: skip
        runs = [(slot, int(k_first), int(k_count)) for _, slot, k_first, k_count in held]
        runs += [(-1, int(tree.start[a]), int(tree.length[a])) for a in paths[node]]
        ancestor_runs.append(runs)
        if tree.depth[node] > 0:  # (a root's held prompt: read in one call whatever it costs, as measured)
            copies += sum(count for _, _, count in runs)
    if copies > FOLD_COPIES * n:
        return None
    slot_tokens = dict(sorted({read[0]: read[1] for read in held_reads}.items()))
    slot_start = dict(zip(slot_tokens, n + np.cumsum([0, *slot_tokens.values()])[:-1], strict=True))
    pieces, key_lengths, runs = [], [], []
    for node, node_runs in zip(order, ancestor_runs, strict=True):
        start, length = int(tree.start[node]), int(tree.length[node])
        for source, first, count in [*node_runs, (-1, start, length)]:
            pieces.append((slot_start[source] if source >= 0 else 0) + np.arange(first, first + count))
            if runs and runs[-1][0] == source and runs[-1][1] + runs[-1][2] == first:  # one run: joined
                runs[-1] = (source, runs[-1][1], runs[-1][2] + count)
            else:
                runs.append((source, first, count))
        key_lengths.append(sum(count for _, _, count in node_runs) + length)
    key_lengths = np.asarray(key_lengths, dtype=np.int64)
    sent.arrays.extend([np.concatenate(pieces), np.concatenate([[0], np.cumsum(tree.length[order])]),
                        np.concatenate([[0], np.cumsum(key_lengths)])])  # fmt: skip
    return int(tree.length.max()), int(key_lengths.max()), tuple(runs) if len(runs) <= MAX_JOINED_RUNS else None


def _plan_levels(sent: _Sent, ratio: float, recurrent: bool, held_roots: np.ndarray | None,
                 held_states: int) -> tuple[list[list], np.ndarray | None]:  # fmt: skip
    """The recurrent layers' levels ([`Level`]), and each token's slot in their blocks (`assemble`, sent after them):
    `(plans per depth, state order)`."""
    tree = sent.tree
    assemble = np.empty(tree.num_tokens if recurrent else 0, dtype=np.int64)
    slot_offset = 0
    runs_by_depth, state_order = level_order(tree, ratio) if recurrent else ([], None)
    up = state_order - np.concatenate([[0], np.cumsum([sum(len(r) for r in runs) for runs in runs_by_depth])])[
        tree.depth] if recurrent and len(tree.start) else None  # each node's order at its depth
    planned = []
    for depth, runs in enumerate(runs_by_depth):
        plans = []
        parents = [np.where(tree.parent[nodes] >= 0, up[np.maximum(tree.parent[nodes], 0)], -1) for nodes in runs]
        for nodes, parent in zip(runs, parents, strict=True):
            blocks = sent.blocks_of(nodes)
            sent.arrays.extend([tree.length[nodes], parent])
            if depth == 0 and held_roots is not None:
                sent.arrays.append(np.where(held_roots[nodes] >= 0, held_roots[nodes], held_states))
            width = blocks[0][1]
            # each token of these nodes: its slot in the flattened blocks of every depth and bucket, in order
            inside = np.arange(width)[None, :] < tree.length[nodes][:, None]
            slots = slot_offset + np.arange(len(nodes))[:, None] * width + np.arange(width)[None, :]
            assemble[(tree.start[nodes][:, None] + np.arange(width)[None, :])[inside]] = slots[inside]
            slot_offset += len(nodes) * width
            plans.append(blocks)
        planned.append(plans)
    sent.arrays.extend([assemble, tree.token_position])
    return planned, state_order


def _levels(sent: _Sent, planned: list[list], held_roots: np.ndarray | None) -> tuple[tuple, list]:
    """The [`Level`]s `_plan_levels` planned, and per root bucket its held parents' rows."""
    levels, roots = [], []
    for depth, plans in enumerate(planned):
        runs = []
        for blocks in plans:
            level_blocks = sent.blocks(blocks)
            length, parent = sent.take(), sent.take()
            if depth == 0 and held_roots is not None:
                roots.append(sent.take())
            runs.append(Level(level_blocks, length, parent, ~level_blocks.padding))
        levels.append(tuple(runs))
    return tuple(levels), roots


def tree_layout(tree: Tree, device, image_nodes: np.ndarray | None = None, ratio: float = BUCKET_RATIO,
                parts: list[np.ndarray] | None = None, recurrent: bool = True,
                held_reads: list[tuple] = (), held_roots: np.ndarray | None = None,
                held_states: int = 0) -> tuple[TreeLayout, list[torch.Tensor]]:  # fmt: skip
    """
    The [`TreeLayout`] of `tree` on `device`, with the integer arrays `parts` sent in the same copy (returned there).
    `image_nodes`: the nodes holding an image's tokens (their own self-attention calls). `recurrent`: whether the
    recurrent layers' levels are needed (a model with recurrent layers). `held_reads`: the held nodes this forward
    reads, `(slot, slot tokens, depth, first query, query count, first key, key count, key end position)` each (the
    queries a run of the flat sequence, the keys a run of the slot's); `held_roots`: per node, its held parent's row
    in the `held_states` rows of the slots' concatenated recurrent states (-1: none).
    """
    all_nodes = np.arange(len(tree.start))
    with_images = np.zeros(len(all_nodes), dtype=bool)
    if image_nodes is not None:
        with_images[image_nodes] = True
    sent = _Sent(tree)
    # Planned on the host, each section appending what it sends: then sent at once, and read back in the same order
    bucket_plans = [[sent.blocks_of(run) for run in _buckets(all_nodes[mask], tree.length[mask], ratio)]
                    for mask in (~with_images, with_images)]  # fmt: skip
    part_plans = _plan_parts(sent, ratio)
    varlen = torch.device(device).type in VARLEN_DEVICES and len(all_nodes) > 0
    # (image nodes need their bias: their own tokens in the buckets, the levels' parts variable-length)
    nodes_plan = _plan_packed_nodes(sent) if varlen and not with_images.any() else None
    packed_part_plans = _plan_packed_parts(sent) if varlen else []
    held_plans = _plan_held_parts(sent, held_reads, ratio)
    fold_plan = _plan_fold(sent, held_reads) if varlen and not with_images.any() else None
    level_plans, state_order = _plan_levels(sent, ratio, recurrent, held_roots, held_states)
    extra = sent.send(device, list(parts or []))

    buckets, image_buckets = (tuple(sent.blocks(planned) for planned in plans) for plans in bucket_plans)
    parts_out = []
    for query_plan, key_plan, padded, depth in part_plans:
        query_blocks, key_blocks = sent.blocks(query_plan), sent.blocks(key_plan)
        parts_out.append(Part(query_blocks, key_blocks, sent.take(), sent.take(), padded, depth))
    packed_nodes = sent.packed(nodes_plan) if nodes_plan is not None else None
    packed_parts = tuple(sent.packed(planned, depth) for planned, depth in packed_part_plans)
    held_parts = []
    for slot, slot_tokens, query_plan, key_plan, padded in held_plans:
        query_blocks, key_blocks = sent.blocks(query_plan), sent.blocks(key_plan, dump=slot_tokens)
        held_parts.append(HeldPart(slot, slot_tokens, query_blocks, key_blocks, sent.take(), sent.take(), padded))
    held_nodes = None
    if fold_plan is not None:
        max_q, max_k, runs = fold_plan
        key_index, cu_q, cu_k = sent.take(), sent.take().to(torch.int32), sent.take().to(torch.int32)
        held_nodes = Packed(Rows(None, (0, tree.num_tokens)), Rows(key_index, None), cu_q, cu_k, max_q, max_k,
                            pieces=runs)  # fmt: skip
    levels, roots = _levels(sent, level_plans, held_roots)
    assemble, positions = sent.take(), sent.take()
    span = int((tree.position + tree.length).max()) if len(all_nodes) else 0
    layout = TreeLayout(tree.num_tokens, buckets, image_buckets, tuple(parts_out), levels,
                        assemble if recurrent else None, positions, span, packed_nodes=packed_nodes,
                        packed_parts=packed_parts, held_parts=tuple(held_parts), held_nodes=held_nodes,
                        chain=chain_of(tree, held_reads, all_nodes[with_images]), held_roots=tuple(roots),
                        state_order=state_order)  # fmt: skip
    return layout, extra
