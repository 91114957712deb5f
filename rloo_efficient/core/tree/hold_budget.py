"""
What holding prompts costs and when it fits ([`tree.holds.plan_holds`]' budget): a held token's bytes
([`held_token_bytes`], and an image placeholder's in the vision tower, [`held_image_bytes`]), the most bytes a plan
holds at once ([`held_peak`]: a source is released whole, in training after its backward), and the nodes dropped or
their sources moved until a plan fits ([`budgeted`], [`within_budget`], [`hoisted_sources`]).
"""

import numpy as np


# A transformer layer's activations saved for backward, per token, in hidden sizes (Korthikanti et al. 2022: about
# 34 h bytes per token and layer in half precision, 17 h values): what a held prompt's graph keeps without
# checkpointing; with it, the checkpoint's input (one hidden state per layer)
SAVED_PER_LAYER = 17


def held_token_bytes(kv_bytes: int, kv_values: int, hidden_size: int, layers: int, element_size: int, training: bool,
                     checkpointing: bool) -> int:  # fmt: skip
    """What holding one prompt token costs ([`tree.holds.plan_holds`]' `token_bytes`): its keys and values (or latents)
    in every layer, `kv_values` values in `kv_bytes`; in training also a float32 bank of their gradient, and what its
    graph keeps ([`SAVED_PER_LAYER`] hidden sizes per layer, one under gradient `checkpointing`), in `element_size`-byte
    values."""
    if not training:
        return kv_bytes
    saved = hidden_size * (1 if checkpointing else SAVED_PER_LAYER) * layers
    return kv_bytes + kv_values * 4 + saved * element_size


def held_node_bytes(wide_values: int, narrow_values: int, element_size: int, training: bool) -> int:
    """What holding one node costs beside its tokens ([`tree.holds.plan_holds`]' `node_bytes`): a hybrid's recurrent
    layers' final states and convolution tails per node ([`layers.recurrent.held_state_values`]: `wide_values` float32,
    `narrow_values` of `element_size` bytes); in training also a float32 bank of their gradients."""
    held = wide_values * 4 + narrow_values * element_size
    return held + (wide_values + narrow_values) * 4 if training else held


def held_image_bytes(vision_config, element_size: int, checkpointing: bool) -> int:
    """What a held image placeholder token's graph keeps in the vision tower in training ([`tree.holds.plan_holds`]'
    `image_cost`), estimated from the `vision_config`: its patches' activations (Qwen merges `spatial_merge_size`^2
    patches into a token) in every tower layer, [`SAVED_PER_LAYER`] hidden sizes each (one under gradient
    `checkpointing`). 0 without a vision config."""
    if vision_config is None:
        return 0
    hidden = getattr(vision_config, "hidden_size", None) or getattr(vision_config, "embed_dim", None) or 0
    layers = getattr(vision_config, "depth", None) or getattr(vision_config, "num_hidden_layers", None) or 0
    patches = (getattr(vision_config, "spatial_merge_size", None) or 1) ** 2
    per_layer = 1 if checkpointing else SAVED_PER_LAYER
    return hidden * layers * per_layer * patches * element_size


def last_readers(source: np.ndarray, last: np.ndarray, count: int) -> np.ndarray:
    """Each of `count` sources' last reading chunk: the latest `last` of its nodes (`source`: each node's)."""
    out = np.full(count, -1, dtype=np.int64)
    np.maximum.at(out, source, last)
    return out


def sources_of(source_first: np.ndarray, last: np.ndarray, parent: np.ndarray):
    """The sources of held nodes (depth-first) forwarded in chunks `source_first` and read until `last`:
    `(source_chunk (S,), each node's source (H,), each source's backprop chunk (S,))`. A source's backward runs in the
    last chunk reading it, directly or through a later source reading it."""
    source_chunk = np.unique(source_first)
    source = np.searchsorted(source_chunk, source_first)
    backprop = last_readers(source, last, len(source_chunk))
    for s in range(len(source_chunk) - 1, -1, -1):
        for x in np.flatnonzero((source == s) & (parent >= 0)):
            a = parent[x]
            while a >= 0:
                backprop[source[a]] = max(backprop[source[a]], backprop[s])
                a = parent[a]
    return source_chunk, source, backprop


