"""
Each row's cache carried from one `generate` call to the next: the turns of a tool loop.

TRL's tool loop builds a row's next input by concatenating token ids (its prompt, its completion, the tool's answer and
the template around it) and calls `generate` again, which prefills the whole history. Every token of the history but
the new ones was already forwarded in the row's previous call, at the same position (a row's positions are its own,
whatever its padding), and its keys and values depend on nothing after it. So the cache that call left ([`HeldCache`])
serves the next: each row's new input is matched, on the host, to the held row whose forwarded tokens it extends
([`plan_continuation`]); the held keys and values are copied into the new batch's padded cache, and only each row's
new tokens are forwarded ([`continue_prefill`]): packed, with no padding, each attending causally to its own new
tokens (tree attention over a forest of one node per row) and to its row's held ones (one more part per length bucket,
merged by log-sum-exp). `generate` then continues from that cache as from a prefill.

Held keys and values were computed in the previous call's decoding steps (one token at a time), a fresh prefill's in
one pass: they agree to the floating-point rounding of those different matmul shapes (exactly in float64's samples).

What a row's previous call forwarded past its end (the padding `generate` feeds a finished row) is never reused: a
held row's tokens stop at its first end-of-sequence token. Only caches of keys and values continue (no recurrent
state: it went on past the row's end; multi-head latent attention's latents, which each continued token reads expanded
by its layer; Gemma 4's layers reading another's read its). A sliding-window layer
keeps its whole history in a tool loop ([`generation.turn_cache`]): the batch's last positions it would keep are padding for a
row that finished early.
"""

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

from ..attention.backend import continuing_with
from ..tree.layout import tree_layout
from ..tree.parts import Blocks, HistoryPart
from ..tree.runs import bucketed_blocks
from ..tree.radix import Tree, ranges
from .prompt_cache import PrefixCache, PrefixLayer, ReadDtypeCache, cache_limit, kv_sources, kv_token_bytes
from .tree_prefill import forward_capturing, tree_prefill_reason


def continue_reason(model: nn.Module) -> str | None:
    """Why a row's cache cannot be continued into its next `generate` call for `model`, or None. Found once."""
    if "_rloo_continue_reason" not in vars(model):
        config = model.config.get_text_config(decoder=True)
        reason = tree_prefill_reason(model)
        layers = DynamicCache(config=config).layers
        sources = kv_sources(config)
        if reason is None and any(isinstance(layer, DummyLayer) and sources[index] == index
                                  for index, layer in enumerate(layers)):  # fmt: skip
            reason = "a cache layer stores nothing and reads no other layer's keys"
        model._rloo_continue_reason = reason
    return model._rloo_continue_reason


def turn_cache(model: nn.Module) -> DynamicCache:
    """
    An empty cache for a call of a tool loop whose cache is held: a sliding-window layer keeps all its keys (a plain
    layer), not the batch's last `w - 1` positions, which for a row that finished early are `generate`'s padding, not
    its window. Its attention still reads the window only: the model's sliding mask (sized from a full layer) and our
    decoding ([`attention.windows.decode_window_biases`]) mask the rest; the keys it keeps cost memory and, while
    decoding, reads.
    """
    cache = ReadDtypeCache(config=model.config.get_text_config(decoder=True))
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


def windows_over_budget(model: nn.Module, rows: int, longest: int, budget: int) -> bool:
    """Whether [`generation.turn_cache`]'s layers for `rows` rows of `longest` tokens would take more than `budget` bytes, for a
    model with sliding windows (whose cache would otherwise keep only the windows: the call then uses it). Estimated
    from the config, before the call."""
    if "_rloo_whole_token_bytes" not in vars(model):
        model._rloo_whole_token_bytes = _whole_token_bytes(model)
    return rows * longest * model._rloo_whole_token_bytes > budget


def _whole_token_bytes(model: nn.Module) -> int:
    """The bytes of one row's token in [`generation.turn_cache`]'s layers (keys and values, every layer storing them),
    from the config ([`kv_token_bytes`]); 0 for a model without sliding windows (nothing beyond stock's cache)."""
    config = model.config.get_text_config(decoder=True)
    if not any(type(layer) is DynamicSlidingWindowLayer for layer in DynamicCache(config=config).layers):
        return 0
    return kv_token_bytes(config, next(model.parameters()).element_size())


