"""
The parts of a [`TreeLayout`], as the attention and recurrent layers read them on the device: padded
[`Blocks`] of the flat sequence, each level's [`Part`], the variable-length calls ([`Packed`]), held nodes' parts
([`HeldPart`]), a continued cache's ([`HistoryPart`]) and the recurrent layers' [`Level`]s.
"""

from dataclasses import dataclass, field

import numpy as np
import torch


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
    """A length bucket of nodes whose rows continue a cache held from an earlier call ([`generation.turn_cache`]): their
    tokens (queries, `(n, L)`) read their row's held keys, in row `rows` (n,) of the layer's cache: its columns `[first,
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
    """The packed forward's structure (see [`tree.layout`]); `memo` holds what every layer derives alike from it
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
    # The same attention as variable-length calls, for devices with such a kernel ([`tree.layout.VARLEN_DEVICES`]):
    # every node's own tokens, causal, as one call over the flat sequence (None where image nodes need their bias), and
    # each level's part, its nodes' subtrees reading their tokens; no padding, no gather of the nodes
    packed_nodes: Packed | None = None
    packed_parts: tuple[Packed, ...] = ()
    # Nodes held by an earlier forward and read here ([`tree.holds`]): their parts, the held state they read
    # ([`attention.held.HeldReads`], set by the caller), and per root bucket of the levels the row of each root's held
    # parent's state in the slots' concatenated states (its last row, zeros, for a root without one)
    held_parts: tuple[HeldPart, ...] = ()
    # Where the variable-length kernel runs and the copies allow ([`tree.layout.FOLD_COPIES`]): each node's own causal
    # call with its held ancestors' keys, then its ancestors' in the tree, before its own (aligned at its last query and
    # key: every ancestor's key, then its own causally), keys gathered from [the flat sequence | each slot's, in slot
    # order]: the nodes, the levels' parts and the held parts in one call
    held_nodes: Packed | None = None
    # Host: where the nodes are one row's path (each the previous one's child, in flat order, reading held nodes only
    # before the first), the held keys it reads first, `(slot, first, count)` each by depth (empty: none): then its
    # attention is one causal call over [those keys | the flat sequence] ([`tree.runs.chain_of`]); None where it is not
    chain: tuple[tuple[int, int, int], ...] | None = None
    held: object = None
    held_roots: tuple[torch.Tensor, ...] = ()
    # Host: each node's row in the recurrent layers' concatenated final states ([`tree.runs.level_order`])
    state_order: np.ndarray | None = None
