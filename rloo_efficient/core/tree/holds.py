"""
Which runs of prompt tokens are forwarded once for a run of micro-batches, and which micro-batch reads them.

TRL scores a generation batch, and trains on it, in micro-batches of `per_device_train_batch_size` rows: at one or two
rows per micro-batch a group's `k` rows fall in `k` or `k / 2` micro-batches, and each would forward the group's
prompt again. Here the micro-batches of a scope (the chunks of a no-grad log-prob pass; a generation's micro-batches
inside one optimizer step) are planned together, on the host, from their rows' token lists:

- the *held nodes*: the radix tree of the rows' prompts (a system prompt shared across groups, each group's prompt),
  keeping a node where rows of at least two chunks pass through it and it saves at least `min_saved` tokens (a node
  not kept is copied into its branches, as [`tree.radix.build_tree`] copies one). A held node never holds a completion
  token: the position that predicts a completion's first token is its prompt's last token, the first input of the
  row's own tokens;
- the *sources*: the chunk where a held node's rows first appear forwards it (with the other nodes first needed there,
  in one packed forward whose keys and values, recurrent states and router logits are held: [`attention.held`]), or an
  earlier chunk's source where that forward stays within one of stock's ([`tree.hold_budget.hoisted_sources`]);
  every later chunk holding one of its rows reads them;
- each chunk's own part: each row's inputs after its deepest held node, packed as their prefix tree ([`forward.packing`]).

In training a node's gradient reaches it from every chunk that reads it, and its source's one backward must come last:
the *backprop chunk* of a source is the last chunk that reads it, directly or through a later source that reads it.
A reader whose own backward runs in that chunk reads the source's attached tensors; every earlier one reads detached
copies whose gradient is banked and added in that backward ([`attention.held.HeldSource`]).

Over the held-state budget, nodes first needed later are not held (their rows' chunks forward them, as without this
module); a node whose parent is not held is not held either.
"""

from dataclasses import dataclass

import numpy as np

from .hold_budget import budgeted, held_peak, hoisted_sources, last_readers, sources_of
from .radix import MIN_SAVED_TOKENS, Tree, _radix
from .runs import level_order


@dataclass(frozen=True)
class HeldNodes:
    """The held nodes of a scope, in depth-first order (a node's index is its rank; its subtree is `[rank,
    subtree_end)`). Node `x` holds the inputs `[position[x], position[x] + length[x])` of every row through it."""

    position: np.ndarray  # (H,) the row position of its first input
    length: np.ndarray  # (H,)
    parent: np.ndarray  # (H,) -1 at a top node
    depth: np.ndarray  # (H,) its held ancestors
    subtree_end: np.ndarray  # (H,)
    first: np.ndarray  # (H,) the first chunk reading it (its source's, or later: [`tree.hold_budget.hoisted_sources`])
    last: np.ndarray  # (H,) the last
    source: np.ndarray  # (H,) the source forwarding it
    offset: np.ndarray  # (H,) its first input's index in its source's flat sequence
    top_plen: np.ndarray  # (H,) the prompt length of a row through its top node (the stock column its positions take)
    tokens: list[np.ndarray]  # (H,) each node's input token ids
    first_row: np.ndarray  # (H,) a row through it in its first chunk (that chunk's index): whose images it holds (an
    # image batch's sources are never hoisted)


@dataclass(frozen=True)
class ChunkHold:
    """What chunk `index` of a scope holds: for each of its rows (in the chunk's order), the inputs its held nodes
    cover (`skip`: its own inputs start there), the rank of its deepest held node (`key`, -1 for none) and the prompt
    length whose stock column offset its positions take (`position_plen`); the held nodes it reads (`reads`), and the
    source it forwards first (`source`, or None)."""

    index: int
    skip: np.ndarray
    key: np.ndarray
    position_plen: np.ndarray
    reads: np.ndarray
    source: int | None


@dataclass(frozen=True)
class Reads:
    """What one packed forward reads of held sources: the `sources` (slot `i` is `sources[i]`), its held parts
    ([`tree.layout.tree_layout`]'s `held_reads`), the roots' held parents' rows in the slots' concatenated recurrent
    states (`held_roots`, per node of the forward's tree; -1: none) of `states` rows, and the `(node, first, count)`
    runs of readers."""

    sources: list[int]
    held_reads: list[tuple]
    held_roots: np.ndarray | None
    states: int
    runs: list[tuple[int, int, int]]


