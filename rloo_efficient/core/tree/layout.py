"""
A [`tree.radix.Tree`] as the index tensors the layers of a packed forward read: the attention's parts and the recurrent
layers' levels. Built on the host in NumPy, sent to the device in one copy, passed in the model call's keyword
arguments (`rloo_prefix_layout=`), which transformers hands to every attention and recurrent layer and which gradient
checkpointing's recomputation receives again. Its parts' types are in [`tree.parts`]; the runs and length buckets
they are planned from, in [`tree.runs`].

A token attends to its ancestors' tokens and causally within its own node. The attention is computed in parts, each one
batched kernel call over padded blocks gathered from the flat sequence (the flat sequence itself has no padding):

- the nodes' own tokens, causal: nodes bucketed by length (within a factor [`tree.runs.BUCKET_RATIO`] of their bucket's
  longest, so that padding costs at most that factor squared of a block's work, or a few short nodes with at most
  [`tree.runs.SMALL_PADDING`] padding slots in all);
- per tree level `l`: each node at depth `l` with descendants, its tokens read (all of them) by every token of its
  subtree below it (contiguous in the depth-first flat order); the nodes bucketed alike by their subtrees' sizes.

On a device with a variable-length kernel (CUDA: [`VARLEN_DEVICES`]) the layout also carries the same parts as
variable-length calls ([`tree.parts.Packed`]): the nodes as the flat sequence's sequences, and per level the nodes'
subtrees and tokens gathered without padding, with their offsets; and, where copying each node's ancestors' keys costs
little ([`FOLD_COPIES`]), the whole attention as one call, each node reading its ancestors' keys joined before its own.

The parts are merged by log-sum-exp ([`attention.tree`]). The number of kernel calls per layer is the number of
buckets, a few per level: it does not grow with the number of rows or nodes. A recurrent layer runs level by level,
each level's nodes bucketed by length: each node starts from its parent's final state and convolution tail
([`layers.recurrent`]).
"""

import numpy as np
import torch

from .parts import Blocks, HeldPart, Level, Packed, Part, Rows, TreeLayout
from .radix import Tree
from .runs import (
    BUCKET_RATIO,
    ancestor_paths,
    chain_of,
    concatenated,
    contiguous,
    grouped,
    length_buckets,
    level_order,
    one_run,
    padded_blocks,
)


# The model call's keyword that carries the layout to every attention and recurrent layer (transformers passes its
# keyword arguments down, and gradient checkpointing's recomputation receives them again)
LAYOUT_KWARG = "rloo_prefix_layout"
# A 4-D attention mask is returned as-is by transformers' mask builders: the packed forward needs none, so it passes
# this empty placeholder and no (L, L) mask is ever built
NO_MASK = torch.empty(1, 1, 0, 0)


# Devices whose layouts also carry the variable-length calls ([`tree.parts.Packed`]): flash's on CUDA, where it runs
# ([`attention.checks.varlen_config`]); elsewhere the length buckets, which the CPU kernel needs
VARLEN_DEVICES = ("cuda",)
# At most this many runs of keys (a held prompt's, a row's own) are joined by one concatenation of views: past it one
# gather (the rows of a large micro-batch), as a view costs host time per run where the gather is one operator
MAX_JOINED_RUNS = 8
# On a variable-length device the whole attention is one causal call per layer where each node's keys can be its
# ancestors' (held or in the tree) joined before its own ([`tree.parts.TreeLayout.held_nodes`]): no level's call, no
# log-sum-exp merge (with its backward, about a dozen operators per level and layer, each a launch a small micro-batch's
# GPU waits for). It copies each node's ancestors' keys and values (and sums their gradients back), so only where those
# copies, in tokens, are at most this many times the flat sequence. An estimate of where the bytes break even: the
# copies move about 24 bytes per copied token, key/value head and dimension (half precision; forward, checkpointing's
# recompute, backward); a level's merge about 150 per query token, query head and dimension (float32, several operators
# each way); with 4 query heads per key/value head and half the flat tokens reading a level, about 12 copies per flat
# token
FOLD_COPIES = 4