@dataclass
class HeldCache:
    """
    The keys and values a `generate` call left, per row: row `r`'s held token `p` is in `prefix[layer]` (the prompt
    stored once per group, [`PrefixCache`]) at `(prefix_row[r], prefix_start[r] + p)` for `p < prefix_count[r]`, and in
    `own[layer]` (`(R, Hkv, T, D)`, the row's own) at `(r, own_start[r] + p - prefix_count[r])` after.
    """

    tokens: list[np.ndarray]  # per row, the tokens whose keys and values are held, in order
    own: list  # per cache layer, (keys, values), or None for a layer storing nothing
    prefix: list  # per cache layer, (keys, values) of the prompts kept once, or None
    prefix_row: np.ndarray
    prefix_start: np.ndarray
    prefix_count: np.ndarray
    own_start: np.ndarray

    def drop(self) -> None:
        """Releases the held keys and values (the token lists stay)."""
        self.own = [None] * len(self.own)
        self.prefix = [None] * len(self.prefix)

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in [*self.own, *self.prefix] if pair is not None for t in pair]
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def held_tokens(prompt_ids: list[list[int]], sequences: torch.Tensor, width: int, eos: list[int]) -> list[np.ndarray]:
    """Each row's tokens whose keys and values a `generate` call's cache holds: its prompt and the tokens it sampled
    and forwarded (all but the last), up to its first end-of-sequence token (what follows is `generate`'s padding)."""
    generated = sequences[:, width:-1].cpu().numpy() if sequences.shape[1] > width else np.zeros((len(prompt_ids), 0))
    rows = []
    for prompt, tokens in zip(prompt_ids, generated, strict=True):
        ends = np.flatnonzero(np.isin(tokens, eos)) if eos else []
        rows.append(np.concatenate([np.asarray(prompt, dtype=np.int64),
                                    tokens[: ends[0] + 1 if len(ends) else len(tokens)].astype(np.int64)]))  # fmt: skip
    return rows


def hold(cache: DynamicCache, prompt_ids: list[list[int]], sequences: torch.Tensor, width: int,
         eos: list[int]) -> HeldCache | None:  # fmt: skip
    """The [`HeldCache`] of a `generate` call that decoded the left-padded `(B, width)` prompts `prompt_ids` into
    `sequences` from `cache` (a [`PrefixCache`], or a cache of the rows' own keys and values), or None where a layer
    kept only the batch's last positions (a cache not made by [`generation.turn_cache`])."""
    if any(getattr(layer, "is_sliding", False) or getattr(layer, "window", None) for layer in cache.layers):
        return None
    rows = len(prompt_ids)
    lengths = np.array([len(prompt) for prompt in prompt_ids], dtype=np.int64)
    own, prefix = [], []
    for layer in cache.layers:
        stored = isinstance(layer, DynamicLayer) and layer.keys is not None and layer.keys.numel() > 0
        own.append((layer.keys, layer.values) if stored else None)
        prefix.append((layer.prefix_keys, layer.prefix_values) if stored and isinstance(layer, PrefixLayer) else None)
    if isinstance(cache, PrefixCache):  # the prompt's tokens but its last once per group; the rest in the rows' own
        inverse = np.asarray(cache.inverse, dtype=np.int64)
        columns = next(layer.prefix_columns for layer in cache.layers if isinstance(layer, PrefixLayer))
        prefix_row, prefix_count = inverse, lengths - 1
        prefix_start, own_start = columns - prefix_count, np.zeros(rows, dtype=np.int64)
    else:
        prefix_row = prefix_start = prefix_count = np.zeros(rows, dtype=np.int64)
        own_start = width - lengths
    tokens = held_tokens(prompt_ids, sequences, width, eos)
    return HeldCache(tokens, own, prefix, prefix_row, prefix_start, prefix_count, own_start)


@dataclass(frozen=True)
class Continuation:
    """Which held row each of a call's rows continues (`source`, -1 for none), and how many of its tokens (`reused`)."""

    source: np.ndarray  # (B,)
    reused: np.ndarray  # (B,)


def plan_continuation(held: HeldCache, prompt_ids: list[list[int]]) -> Continuation | None:
    """
    Each row of `prompt_ids` matched to the held row whose tokens open it (all of them: a row whose history changed
    inside its held tokens continues nothing), reusing them but its last token (`generate`'s first input). TRL calls
    the next turn with a subsequence of the rows in their order: the held rows are walked once, in order; a row found
    nowhere from there on continues nothing. None where no row reuses a token. On the host.
    """
    source = np.full(len(prompt_ids), -1, dtype=np.int64)
    reused = np.zeros(len(prompt_ids), dtype=np.int64)
    start = 0
    for row, ids in enumerate(prompt_ids):
        ids = np.asarray(ids, dtype=np.int64)
        for candidate in range(start, len(held.tokens)):
            tokens = held.tokens[candidate]
            if len(tokens) and len(tokens) <= len(ids) and ids[len(tokens) - 1] == tokens[-1] and np.array_equal(
                    ids[: len(tokens)], tokens):  # fmt: skip
                source[row], reused[row], start = candidate, min(len(tokens), len(ids) - 1), candidate + 1
                break
    return Continuation(source, reused) if reused.any() else None


