"""
The prefix tree ([`core.tree.radix`]) and attention over it ([`core.attention.tree`]): each row reads its own tokens at its
own positions; each token attends to exactly its ancestors and causally within its node (against a dense (N, N) mask
over the same flat sequence, forward and gradients, windows and sinks included); and the mistakes these guard against
(a node attending to a sibling, a padding slot written to a real token) fail the comparison.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rloo_efficient.core.attention.backend import prefix_attention
from rloo_efficient.core.tree import layout as layouts
from rloo_efficient.core.tree import runs
from rloo_efficient.core.tree.layout import tree_layout
from rloo_efficient.core.tree.radix import END, build_tree

from .conftest import emulate_varlen
from .helpers import DIM, HEADS, KV_HEADS, check_against_dense
from .trees import random_rows


THRESHOLDS = (0, 6, 10**9)  # every shared run its node; some copied into their branches; nothing shared


def flat_tokens(tree, rows, shift=True):
    """The token values of the flat sequence, read from each node's own row (the test's reading, not the code's)."""
    tokens = np.empty(tree.num_tokens, dtype=np.int64)
    for start, length, position, row in zip(tree.start, tree.length, tree.position, tree.row, strict=True):
        padded = list(rows[row]) + [END]
        tokens[start : start + length] = padded[position : position + length]
    return tokens


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), min_saved=st.sampled_from(THRESHOLDS), shift=st.booleans(), ends=st.booleans())
def test_each_row_reads_its_own_tokens_at_their_positions(seed, min_saved, shift, ends):
    rows = random_rows(seed)
    ends = ends and shift
    tree = build_tree(rows, shift=shift, ends=ends, min_saved=min_saved)
    tokens, positions = flat_tokens(tree, rows), tree.token_position
    held = np.zeros(tree.num_tokens, dtype=np.int64)
    for row, inputs in zip(rows, tree.row_inputs, strict=True):
        count = len(row) - (1 if shift and not ends else 0)  # a predicting row's last token predicts nothing
        assert len(inputs) == count
        assert tokens[inputs].tolist() == row[:count] and positions[inputs].tolist() == list(range(count))
        held[inputs] += 1
        # Each input's node lies on the row's path: the nodes' starts rise along it, each inside the one before
        nodes = np.searchsorted(tree.start, inputs, side="right") - 1
        path = list(dict.fromkeys(nodes.tolist()))
        assert all(tree.parent[b] == a for a, b in zip(path[:-1], path[1:]))
    assert held.tolist() == tree.token_weight.tolist()  # a node's weight: the rows through it
    # The radix tree's tokens: what a trie of the rows holds (each shared run once)
    trie: set[tuple] = set()
    for row in rows:
        trie.update(tuple(row[:i]) for i in range(1, len(row) + 1))
    assert tree.real_tokens == len(trie)
    if min_saved == 0 and shift:  # every shared run once: the flat sequence is the trie's inputs
        assert tree.num_tokens <= len(trie) + (len(rows) if ends else 0)


def test_a_node_is_kept_only_where_it_saves_enough():
    """A run shared by `b` branches saves `(b - 1) * length` tokens: kept at the threshold, copied below it."""
    system = list(range(3, 13))  # 10 tokens, shared by 3 rows: saves 20
    rows = [system + [20 + i, 30 + i] for i in range(3)]
    kept = build_tree(rows, min_saved=20)
    copied = build_tree(rows, min_saved=21)
    # The run less its last token once, then each row: a copy of that token and its own first (its last predicts none)
    assert kept.depth.max() == 1 and kept.num_tokens == 9 + 3 * 2
    assert copied.depth.max() == 0 and copied.num_tokens == 3 * 11


def test_a_node_with_a_row_ending_in_it_counts_that_row_as_a_branch():
    """A run one row ends with and another continues: two branches, saving its length once (10 tokens)."""
    system = list(range(3, 13))
    rows = [system, system + [20, 21]]
    kept = build_tree(rows, min_saved=10)
    # The run less its last token once, then the continuing row's copy of it and its own first; the ended row's last
    # token predicts nothing
    assert kept.depth.max() == 1 and kept.num_tokens == 9 + 2


def test_a_keys_first_node_is_kept_whatever_it_saves_with_keep_roots():
    """With `keep_roots` (an image's tokens, encoded once), a root below the threshold is kept, not copied."""
    rows = [[5, 6, 7, 8, 20 + i, 30 + i] for i in range(3)]  # 4 shared tokens: saves 6, below 64
    assert build_tree(rows).depth.max() == 0
    kept = build_tree(rows, keep_roots=True)
    assert kept.depth.max() == 1 and (kept.parent == -1).sum() == 1 and kept.num_tokens == 3 + 3 * 2


# (interleaved: rows of one key share even where a row of another key sorts between them)
@pytest.mark.parametrize("keys", [[0, 0, 1, 1], [0, 1, 0, 1]])
def test_rows_with_other_keys_share_nothing(keys):
    rows = [[5, 6, 7, 8]] * 4
    tree = build_tree(rows, keys=keys, min_saved=0)
    assert (tree.parent == -1).sum() == 2 and tree.num_tokens == 2 * 3