class _Sent:
    """The host arrays a layout sends to its device in one copy, appended by each section's plan in order, and read
    back in the same order once there (`take`)."""

    def __init__(self, tree: Tree):
        self.tree = tree
        self.arrays: list[np.ndarray] = []
        self._taken = None

    def blocks_of(self, nodes, starts=None, lengths=None) -> tuple:
        """Plans [`tree.parts.Blocks`] of `nodes` (or of the runs `[starts, starts + lengths)`): `(shape, run)`."""
        starts = self.tree.start[nodes] if starts is None else starts
        lengths = self.tree.length[nodes] if lengths is None else lengths
        gather, scatter = padded_blocks(starts, lengths, self.tree.num_tokens)
        self.arrays.extend([gather, scatter])
        return gather.shape, one_run(starts, lengths)

    def packed_of(self, query_starts, query_lengths, key_starts, key_lengths) -> tuple:
        """Plans a [`tree.parts.Packed`] call: `(query run, key run, max_q, max_k)` (a run's indices are not sent)."""
        planned = []
        for starts, lengths in ((query_starts, query_lengths), (key_starts, key_lengths)):
            run = contiguous(starts, lengths)
            if run is None:  # the tokens' indices, sent; a run needs none
                self.arrays.append(concatenated(starts, lengths))
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
        """The [`tree.parts.Blocks`] `blocks_of` planned; padding where the scatter is the `dump` row (default: N)."""
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
        for nodes in length_buckets(level, queries[level], ratio) if len(level) else []:
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
    for (slot, _), reads in grouped(reads_by, lambda read: read[:2]):
        slot_tokens = reads[0][2]
        read = np.array([r[3:] for r in reads], dtype=np.int64).reshape(-1, 5)
        for run in length_buckets(np.arange(len(read)), read[:, 1], ratio):
            q_first, q_count, k_first, k_count, key_end = read[run].T
            query_plan = sent.blocks_of(None, q_first, q_count)
            gather, scatter = padded_blocks(k_first, k_count, slot_tokens)
            sent.arrays.extend([gather, scatter, k_count, key_end])
            planned.append((slot, slot_tokens, query_plan, (gather.shape, one_run(k_first, k_count)),
                            bool((k_count < k_count.max()).any())))  # fmt: skip
    return planned


def _plan_fold(sent: _Sent, held_reads: list[tuple]) -> tuple | None:
    """[`tree.parts.TreeLayout.held_nodes`]: each node's keys, its held ancestors', its ancestors' in the tree, then its
    own, where the copies stay within [`FOLD_COPIES`]: `(max_q, max_k, runs joined or None)`, or None."""
    tree = sent.tree
    n = tree.num_tokens
    if not (held_reads or (tree.depth > 0).any()):
        return None
    order = np.argsort(tree.start, kind="stable")
    ancestor_runs, copies = [], 0  # each node's ancestors' keys, held then in the tree; what a fold would copy
    paths = ancestor_paths(tree)  # each node's ancestors in the tree, root first
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
    """The recurrent layers' levels ([`tree.parts.Level`]), and each token's slot in their blocks (`assemble`, sent
    after them): `(plans per depth, state order)`."""
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
    """The [`tree.parts.Level`]s `_plan_levels` planned, and per root bucket its held parents' rows."""
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
    The [`tree.parts.TreeLayout`] of `tree` on `device`, with the integer arrays `parts` sent in the same copy (returned
    there). `image_nodes`: the nodes holding an image's tokens (their own self-attention calls). `recurrent`: whether
    the recurrent layers' levels are needed (a model with recurrent layers). `held_reads`: the held nodes this forward
    reads, `(slot, slot tokens, depth, first query, query count, first key, key count, key end position)` each (the
    queries a run of the flat sequence, the keys a run of the slot's); `held_roots`: per node, its held parent's row in
    the `held_states` rows of the slots' concatenated recurrent states (-1: none).
    """
    all_nodes = np.arange(len(tree.start))
    with_images = np.zeros(len(all_nodes), dtype=bool)
    if image_nodes is not None:
        with_images[image_nodes] = True
    sent = _Sent(tree)
    # Planned on the host, each section appending what it sends: then sent at once, and read back in the same order
    bucket_plans = [[sent.blocks_of(run) for run in length_buckets(all_nodes[mask], tree.length[mask], ratio)]
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