def _held_token_places(held: HeldCache, plan: Continuation, lengths: np.ndarray, width: int) -> list[tuple]:
    """Where each held token `plan` reuses goes and where it is held, on the host: `(destination, row, column)` for
    those in the prompts kept once, then for those in their row's own keys and values; `destination` its place in the
    new cache, flat (`B * (width - 1)`; token `p` of row `b` at column `width - n_b + p`), `(row, column)` its place in
    the held `(R, T)` rows."""
    columns, reused = width - 1, plan.reused
    has = np.flatnonzero(reused > 0)
    token_row = np.repeat(has, reused[has])
    position = ranges(np.zeros(len(has)), reused[has])
    held_row = plan.source[token_row]
    in_prefix = position < held.prefix_count[held_row]
    destination = token_row * columns + width - lengths[token_row] + position
    return [(destination[select], rows_of[select], columns_of[select]) for select, rows_of, columns_of in (
        (in_prefix, held.prefix_row[held_row], held.prefix_start[held_row] + position),
        (~in_prefix, held_row, held.own_start[held_row] + position - held.prefix_count[held_row]))]  # fmt: skip


def _history_parts(buckets: list, sent: list, continuing: np.ndarray, first: np.ndarray, reused_n: np.ndarray,
                   count: int) -> tuple[HistoryPart, ...]:  # fmt: skip
    """The continued prefill's [`HistoryPart`]s, one per length bucket of the nodes that reuse something: its blocks,
    rows, first columns and held counts as `sent` (five tensors per bucket), and the columns its rows' held keys span
    (from the host's `first` and `reused_n`, per node)."""
    history = []
    for (run, gather, _), index in zip(buckets, range(0, len(sent), 5), strict=True):
        gather_t, scatter_t, rows_t, first_t, count_t = sent[index : index + 5]
        picked = continuing[run]
        ends = first[picked] + reused_n[picked]
        span = (int(first[picked].min()), int(ends.max()))
        scatter_t = scatter_t.view(gather.shape)
        blocks = Blocks(gather_t.view(gather.shape), scatter_t, scatter_t == count)
        history.append(HistoryPart(blocks, rows_t, first_t, count_t, span, int(ends.min())))
    return tuple(history)


def _copy_held(cache: DynamicCache, held: HeldCache, places: list, rows: int, columns: int) -> dict:
    """Per layer of `cache` storing keys and values, `(keys, values)` token-major `(B * columns, Hkv, D)`: zeros, but
    the held tokens copied from `held` to their `places` (the prompts kept once, then the rows' own). `held` is
    emptied: each layer's keys released as soon as copied, the rest dropped after."""
    storage = {}
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DummyLayer):
            continue
        if held.own[index] is None:
            raise RuntimeError(f"No keys and values were held for cache layer {index}.")
        keys, values = (x.new_zeros(rows * columns, x.shape[1], x.shape[3]) for x in held.own[index])
        for part, place in zip((held.prefix[index], held.own[index]), places, strict=True):
            if place is not None:
                where, rows_of, columns_of = place
                if part is None:
                    raise RuntimeError(f"A held row's prompt kept once is missing for cache layer {index}.")
                for target, x in zip((keys, values), part, strict=True):  # (R, T, Hkv, D) views: (n, Hkv, D) picked
                    target.index_copy_(0, where, x.transpose(1, 2)[rows_of, columns_of])
        storage[index] = (keys, values)
        held.own[index] = held.prefix[index] = None  # this layer's held keys: released as soon as copied
    held.drop()  # the rest (layers storing nothing): the caller's holder keeps only the token lists
    return storage


