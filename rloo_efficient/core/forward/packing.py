"""
Every real token once: the batch's rows, and the packed forward of a micro-batch over their prefix tree.

Stock TRL scores a micro-batch as `B` rows `[left-padded prompt | completion | right padding]`: every prompt once per
row, every completion padded to the longest. Here the micro-batch becomes one flat sequence holding each node of its
prefix tree ([`tree.radix`]) once, every completion at its own length: no padding. Every token keeps its position in its rows
(its column in stock's rows, or where a node is shared across groups whose prompts are of other lengths, a constant
shift of it: rotary embeddings see the distances stock's rows give them), predicts the next
token of its rows through `shift_labels` (a node opens with a copy of its parent's last token, so that no position
predicts two labels), and attends to its ancestors and causally within its node through the layout
([`tree.parts.TreeLayout`]) the model call carries. Rows with nothing to score (a masked truncated completion) are left
out: stock TRL's log-probs for them are all zero, and so are ours.

The structure comes from the token lists TRL holds, once per generation batch ([`row_groups`]): a small CPU tensor of
each row's group, prompt length, scored length and tokens, which travels with the batch (TRL's shuffle and split carry
it). Each micro-batch's tree and index tensors are built from it in NumPy and sent to the device in one copy; the
tokens themselves are gathered from stock's batch on the device. Nothing reads a device value back.
"""

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..tree.holds import ChunkHold, HoldPlan
from ..tree.layout import LAYOUT_KWARG, NO_MASK, tree_layout
from ..tree.parts import TreeLayout
from ..tree.radix import MIN_SAVED_TOKENS, Tree, build_tree
from ..tree.rows import row_tokens


@dataclass
class PackedBatch:
    """A micro-batch packed as its prefix tree, and where its scored log-probs go in stock TRL's `(B, C)` layout."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N)
    shift_labels: torch.Tensor  # (1, N) the token each position predicts, -100 where none is scored
    unpack_index: torch.Tensor  # (B*C,) flat position of each (row, column) log-prob; N (a zero) where unscored
    layout: TreeLayout
    tree: Tree  # the host structure (its counts: the packed tokens, the radix tree's real ones)
    num_rows: int  # B
    num_cols: int  # C, the padded completion width
    token_weights: torch.Tensor | None = None  # (1, N) int64: how many times stock's batch holds each token
    source_index: torch.Tensor | None = None  # (N,) flat index into stock's (B, P + C) batch of each packed token
    first_rows: np.ndarray | None = None  # (G,) host: one row per group, groups in the order their tokens come
    image_rows: np.ndarray | None = None  # host: those of `first_rows` whose group's images this forward encodes
    group_source_index: torch.Tensor | None = None  # (N,) flat index into a (G, P + C) array, one row per group
    # Held nodes read ([`tree.holds`]): the sources of the layout's slots, and with `token_weights`, per slot how many
    # of this micro-batch's rows hold each of the source's tokens `(Ns,)` (0 where none)
    held_sources: tuple[int, ...] = ()
    held_weights: tuple[torch.Tensor, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens the model processes (no padding)."""
        return self.input_ids.shape[1]

    def model_inputs(self) -> dict:
        """Keyword arguments for `model(..., fused_lm_head=True)`."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": NO_MASK,
            "position_ids": self.position_ids,
            "shift_labels": self.shift_labels,
            LAYOUT_KWARG: self.layout,
        }

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`(1, N)` per-position values (zero where unscored) -> `(B, C)` in stock TRL's layout, differentiably (a
        position several rows read gets the sum of their gradients)."""
        values = torch.cat([packed.view(-1), packed.new_zeros(1)])
        return values.index_select(0, self.unpack_index).view(self.num_rows, self.num_cols)