def held_peak(source_first: np.ndarray, last: np.ndarray, parent: np.ndarray, cost: np.ndarray, chunks: int,
              training: bool = True) -> int:  # fmt: skip
    """The most bytes held at once by nodes of `cost` forwarded in chunks `source_first`: each source's nodes from its
    chunk to its backprop chunk ([`sources_of`]), or (not `training`) to its own nodes' last reader, as
    [`tree.holds.HoldPlan.released_after`] releases them."""
    source_chunk, source, backprop = sources_of(source_first, last, parent)
    if not training:  # (no backward to wait for; a descendant's readers read its ancestors, whose `last` is later)
        backprop = last_readers(source, last, len(source_chunk))
    alive = np.zeros(chunks + 1, dtype=np.int64)
    np.add.at(alive, source_chunk, np.bincount(source, weights=cost, minlength=len(source_chunk)).astype(np.int64))
    np.add.at(alive, backprop + 1, -np.bincount(source, weights=cost, minlength=len(source_chunk)).astype(np.int64))
    return int(np.cumsum(alive).max())


def within_budget(held: np.ndarray, first: np.ndarray, last: np.ndarray, parent: np.ndarray, cost: np.ndarray,
                  budget: int, chunks: int, training: bool = True) -> np.ndarray:  # fmt: skip
    """`held` (nodes in depth-first order, `parent` -1 at a top node) less the nodes first read latest, until what
    their sources hold at once is within `budget` ([`held_peak`]: a source is released whole, in training after its
    backward, which a later source reading a descendant delays)."""
    held = held.copy()
    while held.any():
        index = np.flatnonzero(held)
        rank = np.full(len(held), -1)
        rank[index] = np.arange(len(index))
        ranked_parent = np.where(parent[index] >= 0, rank[np.maximum(parent[index], 0)], -1)
        if held_peak(first[index], last[index], ranked_parent, cost[index], chunks, training) <= budget:
            break
        held[index[np.lexsort((index, first[index]))[-1]]] = False  # (the deepest of the latest: no held child)
    return held


def hoisted_sources(first: np.ndarray, last: np.ndarray, length: np.ndarray, cost: np.ndarray, budget: int | None,
                    cap: int, chunks: int) -> np.ndarray:  # fmt: skip
    """
    The chunk forwarding each held node (depth-first, read from chunk `first` to `last`, `length` tokens, `cost` bytes):
    a node joins the latest source before its first chunk where that forward stays within `cap` tokens and the held
    state, alive from its forward to its last reader, within `budget` bytes at every chunk; else it opens a source in
    its first chunk. Each source is one more forward (and in training one more backward): at two rows per micro-batch,
    a step's groups' prompts in one forward instead of one per group. A parent's source is never after its child's
    (nodes are taken by first chunk, parents first).
    """
    at = first.copy()
    alive = np.zeros(chunks, dtype=np.int64)
    current, tokens = -1, 0
    for x in np.lexsort((np.arange(len(first)), first)):
        joins = current >= 0 and (current == first[x] or tokens + length[x] <= cap)
        if joins and budget is not None and current < first[x]:  # alive from `current` on instead of `first[x]`
            joins = int(alive[current : first[x]].max()) + int(cost[x]) <= budget
        if not joins:
            current, tokens = int(first[x]), 0
        at[x] = current
        tokens += int(length[x])
        alive[current : last[x] + 1] += int(cost[x])
    return at


def budgeted(parents: np.ndarray, first: np.ndarray, last: np.ndarray, cost: np.ndarray, budget: int | None,
             chunks: int, training: bool) -> np.ndarray:  # fmt: skip
    """Which of the searched nodes are held (bool): chronologically, a node from its first chunk to its last, if its
    parent is held and it fits the `budget`; then as sources release them ([`within_budget`])."""
    held = np.zeros(len(parents), dtype=bool)
    for chunk in range(chunks):
        alive = int((cost * held)[(first < chunk) & (last >= chunk)].sum())
        for x in np.flatnonzero(first == chunk):
            if (parents[x] < 0 or held[parents[x]]) and (budget is None or alive + cost[x] <= budget):
                held[x] = True
                alive += cost[x]
    if budget is not None:  # as sources release them: a chunk's held nodes together, after their backward
        held = within_budget(held, first, last, parents, cost, budget, chunks, training)
    return held