@torch.no_grad()
def continue_prefill(model: nn.Module, held: HeldCache, plan: Continuation, prompt_ids: list[list[int]],
                     width: int) -> tuple[DynamicCache, int]:  # fmt: skip
    """
    The cache a prefill of the left-padded `(B, width)` prompts `prompt_ids` would leave (their first `width - 1`
    columns), from the held keys and values `plan` reuses and one packed forward over the rest of each row (its new
    tokens but its last). `held` is emptied once copied from (before the forward). Returns the cache and the tokens
    forwarded.
    """
    device = next(model.parameters()).device
    lengths = np.array([len(ids) for ids in prompt_ids], dtype=np.int64)
    rows, columns, reused = len(prompt_ids), width - 1, plan.reused
    fresh = lengths - 1 - reused  # each row's tokens to forward (its last is generate's)
    sources = _held_token_places(held, plan, lengths, width)
    # The new tokens: a forest of one node per row, at the positions after its held tokens
    nodes = np.flatnonzero(fresh > 0)
    lengths_n, reused_n = fresh[nodes], reused[nodes]
    starts = np.cumsum(lengths_n) - lengths_n
    count = int(lengths_n.sum())
    tree = Tree(rows, count, starts, lengths_n, np.zeros(len(nodes), dtype=np.int64),
                np.full(len(nodes), -1, dtype=np.int64), np.arange(len(nodes)), starts + lengths_n, reused_n, nodes,
                np.ones(len(nodes), dtype=np.int64), [], count)  # fmt: skip
    tokens = np.concatenate([np.asarray(prompt_ids[row][reused[row] : lengths[row] - 1], dtype=np.int64)
                             for row in nodes]) if len(nodes) else np.zeros(0, dtype=np.int64)  # fmt: skip
    slots = (nodes * columns + width - lengths[nodes]).repeat(lengths_n) + ranges(reused_n, lengths_n)
    # Each length bucket of the rows that reuse something reads their held keys: the columns they were copied to
    continuing = np.flatnonzero(reused_n > 0)  # among the nodes
    buckets = bucketed_blocks(starts[continuing], lengths_n[continuing], count)
    first = width - lengths[nodes]  # each node's row's first column in the new cache
    host = [array for source in sources for array in source] + [tokens, slots]
    for run, gather, scatter in buckets:
        picked = continuing[run]
        host += [gather, scatter, nodes[picked], first[picked], reused_n[picked]]
    layout, sent = tree_layout(tree, device, parts=host, recurrent=False)  # one copy to the device for all of these
    places = [tuple(sent[i : i + 3]) if len(sources[i // 3][0]) else None for i in (0, 3)]
    tokens_t, slots_t, sent = sent[6], sent[7], sent[8:]
    layout = replace(layout, history=_history_parts(buckets, sent, continuing, first, reused_n, count))

    cache = turn_cache(model)
    source_layer = kv_sources(model.config.get_text_config(decoder=True))  # Gemma 4: a layer reading another's keys
    storage = _copy_held(cache, held, places, rows, columns)

    def padded(index: int) -> tuple[torch.Tensor, torch.Tensor]:  # (B, Hkv, columns, D) views
        return tuple(x.view(rows, columns, *x.shape[1:]).transpose(1, 2) for x in storage[source_layer[index]])

    def lay_out(index: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if cache.source_dtype is None:  # the keys as the model hands them over (stored narrower, [`ReadDtypeCache`])
            cache.source_dtype = key.dtype
        if index not in storage:  # a layer reading another's keys (the model hands it its source's)
            return
        for target, x in zip(storage[index], (key, value), strict=True):
            target.index_copy_(0, slots_t, x[0].transpose(0, 1).to(target.dtype))

    if count:
        with continuing_with(padded):
            forward_capturing(model, tokens_t, layout, lay_out, set(storage), "continued prefill")
    for index in sorted(storage):
        cache.update(*padded(index), index)
        del storage[index]  # one layer's two copies alive at a time
    return cache, count


def continuable(model: nn.Module, width: int, longest: int) -> bool:
    """Whether a call of `(B, width)` prompts generating up to `longest` tokens can start from continued caches."""
    limit = cache_limit(model)
    return width >= 2 and continue_reason(model) is None and (limit is None or longest <= limit)


class TurnCaches:
    """
    What a tool loop carries between its `generate` calls: the last call's [`HeldCache`], while it fits `budget`
    bytes. Dropped (and every row's keys and values released with it) when the loop ends, and a call's held rows are
    released once the next call has copied what it continues ([`take`]).
    """

    def __init__(self, budget: int):
        self.budget = budget
        self.held: HeldCache | None = None
        self.over_budget = 0  # calls whose caches were not held: they would not fit

    def keep(self, held: HeldCache | None) -> None:
        if held is None:
            return
        if held.nbytes <= self.budget:
            self.held = held
        else:
            self.over_budget += 1

    def take(self) -> HeldCache | None:
        held, self.held = self.held, None
        return held