# -- attention over the tree against a dense mask -----------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), min_saved=st.sampled_from(THRESHOLDS), ratio=st.sampled_from([1.5, 2.0, 1e9]))
def test_tree_attention_equals_dense_mask_attention(seed, min_saved, ratio):
    """Random trees of depth 1 to 4, one-token nodes, rows ending inside a node, completions of very different
    lengths; nodes bucketed by length (one bucket, or several)."""
    tree = build_tree(random_rows(seed), min_saved=min_saved)
    check_against_dense(tree, seed, layout=tree_layout(tree, torch.device("cpu"), ratio=ratio)[0])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), window=st.integers(1, 20), sinks=st.booleans())
def test_tree_attention_with_a_sliding_window_and_sinks_equals_dense_attention(seed, window, sinks):
    """Windows from 1 token to longer than any row (runs of up to 9 tokens, 4 deep): nodes longer than the window (the
    banded path), windows that reach across several ancestors, ancestors wholly out of a token's window; with or
    without a sink logit per head (its gradient too)."""
    check_against_dense(build_tree(random_rows(seed), min_saved=0), seed, window=window, sinks=sinks)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), min_saved=st.sampled_from(THRESHOLDS),
       window=st.one_of(st.none(), st.integers(1, 20)), sinks=st.booleans(), fold=st.booleans())  # fmt: skip
def test_tree_attention_in_variable_length_calls_equals_dense_attention(seed, min_saved, window, sinks, fold):
    """The layout's variable-length calls (flash's on CUDA; the math reference here): every node in one causal call
    (under a window too), each level's part in one call without key padding; or (`fold`) the whole attention in one
    call, each node reading its ancestors' keys joined before its own; the same trees as above."""
    tree = build_tree(random_rows(seed), min_saved=min_saved)
    with pytest.MonkeyPatch.context() as patch:
        calls = emulate_varlen(patch)
        patch.setattr(layouts, "FOLD_COPIES", layouts.FOLD_COPIES if fold else 0)
        layout = tree_layout(tree, torch.device("cpu"))[0]
        check_against_dense(tree, seed, window=window, sinks=sinks, layout=layout)
    # The nodes' call, and one per level with descendants (without a window: a window's levels pad their buckets; a
    # window as long as the rows masks nothing and is dropped); folded, the one call; one row's path (no sinks): one
    # dense call, none of variable length
    levels = len(set(tree.depth[tree.subtree_end > tree.start + tree.length].tolist()))
    windowed = window is not None and tree.num_tokens and window < (tree.position + tree.length).max()
    folded = layout.held_nodes is not None
    copies = sum(tree.length[a].sum() for a in runs.ancestor_paths(tree))  # what folding copies, in tokens
    assert folded == (fold and levels > 0 and tree.num_tokens > 0 and copies <= layouts.FOLD_COPIES * tree.num_tokens)
    if layout.chain is not None and not sinks:
        assert calls == []
        return
    assert len(calls) == (1 + (0 if windowed or folded else levels) if tree.num_tokens else 0)


@pytest.mark.parametrize("window", [None, 3])
def test_nodes_that_read_no_other_are_the_variable_length_call_alone(monkeypatch, window):
    """Rows that share nothing (one row per micro-batch, a source's prompts): each layer is the nodes' one call, its
    output and gradients handed back as the kernel made them: no buffer filled, copied or summed into around it (on
    a GPU each is a launch, and at one row per micro-batch the host is the limit)."""
    from rloo_efficient.core.attention import checks as kernel_checks
    from rloo_efficient.profiling.op_count import OpCounter

    class Around(OpCounter):  # the operators dispatched outside the kernel's calls
        inside = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.inside:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    counter = Around()

    def kernel(function):
        def call(*args):
            counter.inside += 1
            try:
                return function(*args)
            finally:
                counter.inside -= 1

        return call

    calls = emulate_varlen(monkeypatch)
    monkeypatch.setattr(kernel_checks, "varlen_forward", kernel(kernel_checks.varlen_forward))
    monkeypatch.setattr(kernel_checks, "varlen_backward", kernel(kernel_checks.varlen_backward))
    tree = build_tree([[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16]], min_saved=0)
    layout = tree_layout(tree, torch.device("cpu"))[0]
    check_against_dense(tree, 0, window=window, layout=layout)
    assert len(calls) == 1 and not layout.parts
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, tree.num_tokens, DIM, generator=g, dtype=torch.float64).requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    with counter:
        out, _ = prefix_attention(None, q, k, v, None, scaling=0.3, rloo_prefix_layout=layout, sliding_window=window)
        out.sum().backward()
    launched = {name for name in counter.counts if counter.counts[name] > counter.metadata[name]}
    assert launched <= {"aten::sum", "aten::ones_like", "aten::expand"}, launched  # the test's loss alone


