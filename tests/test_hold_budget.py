"""What holding prompts costs and when it fits ([`core.tree.hold_budget`]): a held token's bytes, the most a plan holds
at once, and the sources moved or nodes dropped until it fits the budget (through [`core.tree.holds.plan_holds`]
too)."""

import numpy as np
import pytest

from rloo_efficient.core.tree.hold_budget import (
    held_image_bytes,
    held_node_bytes,
    held_peak,
    held_token_bytes,
    hoisted_sources,
    within_budget,
)
from rloo_efficient.core.tree.holds import plan_holds


# Qwen3-0.6B's 28 layers of 8 key/value heads of 128 dims and hidden size 1024, in bf16: a token's keys and values
KV_BYTES, HIDDEN, LAYERS = 28 * 2 * 8 * 128 * 2, 1024, 28


@pytest.mark.parametrize("training, checkpointing, expected", [
    (False, True, KV_BYTES),  # a no-grad pass holds the keys and values alone
    (True, True, KV_BYTES + KV_BYTES * 2 + HIDDEN * LAYERS * 2),  # their float32 bank, one checkpoint input a layer
    (True, False, KV_BYTES + KV_BYTES * 2 + 17 * HIDDEN * LAYERS * 2),  # the layers' saved activations
])  # fmt: skip
def test_a_held_tokens_bytes_are_its_keys_and_values_their_float32_bank_and_its_saved_state(training, checkpointing,
                                                                                            expected):  # fmt: skip
    """Fails with the bank counted in the model's dtype, or the checkpoint inputs left out. In float32 the bank is the
    keys' and values' own size (a bank counted as twice them, whatever the dtype, fails there)."""
    assert held_token_bytes(KV_BYTES, KV_BYTES // 2, HIDDEN, LAYERS, 2, training, checkpointing) == expected
    assert held_token_bytes(2 * KV_BYTES, KV_BYTES // 2, HIDDEN, LAYERS, 4, True, True) == (2 * KV_BYTES * 2 +
                                                                                            HIDDEN * LAYERS * 4)


def test_a_held_image_token_costs_its_patches_saved_activations_in_every_tower_layer():
    """A placeholder token of a Qwen-like tower (2x2 patches merged into a token) keeps its 4 patches' activations in
    each of the tower's layers: one hidden state a layer under checkpointing, 17 without; nothing without a tower."""
    import types

    tower = types.SimpleNamespace(hidden_size=32, depth=3, spatial_merge_size=2)
    assert held_image_bytes(tower, 2, checkpointing=True) == 32 * 3 * 4 * 2
    assert held_image_bytes(tower, 2, checkpointing=False) == 17 * 32 * 3 * 4 * 2
    # (a tower naming its sizes as CLIP's and SigLIP's configs do, one patch a token)
    clip = types.SimpleNamespace(hidden_size=None, embed_dim=16, depth=None, num_hidden_layers=2)
    assert held_image_bytes(clip, 4, checkpointing=True) == 16 * 2 * 4
    assert held_image_bytes(None, 2, checkpointing=True) == 0


def test_a_held_node_of_a_hybrid_costs_its_recurrent_states_beside_its_tokens():
    """A node's final scan states (float32) and convolution tails (the compute dtype), and in training their float32
    gradients: what [`plan_holds`] adds to each node's tokens. With the states left out, a budget that holds one
    prompt's tokens and states would hold all three prompts."""
    assert held_node_bytes(100, 10, 2, training=False) == 100 * 4 + 10 * 2
    assert held_node_bytes(100, 10, 2, training=True) == 100 * 4 + 10 * 2 + 110 * 4
    assert held_node_bytes(0, 0, 2, training=True) == 0  # no recurrent layer
    prompts = {g: list(range(10 + 30 * g, 30 + 30 * g)) for g in range(3)}  # 20 tokens each, 19 held
    chunks = [(np.array([g]), np.array([20]), np.array([2]), [np.array(prompts[g] + [1, 2])])
              for g in (0, 1, 2, 0, 1, 2)]  # fmt: skip
    held = plan_holds(chunks, full=False, min_saved=0, token_bytes=1, budget=19 * 3)
    assert len(held.nodes.source) == 3  # the three prompts' tokens fit
    held = plan_holds(chunks, full=False, min_saved=0, token_bytes=1, node_bytes=19, budget=19 * 3)
    assert len(held.nodes.source) == 1  # with their states, one


def test_a_source_forwards_later_chunks_nodes_within_stocks_forward_and_the_budget():
    """Two nodes, first read in chunks 0 and 2 (read to chunks 1 and 3): one source in chunk 0 where both fit one of
    stock's forwards (`cap` tokens) and the held bytes while both are alive; else each in its own first chunk. A node
    first read in a source's own chunk joins it whatever its size."""
    first, last, length, cost = np.array([0, 2]), np.array([1, 3]), np.array([10, 10]), np.array([5, 5])
    assert hoisted_sources(first, last, length, cost, budget=10, cap=20, chunks=4).tolist() == [0, 0]
    assert hoisted_sources(first, last, length, cost, budget=None, cap=20, chunks=4).tolist() == [0, 0]
    assert hoisted_sources(first, last, length, cost, budget=9, cap=20, chunks=4).tolist() == [0, 2]  # alive at once
    assert hoisted_sources(first, last, length, cost, budget=10, cap=19, chunks=4).tolist() == [0, 2]  # one forward
    assert hoisted_sources(np.array([0, 0]), last, length, cost, budget=10, cap=1, chunks=4).tolist() == [0, 0]
    three = hoisted_sources(np.array([0, 1, 2]), np.array([0, 1, 2]), np.array([10, 10, 10]), np.array([1, 1, 1]),
                            budget=None, cap=20, chunks=3)  # fmt: skip
    assert three.tolist() == [0, 0, 2]  # the third over the cap: a source of its own
    # A node's held time extended by joining counts for the nodes after it
    assert hoisted_sources(np.array([0, 1, 2]), np.array([0, 1, 2]), np.ones(3, dtype=np.int64), np.full(3, 5),
                           budget=10, cap=100, chunks=3).tolist() == [0, 0, 2]  # fmt: skip
    # A node first read in the source's own chunk adds its tokens too
    assert hoisted_sources(np.array([0, 0, 1]), np.array([0, 0, 1]), np.array([10, 10, 5]), np.ones(3, dtype=np.int64),
                           budget=None, cap=15, chunks=2).tolist() == [0, 0, 1]  # fmt: skip


def test_a_source_is_held_whole_until_its_last_reader_within_the_budget():
    """A source is released whole (in training after its backward): where a prompt joining an earlier source keeps it
    alive past the budget beside a later source, each prompt is forwarded by its own first chunk. Group A's rows in
    chunks 0 and 1, B's and C's in 2 and 3; a source of two prompts at most."""
    prompts = {g: list(range(10 + 30 * g, 30 + 30 * g)) for g in range(3)}  # 20 tokens each, 19 held
    chunk_groups = [[0], [0], [1, 2], [1, 2]]
    chunks = [(np.array(groups), np.full(len(groups), 20), np.full(len(groups), 2),
               [np.array(prompts[g] + [1, 2]) for g in groups]) for groups in chunk_groups]  # fmt: skip
    plan = plan_holds(chunks, full=False, min_saved=0, token_bytes=1, source_cap=38)
    assert plan.source_chunk.tolist() == [0, 2] and plan.nodes.source.tolist() == [0, 0, 1]  # B joins A's source
    plan = plan_holds(chunks, full=False, min_saved=0, token_bytes=1, budget=38, source_cap=38)
    assert plan.nodes.source.tolist() == [0, 1, 1]  # A's source would hold A and B to chunk 3, beside C
    assert held_peak(np.array([0, 0, 2]), np.array([1, 3, 3]), np.full(3, -1), np.full(3, 19), 4) == 57
    assert held_peak(np.array([0, 2, 2]), np.array([1, 3, 3]), np.full(3, -1), np.full(3, 19), 4) == 38
    assert held_peak(np.array([0, 1]), np.array([1, 1]), np.full(2, -1), np.array([5, 7]), 2) == 12  # both at chunk 1


def test_a_source_read_through_a_later_longer_lived_one_is_charged_until_its_backward():
    """In training a source's backward waits for a later source reading its descendant, which a longer-lived prompt
    beside that descendant keeps to its end: P (read in chunks 0-3) and its child C (2-3), Q (2-5, in C's source),
    R (4-5). P is held to chunk 5, beside Q and R: over a budget of 13, the prompt first read latest (R) is not held."""
    first, last, parent = np.array([0, 2, 2, 4]), np.array([3, 3, 5, 5]), np.array([-1, 0, -1, -1])
    cost = np.array([10, 2, 1, 10])
    assert held_peak(first, last, parent, cost, 6) == 23
    held = within_budget(np.ones(4, dtype=bool), first, last, parent, cost, budget=13, chunks=6)
    assert held.tolist() == [True, True, True, False]
    assert within_budget(np.ones(4, dtype=bool), first, last, parent, cost, budget=23, chunks=6).all()
    assert within_budget(np.ones(4, dtype=bool), first, last, parent, cost, budget=9, chunks=6).tolist() == [False] * 4
    # A no-grad pass releases P after chunk 3 (no backward to wait for): 13 bytes at most, all four held
    assert held_peak(first, last, parent, cost, 6, training=False) == 13
    assert within_budget(np.ones(4, dtype=bool), first, last, parent, cost, budget=13, chunks=6, training=False).all()
    # Through plan_holds: rows reading P (chunks 0-1), P then C (2-3), Q (2-5), R (4-5), each prompt ending in a token
    # of its own (held: 10, 2, 1 and 10 tokens)
    p, c, q, r = (list(range(10 + 20 * i, 10 + 20 * i + size)) for i, size in enumerate((11, 2, 2, 11)))
    chunks = [(np.arange(len(chunk)), np.array([len(x) + 1 for x in chunk]), np.full(len(chunk), 2),
               [np.array([*x, 500 + 10 * index + row, 1, 2]) for row, x in enumerate(chunk)])
              for index, chunk in enumerate([[p], [p], [p + c, q], [p + c, q], [q, r], [q, r]])]  # fmt: skip
    for training, held in ((True, [10, 2, 1]), (False, [10, 2, 1, 10])):  # C and Q: one source, in chunk 2
        plan = plan_holds(chunks, full=False, min_saved=0, token_bytes=1, budget=13, training=training)
        assert plan.nodes.length.tolist() == held and plan.nodes.parent.tolist()[:2] == [-1, 0]