@dataclass(frozen=True)
class HoldPlan:
    """The held nodes, sources and chunks of a scope (see the module docstring)."""

    nodes: HeldNodes
    source_chunk: np.ndarray  # (S,) the chunk forwarding each source
    backprop_chunk: np.ndarray  # (S,) the chunk whose backward runs each source's (the last reading it)
    chunks: tuple[ChunkHold, ...]

    def source_nodes(self, source: int) -> np.ndarray:
        return np.flatnonzero(self.nodes.source == source)

    def attached(self, source: int, reader_backprop: int) -> bool:
        """Whether a reader whose backward runs in chunk `reader_backprop` reads `source`'s attached tensors."""
        return int(self.backprop_chunk[source]) == reader_backprop

    def released_after(self, chunk: int, training: bool) -> list[int]:
        """The sources whose last use is chunk `chunk`: their state can go once it is done."""
        last = self.backprop_chunk if training else last_readers(self.nodes.source, self.nodes.last,
                                                                  len(self.source_chunk))  # fmt: skip
        return [int(s) for s in np.flatnonzero(last == chunk)]

    def source_tree(self, source: int) -> tuple[Tree, np.ndarray, np.ndarray]:
        """The packed tree of a source's nodes (a forest: a node whose parent is held elsewhere is a root), its tokens
        `(N,)`, and the held nodes of earlier sources its roots read (their ancestors)."""
        nodes = self.source_nodes(source)
        held = self.nodes
        index = np.full(len(held.position), -1, dtype=np.int64)
        index[nodes] = np.arange(len(nodes))
        parent = np.where(held.parent[nodes] >= 0, index[np.maximum(held.parent[nodes], 0)], -1)
        depth = np.zeros(len(nodes), dtype=np.int64)
        root = np.arange(len(nodes))
        for i, p in enumerate(parent):  # depth-first order: a parent comes first
            if p >= 0:
                depth[i], root[i] = depth[p] + 1, root[p]
        start = held.offset[nodes]
        end = start + held.length[nodes]
        subtree_end = end.copy()
        for i in range(len(nodes) - 1, -1, -1):
            if parent[i] >= 0:
                subtree_end[parent[i]] = max(subtree_end[parent[i]], subtree_end[i])
        count = int(held.length[nodes].sum())
        tree = Tree(num_rows=0, num_tokens=count, start=start, length=held.length[nodes], depth=depth, parent=parent,
                    root=root, subtree_end=subtree_end, position=held.position[nodes],
                    row=np.zeros(len(nodes), dtype=np.int64), weight=np.ones(len(nodes), dtype=np.int64),
                    row_inputs=[], real_tokens=count)  # fmt: skip
        tokens = np.concatenate([held.tokens[x] for x in nodes])
        ancestors = set()
        for x in nodes[parent < 0]:
            a = held.parent[x]
            while a >= 0:
                ancestors.add(int(a))
                a = held.parent[a]
        return tree, tokens, np.array(sorted(ancestors), dtype=np.int64)

    @property
    def held_tokens(self) -> int:
        return int(self.nodes.length.sum())

    def forward_pattern(self, chunks: int, training: bool) -> np.ndarray:
        """What the scope adds to each of its `chunks` chunks, `(2, chunks)`: whether it forwards a source first, and
        (in training) how many sources' backward runs in its own. Where every forward and backward gathers parameters
        from all processes, the processes' patterns must agree."""
        pattern = np.zeros((2, chunks), dtype=np.int64)
        pattern[0, self.source_chunk] = 1
        if training:
            np.add.at(pattern[1], self.backprop_chunk, 1)
        return pattern

    def source_tokens(self, source: int) -> int:
        return int(self.nodes.length[self.nodes.source == source].sum())

    def state_rows(self, source: int) -> np.ndarray:
        """Each node of `source`'s row in the final states its recurrent layers hold ([`tree.runs.level_order`])."""
        return level_order(self.source_tree(source)[0])[1]

    def reads_of(self, reads: np.ndarray, tree: Tree, root_keys: np.ndarray, root_parents: np.ndarray,
                 recurrent: bool) -> "Reads":  # fmt: skip
        """What a packed forward over `tree` reads of the held nodes `reads`: its roots, in depth-first order of the held
        tree, are read by the held nodes whose subtree holds `root_keys` and start from the state of `root_parents`
        (-1: none). [`Reads`]."""
        root_nodes = np.flatnonzero(tree.parent < 0)
        root_starts, root_ends = tree.start[root_nodes], tree.subtree_end[root_nodes]
        nodes = self.nodes
        sources = sorted({int(nodes.source[x]) for x in reads})
        slot_of = {source: slot for slot, source in enumerate(sources)}
        runs = read_runs(self, reads, root_keys, root_starts, root_ends - root_starts)
        held_reads = [(slot_of[int(nodes.source[x])], self.source_tokens(int(nodes.source[x])), int(nodes.depth[x]),
                       first, count, int(nodes.offset[x]), int(nodes.length[x]),
                       int(nodes.position[x] + nodes.length[x] - 1)) for x, first, count in runs]  # fmt: skip
        held_roots, states = None, 0
        if recurrent:
            rows = {}
            for source in sources:
                for x, row in zip(self.source_nodes(source), self.state_rows(source), strict=True):
                    rows[int(x)] = states + int(row)
                states += len(self.source_nodes(source))
            held_roots = np.full(len(tree.start), -1, dtype=np.int64)
            for node, parent in zip(root_nodes, root_parents, strict=True):
                if parent >= 0:
                    held_roots[node] = rows[int(parent)]
            if (held_roots < 0).all():  # no root starts from a held state
                held_roots = None
        return Reads(sources, held_reads, held_roots, states, runs)