def _labels(tree, members: np.ndarray, scored: np.ndarray, first_label: np.ndarray, width: int, prompt_width: int,
            logits_to_keep: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """`(labels, unpack)`: each packed input's label as an index into stock's flat `(B * width)` batch (its -100
    sentinel after it where the input predicts nothing scored), and each row's scored columns' packed input `(B,
    logits_to_keep)` (N where none). Position j of row r predicts its token j + 1, a completion token where j + 1 >=
    plen; `first_label` per row: the index of that first input among its own packed inputs."""
    total, num_rows = tree.num_tokens, len(scored)
    labels = np.full(total, num_rows * width, dtype=np.int64)
    unpack = np.full((num_rows, logits_to_keep), total, dtype=np.int64)
    for member, row in enumerate(members):
        count = scored[row]
        if count == 0:
            continue
        flat = tree.row_inputs[member][first_label[row] : first_label[row] + count]
        labels[flat] = row * width + prompt_width + np.arange(count)
        unpack[row, :count] = flat
    return labels, unpack


def _held_token_weights(plan: HoldPlan, reads, member_keys: np.ndarray) -> list[np.ndarray]:
    """Per slot of `reads`, how many of the chunk's rows (their deepest held nodes `member_keys`) hold each of its
    source's tokens."""
    out = []
    for source in reads.sources:
        weights = np.zeros(plan.source_tokens(source), dtype=np.int64)
        for x, _, _ in reads.runs:
            if plan.nodes.source[x] == source:
                under = (member_keys >= x) & (member_keys < plan.nodes.subtree_end[x])
                start = plan.nodes.offset[x]
                weights[start : start + plan.nodes.length[x]] = int(under.sum())
        out.append(weights)
    return out


def _image_nodes(tree, sequences: list, member_rows: np.ndarray, positions: np.ndarray,
                 image_tokens: set[int]) -> np.ndarray:  # fmt: skip
    """The nodes holding an image's placeholder tokens (`positions`: each flat token's in its rows)."""
    values = np.concatenate(sequences)[np.cumsum([0, *(len(s) for s in sequences)])[:-1][member_rows] + positions]
    holds = np.isin(values, np.fromiter(image_tokens, dtype=np.int64))
    return np.unique(np.repeat(np.arange(len(tree.start)), tree.length)[holds])


def _first_rows(tree, group: np.ndarray, members: np.ndarray) -> np.ndarray:
    """One row per group, in the order of the group's first node (an image batch's: the order its images come)."""
    roots = np.flatnonzero(tree.parent == -1)
    _, first = np.unique(group[members[tree.row[roots]]], return_index=True)
    return members[tree.row[roots[np.sort(first)]]]


def _crosses_period(position_ids: np.ndarray, columns: np.ndarray, period: int | None, width: int) -> bool:
    """Whether a packed token's position falls in another `period` than its column in stock's row does."""
    return period is not None and width > period and bool((position_ids // period != columns // period).any())


def _row_tree(sequences: list, group: np.ndarray, plen: np.ndarray, members: np.ndarray, full: bool, images: bool,
              chunk: ChunkHold | None, min_saved: int) -> tuple[Tree, np.ndarray, np.ndarray]:  # fmt: skip
    """`(tree, skip, position_plen)`: the prefix tree of the `members` rows' inputs ([`tree.radix.build_tree`]); under
    a `chunk`'s held nodes each row's own inputs start after the `skip` they cover (at their positions), hung from its
    deepest held node. `position_plen`: the prompt lengths the position ids count from."""
    skip = np.zeros(len(plen), dtype=np.int64)
    keys = group[members] if images else None
    position_plen = plen
    if chunk is not None:  # each row's own inputs start after its held nodes', hung from its deepest held node
        skip, keys, position_plen = chunk.skip, chunk.key[members], chunk.position_plen
        if images:  # ordered by held node still (the readers' runs), the rows of other groups apart where none is held
            keys = keys * (int(group.max()) + 1) + group[members]
    tree = build_tree([sequences[row][skip[row] :] for row in members], keys=keys, ends=full, min_saved=min_saved,
                      keep_roots=images)  # fmt: skip
    if chunk is not None:
        tree = replace(tree, position=tree.position + skip[members[tree.row]])
    return tree, skip, position_plen


def _packed_batch(input_ids: torch.Tensor, logits_to_keep: int, tree: Tree, layout: TreeLayout, on_device: list,
                  reads, token_weights: bool, group_sources: bool, first_rows: np.ndarray | None,
                  image_rows: np.ndarray | None) -> PackedBatch:  # fmt: skip
    """The [`PackedBatch`] of [`pack_rows`]'s parts sent with its `layout` (`on_device`: the token, label, position and
    unpacking indices, then the group sources, token weights and held weights asked for), its tokens and labels
    gathered from stock's `input_ids` in one `index_select`."""
    total = tree.num_tokens
    held_weights = ()
    if reads is not None and token_weights:
        held_weights = tuple(reversed([on_device.pop() for _ in reads.sources]))
    weights = on_device.pop().view(1, total) if token_weights else None
    group_source = on_device.pop() if group_sources else None
    index, label_index, position_ids, unpack_index = on_device
    ids = torch.cat([input_ids.view(-1), input_ids.new_full((1,), -100)])
    gathered = ids.index_select(0, torch.cat([index, label_index]))
    return PackedBatch(input_ids=gathered[:total].view(1, total), position_ids=position_ids.view(1, total),
                       shift_labels=gathered[total:].view(1, total), unpack_index=unpack_index, layout=layout,
                       tree=tree, num_rows=input_ids.shape[0], num_cols=logits_to_keep, token_weights=weights,
                       source_index=index, first_rows=first_rows, image_rows=image_rows,
                       group_source_index=group_source, held_sources=tuple(reads.sources) if reads is not None else (),
                       held_weights=held_weights)  # fmt: skip


def pack_rows(input_ids: torch.Tensor, logits_to_keep: int, rows: torch.Tensor, token_weights: bool = False,
              group_sources: bool = False, image_tokens: set[int] | None = None, min_saved: int = MIN_SAVED_TOKENS,
              recurrent: bool = True, hold: tuple[HoldPlan, ChunkHold] | None = None,
              position_period: int | None = None) -> PackedBatch | str:  # fmt: skip
    """
    Packs stock TRL's `(B, P + C)` scoring batch (left-padded prompts, right-padded completions, the last
    `logits_to_keep` columns being the completion) by its `rows` ([`row_groups`], a CPU tensor) into its prefix tree.
    Returns the [`PackedBatch`], or the reason the batch cannot be packed (then the stock forward runs).

    With `token_weights` (for a loss over every token stock's batch holds, the MoE load-balancing loss), every token
    stock's attention mask holds is an input, unscored rows' prompts and each row's last token included, and
    [`PackedBatch.token_weights`] counts how many of stock's rows hold it. A micro-batch with nothing scored packs
    likewise (its forward gives stock's zeros, with a graph to carry their gradient).

    With `image_tokens` (an image batch: the placeholder ids), the rows of other groups share nothing (their images
    differ where their placeholders agree), each group's prompt stays one node (its images encoded once), and
    [`PackedBatch.first_rows`] gives one row per group in the order their images come. With `group_sources`,
    [`PackedBatch.group_source_index`] gives each packed token's (group, column) in a `(G, P + C)` array of those rows
    (for what is the same for every row of a group: Qwen's 3-D positions). `recurrent`: whether the model has
    recurrent layers (the layout then holds their levels).

    With `hold` (a scope's plan and this chunk's part of it, [`tree.holds`]), each row's inputs its held nodes cover are
    not packed: its own start after them, at their positions, and its tokens read the held nodes' keys from the held
    state ([`attention.held.HeldReads`], which the caller sets on the layout: its slots are `held_sources`).

    `position_period` ([`layers.families.position_period`]): queries scaled by `floor(position / period)`; a batch
    where a shared node's shifted positions would fall in another period than stock's columns is not packed.
    """
    device = input_ids.device
    num_rows, width = input_ids.shape
    prompt_width = width - logits_to_keep
    group, plen, scored, sequences = row_tokens(rows)
    if (plen == 0).any():
        return "an empty prompt has no token to condition its completion on"
    full = token_weights or not scored.any()  # every token stock's mask holds is an input
    members = np.arange(num_rows) if full else np.flatnonzero(scored > 0)
    images = image_tokens is not None
    plan, chunk = hold if hold is not None else (None, None)
    tree, skip, position_plen = _row_tree(sequences, group, plen, members, full, images, chunk, min_saved)
    member_rows = members[tree.token_row]  # (N,) a stock row holding each token
    positions = tree.token_position
    offset = prompt_width - plen  # a row's token at position j sits in column offset + j of stock's row
    source = member_rows * width + offset[member_rows] + positions
    # Position ids: stock's columns, those of each root's row under it (a node shared across groups whose prompts are
    # of other lengths shifts its other rows' positions by a constant: attention reads only their differences); under
    # a held node, those of its top held node's row
    root_rows = members[tree.row[tree.root]]
    position_ids = np.repeat((prompt_width - position_plen)[root_rows], tree.length) + positions
    if _crosses_period(position_ids, offset[member_rows] + positions, position_period, width):
        return (f"its queries are scaled by absolute position (Llama 4's scaling, period {position_period}): a node "
                "shared by rows of other prompt lengths would sit in another period than in stock's rows")  # fmt: skip
    # Labels and the unpacking: position j of row r predicts its token j + 1, a completion token where j + 1 >= plen
    labels, unpack = _labels(tree, members, scored, plen - 1 - skip, width, prompt_width, logits_to_keep)
    parts = [source, labels, position_ids, unpack.reshape(-1)]
    first_rows = image_rows = None
    if images:
        first_rows = _first_rows(tree, group, members)
        # The groups whose prompt (and images) this forward holds: not those a held node holds
        image_rows = first_rows if hold is None else first_rows[chunk.key[first_rows] < 0]
        if group_sources:
            rank = np.full(int(group.max()) + 1, -1)
            rank[group[first_rows]] = np.arange(len(first_rows))
            parts.append(rank[group[member_rows]] * width + offset[member_rows] + positions)
    if token_weights:
        parts.append(tree.token_weight)
    reads = None
    if hold is not None:
        root_keys = chunk.key[members[tree.row[np.flatnonzero(tree.parent < 0)]]]
        reads = plan.reads_of(chunk.reads, tree, root_keys, root_keys, recurrent)
        if token_weights:  # how many of these rows hold each held token
            parts += _held_token_weights(plan, reads, chunk.key[members])
    image_nodes = _image_nodes(tree, sequences, member_rows, positions, image_tokens) if images else None
    held_args = {} if reads is None else dict(held_reads=reads.held_reads, held_roots=reads.held_roots,
                                              held_states=reads.states)  # fmt: skip
    layout, on_device = tree_layout(tree, device, image_nodes, parts=parts, recurrent=recurrent, **held_args)
    return _packed_batch(input_ids, logits_to_keep, tree, layout, on_device, reads, token_weights,
                         images and group_sources, first_rows, image_rows)  # fmt: skip


@dataclass
class SourceBatch:
    """A source forward's packed inputs ([`tree.holds`]): its held nodes once, nothing scored. In an image batch (each
    held node one group's prompt) also what [`PackedBatch`] says of its groups, from the row of the source's chunk
    through each node (`first_rows`, the chunk's own indices)."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N)
    shift_labels: torch.Tensor  # (1, N) all -100
    layout: TreeLayout
    held_sources: tuple[int, ...]  # the slots' sources (the held nodes of earlier sources its roots read)
    num_rows: int = 0  # the rows of the source's chunk
    source_index: torch.Tensor | None = None  # (N,) flat index into the chunk's (B, P + C) batch of each token
    first_rows: np.ndarray | None = None  # (G,) host: the chunk's row through each node, in the nodes' order
    image_rows: np.ndarray | None = None  # (G,) host: the same (every node's images are encoded here)
    group_source_index: torch.Tensor | None = None  # (N,) flat index into a (G, P + C) array of those rows

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "attention_mask": NO_MASK, "position_ids": self.position_ids,
                "shift_labels": self.shift_labels, LAYOUT_KWARG: self.layout}  # fmt: skip


def pack_source(plan: HoldPlan, source: int, prompt_width: int, device, recurrent: bool = True,
                image_tokens: set[int] | None = None, rows: tuple[int, int] | None = None) -> SourceBatch:  # fmt: skip
    """The packed forward of `plan`'s `source`: its held nodes as a forest, in depth-first order, at their rows'
    positions (stock's columns of its top held node's row, as every chunk reading it), its roots reading their held
    ancestors' keys from earlier sources. With `image_tokens` (an image batch, planned `by_group`: every node a group's
    prompt, a root) and `rows` `(rows, width)`, the shape of the source's chunk: the nodes holding images (their own
    attention calls) and where each token sits in the chunk's rows."""
    tree, tokens, ancestors = plan.source_tree(source)
    nodes = plan.source_nodes(source)
    roots = np.flatnonzero(tree.parent < 0)
    root_parents = plan.nodes.parent[nodes[roots]]
    reads = plan.reads_of(ancestors, tree, nodes[roots], root_parents, recurrent)
    position_ids = np.repeat(prompt_width - plan.nodes.top_plen[nodes], tree.length) + tree.token_position
    parts, image_nodes, first_rows = [tokens, position_ids], None, None
    if image_tokens is not None:
        if (tree.parent >= 0).any() or len(ancestors):
            raise ValueError("An image batch's held nodes are each one group's prompt (planned by group).")
        num_rows, width = rows
        first_rows = plan.nodes.first_row[nodes]
        node_of = np.repeat(np.arange(len(nodes)), tree.length)
        parts += [first_rows[node_of] * width + position_ids, node_of * width + position_ids]
        holds = np.isin(tokens, np.fromiter(image_tokens, dtype=np.int64))
        image_nodes = np.unique(node_of[holds])
    layout, on_device = tree_layout(tree, device, image_nodes, parts=parts, recurrent=recurrent,
                                    held_reads=reads.held_reads, held_roots=reads.held_roots,
                                    held_states=reads.states)  # fmt: skip
    ids, positions = on_device[:2]
    total = tree.num_tokens
    batch = SourceBatch(ids.view(1, total), positions.view(1, total), torch.full_like(ids, -100).view(1, total),
                        layout, tuple(reads.sources))  # fmt: skip
    if image_tokens is None:
        return batch
    return replace(batch, num_rows=rows[0], source_index=on_device[2], first_rows=first_rows, image_rows=first_rows,
                   group_source_index=on_device[3])