def test_padding_slots_stay_finite_with_large_scores():
    """Nodes of different lengths leave padding slots in every part; with scores beyond exp's range their
    probabilities must still be computed against a finite log-sum-exp (no inf * 0 = NaN in the gradients)."""
    rows = [[5] * 9 + [6, 7], [5] * 9 + [8], [5] * 9 + [9, 10, 11, 12, 13], [3, 4]]
    check_against_dense(build_tree(rows, min_saved=0), 5, magnitude=30.0)


# -- mistakes the comparison catches ----------------------------------------------------------------------------------
@pytest.mark.parametrize("varlen", [False, True])
def test_a_node_attending_to_a_sibling_fails(monkeypatch, varlen):
    calls = emulate_varlen(monkeypatch) if varlen else []
    monkeypatch.setattr(layouts, "FOLD_COPIES", 0)  # the levels' calls (the folded call: the test below)
    rows = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11, 12], [5, 6, 7, 13]]
    tree = build_tree(rows, min_saved=0)
    check_against_dense(tree, 0)
    first_leaf = int(np.flatnonzero(tree.depth == 1)[0])
    subtree_end = tree.subtree_end.copy()
    subtree_end[first_leaf] = tree.num_tokens  # its "subtree" now runs over its siblings
    wrong = tree_layout(type(tree)(**{**vars(tree), "subtree_end": subtree_end}), torch.device("cpu"))[0]
    assert (wrong.packed_nodes is not None) == varlen
    with pytest.raises(AssertionError):
        check_against_dense(tree, 0, layout=wrong)
    # The variable-length calls ran: the nodes' and the level's; then the wrong layout's, with the leaf's fake level
    assert len(calls) == (2 + 3 if varlen else 0)


def test_a_variable_length_call_reading_the_next_sequences_keys_fails(monkeypatch):
    """A level's sequences reading their keys one token late (the next node's first token instead of their own
    first), or the nodes' causal call with its boundaries one token late: the comparison catches each."""
    import dataclasses

    emulate_varlen(monkeypatch)
    monkeypatch.setattr(layouts, "FOLD_COPIES", 0)
    rows = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11, 12], [3, 4, 13], [3, 4, 14, 15]]
    tree = build_tree(rows, min_saved=0)
    layout = tree_layout(tree, torch.device("cpu"))[0]
    check_against_dense(tree, 0, layout=layout)
    assert len(layout.packed_parts) == 1 and layout.packed_parts[0].cu_k.tolist() == [0, 1, 3]  # two prompts

    def late(offsets):
        moved = offsets.clone()
        moved[1:-1] += 1
        return moved

    call = layout.packed_parts[0]
    wrong_keys = dataclasses.replace(layout, packed_parts=(dataclasses.replace(call, cu_k=late(call.cu_k)),))
    nodes = layout.packed_nodes
    wrong_nodes = dataclasses.replace(layout, packed_nodes=dataclasses.replace(nodes, cu_q=late(nodes.cu_q),
                                                                                cu_k=late(nodes.cu_k)))  # fmt: skip
    for wrong in (wrong_keys, wrong_nodes):
        with pytest.raises(AssertionError):
            check_against_dense(tree, 0, layout=wrong)


@pytest.mark.parametrize("mistake", ["root_dropped", "sibling_added", "ancestors_reversed"])
def test_a_folded_call_reading_other_keys_than_its_ancestors_fails(monkeypatch, mistake):
    """The whole attention in one call (each node's ancestors' keys joined before its own): right on a tree two levels
    deep (a shared prompt, two tasks, their completions), wrong where a node's path leaves out its root, adds the
    sibling before it, or (under a window, where the keys' order is their distance) joins its ancestors leaf first."""
    calls = emulate_varlen(monkeypatch)
    rows = [[5, 6, 7, 8, 9, 20], [5, 6, 7, 8, 9, 21, 22], [5, 6, 7, 10, 11, 23], [5, 6, 7, 10, 11, 24, 25, 26]]
    tree = build_tree(rows, min_saved=0)
    layout = tree_layout(tree, torch.device("cpu"))[0]
    assert layout.held_nodes is not None and int(tree.depth.max()) == 2
    check_against_dense(tree, 0, layout=layout)
    assert len(calls) == 1  # the folded call alone
    paths = runs.ancestor_paths

    def wrong(tree):
        right = paths(tree)
        if mistake == "root_dropped":
            return [path[1:] for path in right]
        if mistake == "ancestors_reversed":
            return [path[::-1] for path in right]
        return [np.append(path, node - 1) if len(path) and tree.parent[node - 1] == tree.parent[node] else path
                for node, path in enumerate(right)]  # fmt: skip

    window = 3 if mistake == "ancestors_reversed" else None
    check_against_dense(tree, 0, window=window, layout=layout)
    monkeypatch.setattr(layouts, "ancestor_paths", wrong)  # (as the layout calls it)
    with pytest.raises(AssertionError):
        check_against_dense(tree, 0, window=window, layout=tree_layout(tree, torch.device("cpu"))[0])