def _search(root, chunk_of: np.ndarray, plens: np.ndarray, min_saved: int) -> list[tuple[int, int, np.ndarray, int]]:
    """The nodes of the prompts' radix tree (`root`) worth holding, before any budget: the cheapest way to forward
    them for the chunks (`chunk_of`: each member row's) reading them. Depth-first, each `(start token, end token,
    member rows, its nearest held ancestor's index or -1)`."""
    kept: list[tuple[int, int, np.ndarray, int]] = []

    def best(node, start: int, under_held: bool) -> tuple[int, list]:
        """The cheapest way to forward `node`'s subtree for the chunks reading it, its run opening at token `start`
        (an unheld ancestor's tokens copied in), under a held node or not: `(cost, held (node, start) choices)`. The
        cost counts prompt tokens forwarded, and `min_saved` per chunk reading a held node under another held one: one
        more attention part in each of its layers (a chunk's first held level replaces the level of its own tree
        where its prompt would be a node). A node not held is copied into its children, and forwarded by the chunks
        holding a row that ends there."""
        inputs = node.end - 1 - max(start - 1, 0)  # its run's inputs: [max(start - 1, 0), end - 1)
        readers = np.unique(chunk_of[node.rows])
        # Rows ending here, not held: each chunk's own tree forwards the run, once for its rows where it keeps it
        # as a node ([`tree.radix.build_tree`]'s rule), else once per row
        counts = np.unique(chunk_of[node.ended], return_counts=True)[1] if node.ended else np.zeros(0, dtype=np.int64)
        ended = int(np.where((counts - 1) * inputs >= min_saved, inputs, counts * inputs).sum())
        costs = [best(child, start, under_held) for child in node.children]
        skip = (ended + sum(cost for cost, _ in costs), [choice for _, chosen in costs for choice in chosen])
        if len(readers) < 2 or inputs <= 0:
            return skip
        below = [best(child, node.end, True) for child in node.children]
        # Rows of prompts of other lengths through it read it at one row's positions, a constant shift of the
        # others' (exact only to the rotary tables' rounding): worth it only where it saves more than a node's worth
        shifted = min_saved if len(np.unique(plens[node.rows])) > 1 else 0
        hold = (inputs + shifted + (min_saved * len(readers) if under_held else 0) + sum(cost for cost, _ in below),
                [(node, start), *(choice for _, chosen in below for choice in chosen)])
        return hold if hold[0] < skip[0] else skip

    chosen = [choice for child in root.children for choice in best(child, 0, False)[1]]
    # Depth-first (each choice after its held ancestors), each with its nearest held ancestor
    held_at = {id(node): index for index, (node, _) in enumerate(chosen)}

    def link(node, parent: int) -> None:
        if id(node) in held_at:
            _, start = chosen[held_at[id(node)]]
            kept.append((max(start - 1, 0), node.end - 1, node.rows, parent))
            parent = len(kept) - 1
        for child in node.children:
            link(child, parent)

    for child in root.children:
        link(child, -1)
    return kept


def _chunk_holds(chunks: list[tuple], chunk_of: np.ndarray, local: np.ndarray, deepest: np.ndarray,
                 nodes: HeldNodes, source_chunk: np.ndarray) -> tuple[ChunkHold, ...]:  # fmt: skip
    """Each chunk's part of the plan: its rows' inputs the held nodes cover (`deepest`: each member row's deepest held
    node), the nodes it reads, and its source."""
    position, length, parent, top_plen = nodes.position, nodes.length, nodes.parent, nodes.top_plen
    chunk_plans = []
    for index, (group, plen, scored, tokens_of) in enumerate(chunks):
        count = len(group)
        skip = np.zeros(count, dtype=np.int64)
        key = np.full(count, -1, dtype=np.int64)
        position_plen = plen.astype(np.int64).copy()
        reads = set()
        for member in np.flatnonzero(chunk_of == index):
            row, x = local[member], deepest[member]
            if x < 0:
                continue
            skip[row], key[row], position_plen[row] = position[x] + length[x], x, top_plen[x]
            while x >= 0:
                reads.add(int(x))
                x = parent[x]
        sources = np.flatnonzero(source_chunk == index)
        chunk_plans.append(ChunkHold(index, skip, key, position_plen, np.array(sorted(reads), dtype=np.int64),
                                     int(sources[0]) if len(sources) else None))  # fmt: skip
    return tuple(chunk_plans)


def _node_costs(kept: list[tuple], chunk_of: np.ndarray, sequences: list[np.ndarray], token_bytes: int,
                node_bytes: int, image_cost: tuple[set[int], int] | None) -> tuple[np.ndarray, ...]:  # fmt: skip
    """`(first, last, length, cost)` of each searched node ([`_search`]): the first and last chunk reading it, its
    tokens, and the bytes holding it costs (`token_bytes` per token, `node_bytes`, and `image_cost`'s bytes per image
    placeholder token it holds)."""
    first = np.array([chunk_of[rows].min() for _, _, rows, _ in kept])
    last = np.array([chunk_of[rows].max() for _, _, rows, _ in kept])
    length = np.array([end - begin for begin, end, _, _ in kept])
    cost = length * token_bytes + node_bytes
    if image_cost is not None:
        placeholders = np.fromiter(image_cost[0], dtype=np.int64)
        cost = cost + image_cost[1] * np.array([np.isin(sequences[rows[0]][begin:end], placeholders).sum()
                                                for begin, end, rows, _ in kept], dtype=np.int64)  # fmt: skip
    return first, last, length, cost


def _held_tree(kept: list[tuple], keep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(parent, subtree_end, top, depth)` of the held nodes `keep` (indices of the searched `kept`, depth-first): each
    one's nearest held ancestor (-1 for none), the end of its subtree (it and its held descendants are
    `[x, subtree_end[x])`), its topmost held ancestor (itself at the top), and its depth among the held nodes."""
    rank = np.full(len(kept), -1)
    rank[keep] = np.arange(len(keep))
    parent = np.array([rank[kept[x][3]] if kept[x][3] >= 0 else -1 for x in keep], dtype=np.int64)
    subtree_end = np.arange(len(keep)) + 1
    for x in range(len(keep) - 1, -1, -1):
        if parent[x] >= 0:
            subtree_end[parent[x]] = max(subtree_end[parent[x]], subtree_end[x])
    top = np.arange(len(keep))
    depth = np.zeros(len(keep), dtype=np.int64)
    for x in range(len(keep)):  # depth-first: a node's parent comes before it
        if parent[x] >= 0:
            top[x] = top[parent[x]]
            depth[x] = depth[parent[x]] + 1
    return parent, subtree_end, top, depth


def plan_holds(chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]], full: bool,
               token_bytes: int = 0, node_bytes: int = 0, budget: int | None = None, min_saved: int = MIN_SAVED_TOKENS,
               by_group: bool = False, image_cost: tuple[set[int], int] | None = None,
               source_cap: int | None = None, training: bool = True) -> HoldPlan | None:  # fmt: skip
    """
    The [`HoldPlan`] of a scope's chunks, each `(group, prompt length, scored length, tokens)` per row as
    [`tree.rows.row_tokens`] reads them, or None where nothing is worth holding. `full`: every row is a member of its
    chunk's tree (a loss over every token, [`forward.packing.pack_rows`]'s `token_weights`); else the rows with something
    scored, or all of a chunk's rows where none has. `token_bytes`: what a held input token costs, `node_bytes` what a
    held node costs beside its tokens (a hybrid's recurrent states), and `budget` the bytes held at once (None: no
    limit). `by_group`: rows of other groups share nothing (an image batch: their placeholder tokens agree where their
    images differ), so that each held node is one group's prompt. `image_cost`:
    `(placeholder ids, bytes)`, what holding each image placeholder token costs beside `token_bytes` (in training, the
    vision tower's saved activations for its patches). `source_cap`: the tokens a source forward may take (one of
    stock's forwards) when it forwards nodes first read by later chunks too ([`tree.hold_budget.hoisted_sources`]);
    None: each source forwards the nodes first read by its own chunk. `training`: the budget counts each source until
    its backward, else (a no-grad pass) until its own nodes' last reader ([`tree.hold_budget.held_peak`]).
    """
    if any((plen == 0).any() for _, plen, _, _ in chunks):
        return None  # (a row with an empty prompt runs stock's forward: [`forward.packing.pack_rows`])
    chunk_of, local, sequences, plens, groups = [], [], [], [], []
    for index, (group, plen, scored, tokens) in enumerate(chunks):
        members = np.arange(len(group)) if full or not scored.any() else np.flatnonzero(scored > 0)
        for row in members:
            chunk_of.append(index), local.append(row), plens.append(int(plen[row])), groups.append(int(group[row]))
            sequences.append(np.asarray(tokens[row][: plen[row]], dtype=np.int64))
    if len(chunks) < 2 or not sequences:
        return None
    chunk_of, local, plens = np.asarray(chunk_of), np.asarray(local), np.asarray(plens)
    root = _radix(sequences, np.asarray(groups) if by_group else np.zeros(len(sequences), dtype=np.int64))

    kept = _search(root, chunk_of, plens, min_saved)
    if not kept:
        return None
    first, last, length, cost = _node_costs(kept, chunk_of, sequences, token_bytes, node_bytes, image_cost)
    held = budgeted(np.array([parent for _, _, _, parent in kept], dtype=np.int64), first, last, cost, budget,
                    len(chunks), training)  # fmt: skip
    if not held.any():
        return None
    keep = np.flatnonzero(held)  # depth-first still (a dropped node's subtree is dropped with it)
    parent, subtree_end, top, depth = _held_tree(kept, keep)
    position = np.array([kept[x][0] for x in keep], dtype=np.int64)
    length, first, last = length[keep], first[keep], last[keep]
    member_of = [kept[x][2] for x in keep]  # scope member rows through each node
    top_plen = np.array([plens[member_of[top[x]][0]] for x in range(len(keep))], dtype=np.int64)
    tokens = [sequences[member_of[x][0]][position[x] : position[x] + length[x]] for x in range(len(keep))]
    first_row = np.array([local[rows[chunk_of[rows] == first[x]][0]] for x, rows in enumerate(member_of)],
                         dtype=np.int64)  # fmt: skip
    # Sources: the nodes each chunk forwards first, in one forward, in depth-first order
    source_first = first
    if source_cap is not None and not by_group:  # (an image batch's source encodes its own chunk's rows' images)
        hoisted = hoisted_sources(first, last, length, cost[keep], budget, source_cap, len(chunks))
        # A source is released whole, after its last reader's backward: a node joining an earlier source is held as
        # long as the longest of it (hoisted_sources counts each until its own last reader)
        if budget is None or held_peak(hoisted, last, parent, cost[keep], len(chunks), training) <= budget:
            source_first = hoisted
    source_chunk, source, backprop = sources_of(source_first, last, parent)
    offset = np.zeros(len(keep), dtype=np.int64)
    for s in range(len(source_chunk)):
        nodes = np.flatnonzero(source == s)
        offset[nodes] = np.cumsum(length[nodes]) - length[nodes]
    nodes = HeldNodes(position, length, parent, depth, subtree_end, first, last, source, offset, top_plen, tokens,
                      first_row)  # fmt: skip
    # Each member's path of held nodes, deepest last
    deepest = np.full(len(sequences), -1)
    for x in range(len(keep)):  # depth-first: a deeper node on a row's path comes later
        deepest[member_of[x]] = x
    chunk_plans = _chunk_holds(chunks, chunk_of, local, deepest, nodes, source_chunk)
    return HoldPlan(nodes, source_chunk, backprop, chunk_plans)


def read_runs(plan: HoldPlan, reads: np.ndarray, key_of_query: np.ndarray,
              query_starts: np.ndarray, query_lengths: np.ndarray) -> list[tuple[int, int, int]]:  # fmt: skip
    """
    For each held node of `reads`, the run of a forward's flat tokens that reads it: `(node, first, count)`. The
    forward's nodes `query_starts`/`query_lengths` come in depth-first order of the held tree above them, each with
    `key_of_query` the rank of the held node it hangs from (-1: none): a held node's readers are those whose key lies
    in its subtree, one run of the flat sequence.
    """
    runs = []
    order_ok = (np.diff(key_of_query) >= 0).all() if len(key_of_query) > 1 else True
    if not order_ok:
        raise ValueError("A packed forward's nodes are not ordered by the held node they hang from.")
    for x in reads:
        lo, hi = x, plan.nodes.subtree_end[x]
        inside = np.flatnonzero((key_of_query >= lo) & (key_of_query < hi))
        if not len(inside):
            continue
        first = int(query_starts[inside[0]])
        end = int(query_starts[inside[-1]] + query_lengths[inside[-1]])
        runs.append((int(x), first, end - first))
    return runs
