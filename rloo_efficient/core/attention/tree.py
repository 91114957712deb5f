"""
Attention over a packed prefix tree ([`tree.parts.TreeLayout`]): each token attends to its ancestors' tokens and
causally within its own node.

The attention is computed in parts and merged exactly by log-sum-exp (Hydragen, arXiv 2402.05099; ring attention
merges the same way): first every node's own tokens (causal, one fused-kernel call per length bucket), then one part
per tree level, in which each node's tokens are read by its whole subtree below it (one non-causal call per level).
A token at depth `d` merges `d` parts into its own:

    out = lerp(out, out_part, sigmoid(lse_part - lse)),   lse = logaddexp(lse, lse_part)

The merge accumulates in float32 for half precision, as the kernels do. The backward calls each part's kernel backward
with the merged output and log-sum-exp: each part's gradients are then exactly its share of the gradients of attention
over all the keys a token reads, and a node's keys receive the sum of its descendants' gradients. Every part reads and
writes the flat `(N, h, D)` sequence through one gather and one scatter of its blocks, or a view where they are one
run of it (a padding slot reads a real token of its block, writes to a dump row and gets no output gradient, so it
adds nothing to any key's): no `(N, N)` mask exists.

Where a variable-length kernel runs (flash's on CUDA in half precision, [`attention.checks.varlen_config`]) the same
parts need no padding and no blocks: every node's own tokens are one causal call over the flat sequence itself (its
nodes are its sequences, one after another), and each level's part one call whose sequences are each node's subtree
reading the node's tokens, both gathered unpadded ([`tree.parts.Packed`]). The merge and the backward are the same.

Under a sliding window `w` a node's own tokens go through [`attention.windows.band_forward`] (or flash's variable-length
call with its window); a level's part reads only each node's last `w - 1` tokens, masked by the distance of each
query's position to theirs (in padded buckets: the mask depends on each query's position). Attention sinks (GPT-OSS)
are applied once, to the merged output. Gemma's image blocks (an image's tokens attend to each other both ways) apply
to the nodes holding them, on the layers they apply to (in padded buckets, with their mask).
"""

from types import SimpleNamespace

import numpy as np
import torch

from ..tree.parts import Blocks, HeldPart, Part, Rows, TreeLayout
from .checks import (
    attention_backward,
    attention_forward,
    varlen_attention_backward,
    varlen_attention_forward,
    varlen_config,
)
from .windows import apply_sinks, band_backward, band_forward, block_bias, sink_gradient


def _flat(x: torch.Tensor) -> torch.Tensor:
    """`(1, h, N, D)` (token-major, as transformers hands them over) -> `(N, h, D)`, a view."""
    return x[0].transpose(0, 1)


def _gather(x: torch.Tensor, blocks: Blocks, zero_padding: bool = False) -> torch.Tensor:
    """`blocks` of `x` `(N, h, *rest)` as token-major `(n, h, L, *rest)`: a view where they are a run of the flat
    sequence, else gathered (a padding slot holds a real token of its block, or zero with `zero_padding`). A padding
    slot's query only computes an output that goes to the dump row; its output gradient must be zero (then it adds
    nothing to any key's)."""
    if blocks.run is not None:
        picked = x.narrow(0, *blocks.run)
    else:
        picked = x.index_select(0, blocks.gather.view(-1))
        if zero_padding:
            picked.masked_fill_(blocks.padding.view(-1, *([1] * (x.dim() - 1))), 0)
    return picked.view(*blocks.shape, *x.shape[1:]).transpose(1, 2)


def _rows(blocks: torch.Tensor) -> torch.Tensor:
    """Token-major blocks `(n, h, L, *rest)` -> `(n L, h, *rest)`."""
    return blocks.transpose(1, 2).reshape(-1, blocks.shape[1], *blocks.shape[3:])


def _lse_rows(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's log-sum-exp `(n, h, L)` -> `(n L, h)`."""
    return lse.transpose(1, 2).reshape(-1, lse.shape[1]).to(dtype)


def _read(x: torch.Tensor, blocks: Blocks | Rows) -> torch.Tensor:
    """The rows of `x` `(N + 1, ...)` that `blocks` write, flat `(n L, ...)` (the dump row at padding)."""
    return x.narrow(0, *blocks.run) if blocks.run is not None else x.index_select(0, blocks.scatter.view(-1))


def _write(x: torch.Tensor, blocks: Blocks | Rows, rows: torch.Tensor) -> None:
    if blocks.run is not None:
        x.narrow(0, *blocks.run).copy_(rows)
    else:
        x.index_copy_(0, blocks.scatter.view(-1), rows)


def _add(x: torch.Tensor, blocks: Blocks | Rows, rows: torch.Tensor) -> None:
    if blocks.run is not None:
        x.narrow(0, *blocks.run).add_(rows)
    else:
        x.index_add_(0, blocks.scatter.view(-1), rows)


def _merge(out: torch.Tensor, lse: torch.Tensor, queries: Blocks, out_part: torch.Tensor,
           lse_part: torch.Tensor) -> None:  # fmt: skip
    """Merges a part's output and log-sum-exp (a kernel's, `(n, h, L, D)` and `(n, h, L)`) into the flat `out`
    `(N + 1, h, D)` and `lse` `(N + 1, h)` at its `queries`, by log-sum-exp."""
    _merge_rows(out, lse, queries, _rows(out_part), _lse_rows(lse_part, lse.dtype))


def _merge_rows(out: torch.Tensor, lse: torch.Tensor, queries: Blocks | Rows, out_part: torch.Tensor,
                lse_part: torch.Tensor) -> None:  # fmt: skip
    """[`_merge`] of a part's flat rows: output `(n L, h, D)`, log-sum-exp `(n L, h)`."""
    lse_part = lse_part.to(lse.dtype)
    current = _read(lse, queries)
    weight = torch.sigmoid(lse_part - current).unsqueeze(-1).to(out.dtype)
    merged = torch.lerp(_read(out, queries), out_part.to(out.dtype), weight)  # new tensors: then written
    _write(lse, queries, torch.logaddexp(current, lse_part))
    _write(out, queries, merged)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _keys_of(layout: TreeLayout, index, part: Part | HeldPart, window: int | None,
             dtype) -> tuple[Blocks, torch.Tensor | None]:  # fmt: skip
    """A level's keys (`Blocks`) and bias: each node's tokens, masked where it is shorter than the longest; under a
    `window` shorter than the rows, each node's last `T = min(w - 1, Kmax)` tokens, masked per query where they are out
    of its window (or before the node). Built once per batch for every layer alike. A held part's keys are in its
    slot's flat sequence."""
    memo_key = ("part", index, window, dtype)
    if memo_key in layout.memo:
        return layout.memo[memo_key]
    minimum = torch.finfo(dtype).min
    if window is None:
        bias = None
        if part.padded_keys:
            bias = torch.zeros((), dtype=dtype, device=part.key_length.device).masked_fill(
                part.keys.padding, minimum)[:, None, None, :]  # fmt: skip
        layout.memo[memo_key] = (part.keys, bias)
        return layout.memo[memo_key]
    nodes, width = part.keys.shape
    tail = max(1, min(window - 1, width))  # a window of 1 reads no earlier key: one key, masked
    device = part.key_length.device
    slot = part.key_length[:, None] - tail + torch.arange(tail, device=device)  # (A, T) slots of the key blocks
    valid = slot >= 0
    slot = slot.clamp(min=0)
    dump = part.tokens if isinstance(part, HeldPart) else layout.tokens
    scatter = torch.where(valid, part.keys.scatter.gather(1, slot), dump)
    keys = Blocks(part.keys.gather.gather(1, slot), scatter, ~valid, part.keys.run if tail == width else None)
    key_position = part.key_end_position[:, None] - (tail - 1) + torch.arange(tail, device=device)  # (A, T)
    query_position = layout.positions.index_select(0, part.queries.gather.view(-1)).view(part.queries.shape)
    allowed = valid[:, None, :] & (query_position[:, :, None] - key_position[:, None, :] < window)
    bias = torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, minimum)[:, None]  # (A, 1, Qmax, T)
    layout.memo[memo_key] = (keys, bias)
    return layout.memo[memo_key]


def _image_bias(layout: TreeLayout, index: int, blocks: Blocks, window: int | None, sliding: bool, dtype):
    """The `(n, 1, L, L)` bias of an image bucket where its image tokens attend to each other both ways on this layer,
    or None where its nodes attend causally."""
    if layout.token_blocks is None or (layout.blocks_on == "sliding" and not sliding):
        return None
    memo_key = ("image blocks", index, window, dtype)
    if memo_key not in layout.memo:
        ids = layout.token_blocks.index_select(0, blocks.gather.view(-1)).view(blocks.shape)
        layout.memo[memo_key] = block_bias(ids.masked_fill(blocks.padding, -1), window, dtype)
    return layout.memo[memo_key]


def _buckets(layout: TreeLayout):
    """`(index, blocks, is an image bucket)` of every self-attention call."""
    for index, blocks in enumerate(layout.buckets):
        yield index, blocks, False
    for index, blocks in enumerate(layout.image_buckets):
        yield index, blocks, True


def _run_of(x: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return x if first == 0 and count == x.shape[0] else x.narrow(0, first, count)


def _held_keys(fold, own: torch.Tensor, held) -> torch.Tensor:
    """The keys (or values) of a folded nodes' call: each node's held ancestors', its ancestors' in the tree, then its
    own, from the flat `own` `(N, Hkv, D)` and the slots' `held` `(1, Hkv, Ns, D)`: its runs joined (one row's: its
    held prompt, then itself), or gathered."""
    if fold.pieces is not None:
        sources = [_flat(x) for x in held]
        runs = [_run_of(own if source < 0 else sources[source], first, count) for source, first, count in fold.pieces]
        return runs[0] if len(runs) == 1 else torch.cat(runs)
    return torch.cat([own, *(_flat(x) for x in held)]).index_select(0, fold.keys.scatter)


def _token_major(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A flat `(N, h, D)` gradient as `like`'s `(1, h, N, D)`, in its dtype."""
    return x.to(like.dtype).transpose(0, 1).unsqueeze(0)


def _nodes_alone(layout: TreeLayout, held: tuple) -> bool:
    """Whether the nodes' own causal call is all of a layer's attention: no node reads another's keys (a single
    node per row, a source's prompts), held or in the tree."""
    return not (layout.parts or layout.packed_parts or layout.held_parts or layout.history or held)


def _scatter_held_keys(fold, tokens: int, held: list, gathered: torch.Tensor, dtype) -> list[torch.Tensor]:
    """The gradient of [`_held_keys`]'s gathered keys `(K, Hkv, D)`, summed back (in `dtype`) to the flat sequence's
    `(N, Hkv, D)` and each slot's `(Ns, Hkv, D)` (`held`: the slots' keys, flat): `[own, *slots]`. From the runs
    (`fold.pieces`): a tensor read whole by each of its runs gets their sum (by one: its gradient itself, a view), one
    read in runs one after another their gradients joined, any other the runs added into zeros."""
    sizes = [tokens, *(x.shape[0] for x in held)]
    if fold.pieces is None:
        every = gathered.new_zeros(sum(sizes), *gathered.shape[1:], dtype=dtype)
        every.index_add_(0, fold.keys.scatter, gathered.to(dtype))
        return list(every.split(sizes))
    grads = gathered.split([count for _, _, count in fold.pieces])
    out = []
    for source, size in enumerate(sizes, start=-1):
        runs = sorted(((first, count, grad) for (of, first, count), grad in zip(fold.pieces, grads, strict=True)
                       if of == source), key=lambda run: run[:2])  # fmt: skip
        if runs and all(run[:2] == (0, size) for run in runs):  # each run all of it: their sum (one: itself, a view)
            total = runs[0][2]
            for _, _, grad in runs[1:]:
                total = total.to(dtype) + grad
            out.append(total)
        elif [first for first, _, _ in runs] == list(np.cumsum([0, *(count for _, count, _ in runs)])[:-1]) and (
                sum(count for _, count, _ in runs) == size):  # runs one after another: joined  # fmt: skip
            out.append(torch.cat([grad for _, _, grad in runs]))
        else:
            total = gathered.new_zeros(size, *gathered.shape[1:], dtype=dtype)
            for first, count, grad in runs:
                total.narrow(0, first, count).add_(grad)
            out.append(total)
    return out


def _chain_keys(layout: TreeLayout, key: torch.Tensor, held) -> torch.Tensor:
    """A path's keys (or values) `(1, Hkv, T + N, D)`: the held runs it reads, then its own `key` `(1, Hkv, N, D)`."""
    if not layout.chain:
        return key
    runs = [x if first == 0 and count == x.shape[2] else x.narrow(2, first, count)
            for x, first, count in ((held[slot], first, count) for slot, first, count in layout.chain)]  # fmt: skip
    return torch.cat([*runs, key], dim=2)


def _chain_bias(layout: TreeLayout, held_tokens: int, window: int | None, dtype, device) -> torch.Tensor:
    """The `(1, 1, N, T + N)` bias of a path's queries over [its `held_tokens` held keys | its own]: causal aligned at
    the last query and key (query `i` reads keys up to `T + i`), within a `window`. Built once per forward."""
    memo_key = ("chain", window, dtype)
    if memo_key not in layout.memo:
        query = torch.arange(held_tokens, held_tokens + layout.tokens, device=device)[:, None]
        key = torch.arange(held_tokens + layout.tokens, device=device)[None, :]
        allowed = key <= query
        if window is not None:
            allowed &= query - key < window
        layout.memo[memo_key] = torch.zeros((), dtype=dtype, device=device).masked_fill(
            ~allowed, torch.finfo(dtype).min)[None, None]  # fmt: skip
    return layout.memo[memo_key]


def _chain_forward(query, key, value, layout: TreeLayout, window: int | None, scale: float, held):
    """`(out, lse, state)` `(1, H, N, D)`, `(1, H, N)` of a path ([`TreeLayout.chain`]) in one call: as stock's
    attention of its row, with no gather, scatter or merge (a few operators where the buckets and parts take dozens
    per layer, each a launch on a GPU)."""
    if not layout.chain:
        return band_forward(query, key, value, window, scale)
    held_tokens = sum(count for _, _, count in layout.chain)
    bias = _chain_bias(layout, held_tokens, window, query.dtype, query.device)
    return attention_forward(query, _chain_keys(layout, key, held[0::2]), _chain_keys(layout, value, held[1::2]),
                             bias, False, scale)  # fmt: skip


def _chain_backward(ctx, grad_out):
    """[`TreeAttention.backward`] of [`_chain_forward`]: the call's kernel backward, its keys' gradients split back
    into the held runs' (summed into each slot's) and the path's own."""
    query, key, value, out, lse, *held = ctx.saved_tensors
    layout, window, scale = ctx.layout, ctx.window, ctx.scale
    grad = grad_out.transpose(1, 2)  # (1, H, N, D)
    if not layout.chain:
        dq, dk, dv = band_backward(ctx.states[0], grad, query, key, value, out, lse, window, scale)
        return dq, dk, dv, *(None,) * 6
    keys, values = _chain_keys(layout, key, held[0::2]), _chain_keys(layout, value, held[1::2])
    held_tokens = keys.shape[2] - key.shape[2]
    bias = _chain_bias(layout, held_tokens, window, query.dtype, query.device)
    dq, dkeys, dvalues = attention_backward(ctx.states[0], grad, query, keys, values, bias, out, lse, False, scale)
    counts = [count for _, _, count in layout.chain]
    grads, owns = [None] * len(held), []
    for parity, gathered in enumerate((dkeys, dvalues)):  # keys, then values
        *runs, own = gathered.split([*counts, key.shape[2]], dim=2)
        owns.append(own)
        for (slot, first, count), run in zip(layout.chain, runs, strict=True):
            index = 2 * slot + parity
            if not ctx.needs_input_grad[9 + index]:
                continue
            if first == 0 and count == held[index].shape[2]:  # the slot read whole: its gradient is the run's
                grads[index] = run if grads[index] is None else grads[index] + run
            else:
                total = held[index].new_zeros(held[index].shape) if grads[index] is None else grads[index].clone()
                total.narrow(2, first, count).add_(run)
                grads[index] = total
    return dq, *owns, None, None, None, None, None, None, *grads


def _chain_applies(layout: TreeLayout, sinks, history) -> bool:
    """Whether a forward is one call over a path ([`_chain_forward`]): its tree is one (no image blocks, no continued
    prefill's rows, no sinks to apply to a merged output); a path reading held keys where the variable-length kernel
    folds them ([`TreeLayout.held_nodes`]: flash's causal call, where the path's would need a bias) folds them
    there."""
    return (layout.chain is not None and sinks is None and not history and layout.token_blocks is None
            and not (layout.chain and layout.held_nodes is not None))  # fmt: skip


def _varlen_nodes(layout: TreeLayout, q, k, v, window: int | None, scale: float, held) -> tuple:
    """`(packed_nodes, folded)`: on a device with a variable-length kernel ([`attention.checks.varlen_config`]), the
    nodes' call (`(out, lse, state)`, or None where its kernel is not used or raised: the buckets run instead), folded
    where it reads each node's ancestors' keys too, held and in the tree ([`tree.parts.TreeLayout.held_nodes`])."""
    packed_nodes = None
    fold = layout.held_nodes if not layout.history else None
    if fold is not None:
        fold_window = window if window is not None and fold.max_k > window else None
        fold_config = varlen_config(q, k, True, fold_window)
        if fold_config is not None:
            keys, values = _held_keys(fold, k, held[0::2]), _held_keys(fold, v, held[1::2])
            packed_nodes = varlen_attention_forward(fold_config, q, keys, values, fold.cu_q, fold.cu_k, fold.max_q,
                                                    fold.max_k, True, scale, fold_window)  # fmt: skip
            if packed_nodes is not None:
                return packed_nodes, True
    # (after the folded call: a kernel that raised there is disabled here too)
    nodes = layout.packed_nodes
    node_window = window if window is not None and nodes is not None and nodes.max_q > window else None
    nodes_config = varlen_config(q, k, True, node_window) if nodes is not None else None
    if nodes_config is not None:
        packed_nodes = varlen_attention_forward(nodes_config, q, k, v, nodes.cu_q, nodes.cu_k, nodes.max_q,
                                                nodes.max_k, True, scale, node_window)  # fmt: skip
    return packed_nodes, False


def _own_tokens(layout: TreeLayout, q, k, v, packed_nodes, window: int | None, sliding: bool, scale: float, dtype):
    """`(out, lse, states)`: the flat `(N + 1, H, D)` output and `(N + 1, H)` log-sum-exp of every node's own tokens
    (the nodes' variable-length call, else one call per length bucket), in float32 for half precision, with the
    kernels' states."""
    tokens, heads, dim = q.shape
    work = _work_dtype(dtype)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    # Every token is in one node and every node in one bucket: the buckets write every row but the last, where
    # padding slots write (and read back what they wrote there), so nothing needs zeroing
    out = q.new_empty(tokens + 1, heads, dim, dtype=work)
    lse = q.new_empty(tokens + 1, heads, dtype=lse_dtype)
    states = []
    if packed_nodes is not None:
        out_n, lse_n, state = packed_nodes
        states.append(state)
        out[:tokens].copy_(out_n)
        lse[:tokens].copy_(lse_n.t())
        out[tokens:].zero_()  # the dump row (the buckets would have written it), read by a windowed part's padding
        lse[tokens:].zero_()
        return out, lse, states
    for index, blocks, images in _buckets(layout):
        qb, kb, vb = _gather(q, blocks), _gather(k, blocks), _gather(v, blocks)
        bias = _image_bias(layout, index, blocks, window, sliding, dtype) if images else None
        if bias is None:
            out_b, lse_b, state = band_forward(qb, kb, vb, window, scale)
        else:
            out_b, lse_b, state = attention_forward(qb, kb, vb, bias, False, scale)
        states.append(state)
        _write(out, blocks, _rows(out_b).to(work))
        _write(lse, blocks, _lse_rows(lse_b, lse_dtype))
    return out, lse, states


def _merge_packed_parts(out, lse, states: list, layout: TreeLayout, q, k, v, window: int | None, scale: float) -> set:
    """Merges each level's part as one variable-length call where its kernel runs (not under a window: a level's mask
    then depends on each query's position); returns the levels it merged (a kernel that raised: none after it)."""
    parts = layout.packed_parts
    config = varlen_config(q, k, False) if parts and window is None else None
    depths = set()
    for call in parts if config is not None else ():
        packed = varlen_attention_forward(config, _read(q, call.queries), _read(k, call.keys), _read(v, call.keys),
                                          call.cu_q, call.cu_k, call.max_q, call.max_k, False, scale)  # fmt: skip
        if packed is None:  # its kernel raised (now disabled): this level and the next in their buckets
            break
        out_p, lse_p, state = packed
        states.append(state)
        _merge_rows(out, lse, call.queries, out_p, lse_p.t())
        depths.add(call.depth)
    return depths


def _merge_parts(out, lse, states: list, layout: TreeLayout, q, k, v, packed_depths: set, window: int | None,
                 scale: float, dtype) -> None:  # fmt: skip
    """Merges each level's part not merged as a variable-length call, in its padded buckets."""
    for index, part in enumerate(layout.parts):
        if part.depth in packed_depths:
            continue
        keys, bias = _keys_of(layout, index, part, window, dtype)
        out_p, lse_p, state = attention_forward(_gather(q, part.queries), _gather(k, keys), _gather(v, keys), bias,
                                                False, scale)  # fmt: skip
        states.append(state)
        _merge(out, lse, part.queries, out_p, lse_p)


def _merge_held_parts(out, lse, states: list, layout: TreeLayout, q, held, window: int | None, scale: float,
                      dtype) -> None:  # fmt: skip
    """Merges the held nodes' parts, their keys in their slot's `held` `(1, Hkv, Ns, D)` tensors."""
    for index, part in enumerate(layout.held_parts):
        held_key, held_value = _flat(held[2 * part.slot]), _flat(held[2 * part.slot + 1])
        keys, bias = _keys_of(layout, ("held", index), part, window, dtype)
        out_p, lse_p, state = attention_forward(_gather(q, part.queries), _gather(held_key, keys),
                                                _gather(held_value, keys), bias, False, scale)  # fmt: skip
        states.append(state)
        _merge(out, lse, part.queries, out_p, lse_p)


def _merge_history(out, lse, layout: TreeLayout, q, history, window: int | None, scale: float, dtype) -> None:
    """Merges a continued prefill's reads of each row's held keys `history` `(B, Hkv, T, D)` (no gradient)."""
    for index, part in enumerate(layout.history):  # each row's held keys in its columns
        lo, hi = part.span
        if window is not None:  # the queries follow every held key: only the last w - 1 columns are in reach
            lo = max(lo, part.first_end - (window - 1))
        memo_key = ("history", index, window, dtype)
        if memo_key not in layout.memo:
            column = torch.arange(lo, hi, device=q.device)
            held = (column >= part.first[:, None]) & (column < (part.first + part.count)[:, None])  # (n, S)
            held = held[:, None, :]
            if window is not None:  # each query reads the held keys within its window: positions > p - w
                key_position = column - part.first[:, None]  # a row's token p sits at column first + p
                query_position = layout.positions.index_select(0, part.queries.gather.view(-1)).view(
                    part.queries.shape)  # fmt: skip
                held = held & (query_position[:, :, None] - key_position[:, None, :] < window)  # (n, L, S)
            layout.memo[memo_key] = torch.zeros((), dtype=dtype, device=q.device).masked_fill(
                ~held, torch.finfo(dtype).min)[:, None]  # fmt: skip
        held_key, held_value = (x[:, :, lo:hi].index_select(0, part.rows) for x in history)
        out_h, lse_h, _ = attention_forward(_gather(q, part.queries), held_key, held_value, layout.memo[memo_key],
                                            False, scale)  # fmt: skip
        _merge(out, lse, part.queries, out_h, lse_h)


def _folded_backward(ctx, saved: tuple, state, grad, q, k, v, flats: list, grad_sinks, work) -> tuple:
    """[`TreeAttention.backward`] of the folded nodes' call ([`_varlen_nodes`]), a layer's only call: its keys'
    gradients summed back to both the flat sequence's and each held slot's (`flats`, `(Ns, Hkv, D)`)."""
    query, key, value, _, out, lse, *held = saved
    fold, tokens = ctx.layout.held_nodes, query.shape[2]
    keys, values = _held_keys(fold, k, held[0::2]), _held_keys(fold, v, held[1::2])
    dq, dk, dv = varlen_attention_backward(state, grad, q, keys, values, out, lse.t(), True, ctx.scale)
    grad_k, *slot_k = _scatter_held_keys(fold, tokens, flats[0::2], dk, work)
    grad_v, *slot_v = _scatter_held_keys(fold, tokens, flats[1::2], dv, work)
    held_grads = [g if needed else None for g, needed in zip(
        (x for pair in zip(slot_k, slot_v, strict=True) for x in pair), ctx.needs_input_grad[9:])]  # fmt: skip
    return (_token_major(dq, query), _token_major(grad_k, key), _token_major(grad_v, value), grad_sinks, None,
            None, None, None, None, *(None if g is None else _token_major(g, x)
                                      for g, x in zip(held_grads, held, strict=True)))  # fmt: skip


def _scored(blocks: Blocks, grad, q, out, lse) -> tuple:
    """The queries' side of a backward call at `blocks`, token-major: `(q, grad, out, lse)`, with no output gradient
    at the padding slots."""
    grad_blocks = _gather(grad, blocks, zero_padding=True)
    return _gather(q, blocks), grad_blocks, _gather(out, blocks), _gather(lse, blocks)


def _add_blocks(target: torch.Tensor, blocks: Blocks, value: torch.Tensor) -> None:
    """Adds a kernel's token-major gradient `(n, h, L, D)` of `blocks` into the flat `target` `(N + 1, h, D)`."""
    _add(target, blocks, _rows(value).to(target.dtype))


def _own_tokens_backward(ctx, states, packed_nodes: bool, grad, q, k, v, out, lse, grads: tuple, dtype) -> None:
    """[`_own_tokens`]'s backward: adds the gradients of every node's own tokens (the nodes' variable-length call,
    else one call per length bucket) into `grads`, the flat `(N + 1, h, D)` `(grad_q, grad_k, grad_v)`."""
    if packed_nodes:  # the nodes' one causal call: the flat sequence itself
        tokens = q.shape[0]
        lse_heads = lse.t()  # (H, N), as flash's
        node_grads = varlen_attention_backward(next(states), grad, q, k, v, out, lse_heads, True, ctx.scale)
        for target, value in zip(grads, node_grads, strict=True):
            target[:tokens].add_(value)
        return
    for index, blocks, images in _buckets(ctx.layout):
        qb, gb, ob, lb = _scored(blocks, grad, q, out, lse)
        kb, vb = _gather(k, blocks), _gather(v, blocks)
        state = next(states)
        bias = _image_bias(ctx.layout, index, blocks, ctx.window, ctx.sliding, dtype) if images else None
        if bias is None:
            bucket_grads = band_backward(state, gb, qb, kb, vb, ob, lb, ctx.window, ctx.scale)
        else:
            bucket_grads = attention_backward(state, gb, qb, kb, vb, bias, ob, lb, False, ctx.scale)
        for target, value in zip(grads, bucket_grads, strict=True):
            _add_blocks(target, blocks, value)


def _packed_parts_backward(ctx, states, packed_depths: set, grad, q, k, v, out, lse, grads: tuple) -> None:
    """[`_merge_packed_parts`]'s backward: adds the gradients of each level's variable-length call into `grads`."""
    grad_q, grad_k, grad_v = grads
    for call in (call for call in ctx.layout.packed_parts if call.depth in packed_depths):
        rows = lambda x: _read(x, call.queries)  # noqa: E731
        keys, values = _read(k, call.keys), _read(v, call.keys)
        dq, dk, dv = varlen_attention_backward(next(states), rows(grad), rows(q), keys, values, rows(out),
                                               rows(lse).t(), False, ctx.scale)  # fmt: skip
        _add(grad_q, call.queries, dq.to(grad_q.dtype))
        _add(grad_k, call.keys, dk.to(grad_k.dtype))
        _add(grad_v, call.keys, dv.to(grad_v.dtype))


def _parts_backward(ctx, states, packed_depths: set, grad, q, k, v, out, lse, grads: tuple, dtype) -> None:
    """[`_merge_parts`]'s backward: adds the gradients of each level's part in its padded buckets into `grads`."""
    layout, grad_q, grad_k, grad_v = ctx.layout, *grads
    for index, part in enumerate(layout.parts):
        if part.depth in packed_depths:
            continue
        keys, bias = _keys_of(layout, index, part, ctx.window, dtype)
        qp, gp, op, lp = _scored(part.queries, grad, q, out, lse)
        dq, dk, dv = attention_backward(next(states), gp, qp, _gather(k, keys), _gather(v, keys), bias, op, lp,
                                        False, ctx.scale)  # fmt: skip
        _add_blocks(grad_q, part.queries, dq)
        _add_blocks(grad_k, keys, dk)
        _add_blocks(grad_v, keys, dv)


def _held_parts_backward(ctx, states, grad, q, out, lse, flats: list, grad_q, grad_held: list, dtype) -> None:
    """[`_merge_held_parts`]'s backward: adds the held parts' query gradients into `grad_q` and their keys' into
    their slot's `grad_held` (those that need one)."""
    layout = ctx.layout
    for index, part in enumerate(layout.held_parts):
        held_key, held_value = flats[2 * part.slot], flats[2 * part.slot + 1]
        keys, bias = _keys_of(layout, ("held", index), part, ctx.window, dtype)
        qp, gp, op, lp = _scored(part.queries, grad, q, out, lse)
        dq, dk, dv = attention_backward(next(states), gp, qp, _gather(held_key, keys), _gather(held_value, keys),
                                        bias, op, lp, False, ctx.scale)  # fmt: skip
        _add_blocks(grad_q, part.queries, dq)
        for target, grad_part in ((grad_held[2 * part.slot], dk), (grad_held[2 * part.slot + 1], dv)):
            if target is not None:
                _add_blocks(target, keys, grad_part)


class TreeAttention(torch.autograd.Function):
    """
    Attention of the packed flat sequence (see the module docstring): `query` (1, H, N, D), `key`/`value`
    (1, Hkv, N, D), token-major; `sinks` (H,) or None; `window` a sliding window (keys in (p - w, p]) or None.
    Returns `(1, N, H, D)`. One autograd node per layer; its backward is the kernels' backward.
    """

    @staticmethod
    def forward(ctx, query, key, value, sinks, layout: TreeLayout, window: int | None, scale: float,
                sliding: bool = False, history: tuple | None = None, *held):  # fmt: skip
        if _chain_applies(layout, sinks, history):
            out, lse, state = _chain_forward(query, key, value, layout, window, scale, held)
            if any(ctx.needs_input_grad[:4]) or any(ctx.needs_input_grad[9:]):
                ctx.save_for_backward(query, key, value, out, lse, *held)
            ctx.layout, ctx.window, ctx.scale, ctx.states, ctx.packed = layout, window, scale, [state], "chain"
            return out.transpose(1, 2)  # (1, N, H, D)
        tokens = query.shape[2]
        q, k, v = _flat(query), _flat(key), _flat(value)
        packed_nodes, folded = _varlen_nodes(layout, q, k, v, window, scale, held)
        if packed_nodes is not None and sinks is None and (folded or _nodes_alone(layout, held)):
            # The one call (folded: every ancestor's keys in it; else nodes that read no other's): the attention
            out_n, lse_n, state = packed_nodes
            result, lse = out_n, lse_n.t()  # (N, H, D) in the query's dtype; (N, H) float32, a view of flash's
            if any(ctx.needs_input_grad[:4]) or any(ctx.needs_input_grad[9:]):
                ctx.save_for_backward(query, key, value, sinks, result, lse, *held)
            ctx.layout, ctx.window, ctx.scale, ctx.states, ctx.sliding = layout, window, scale, [state], sliding
            ctx.packed = (True, set(), folded)
            return result.unsqueeze(0)
        out, lse, states = _own_tokens(layout, q, k, v, packed_nodes, window, sliding, scale, query.dtype)
        packed_depths = set()  # the levels whose part ran as one variable-length call; the others in their buckets
        if not folded:
            packed_depths = _merge_packed_parts(out, lse, states, layout, q, k, v, window, scale)
            _merge_parts(out, lse, states, layout, q, k, v, packed_depths, window, scale, query.dtype)
            _merge_held_parts(out, lse, states, layout, q, held, window, scale, query.dtype)
        _merge_history(out, lse, layout, q, history, window, scale, query.dtype)
        out, lse = out[:tokens], lse[:tokens]
        if sinks is not None:
            apply_sinks(out.transpose(0, 1).unsqueeze(0), lse.transpose(0, 1).unsqueeze(0), sinks)
        result = out.to(query.dtype)
        if any(ctx.needs_input_grad[:4]) or any(ctx.needs_input_grad[9:]):
            ctx.save_for_backward(query, key, value, sinks, result, lse, *held)
        # Nothing the size of the sequence outside save_for_backward, or gradient checkpointing could not free it
        ctx.layout, ctx.window, ctx.scale, ctx.states, ctx.sliding = layout, window, scale, states, sliding
        ctx.packed = (packed_nodes is not None, packed_depths, folded)
        return result.unsqueeze(0)  # (1, N, H, D), token-major as transformers' attention functions return

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.packed == "chain":
            return _chain_backward(ctx, grad_out)
        saved = ctx.saved_tensors  # (unpacked once: gradient checkpointing's recomputation allows no second)
        query, key, value, sinks, out, lse, *held = saved
        layout, scale = ctx.layout, ctx.scale
        tokens, heads, dim = query.shape[2], query.shape[1], query.shape[3]
        q, k, v, grad = _flat(query), _flat(key), _flat(value), grad_out[0]
        work = _work_dtype(query.dtype)
        grad_sinks = None
        if ctx.needs_input_grad[3]:  # not for frozen sinks (a PEFT policy's)
            grad_sinks = sink_gradient(grad.transpose(0, 1).unsqueeze(0), out.transpose(0, 1).unsqueeze(0),
                                       lse.transpose(0, 1).unsqueeze(0), sinks)  # fmt: skip
        states = iter(ctx.states)
        packed_nodes, packed_depths, folded = ctx.packed
        flats = [_flat(x) for x in held]
        if folded:  # the nodes' call over [held keys | own keys], the only call
            return _folded_backward(ctx, saved, next(states), grad, q, k, v, flats, grad_sinks, work)
        if packed_nodes and _nodes_alone(layout, held):  # the nodes' call alone, over the flat sequence itself
            dq, dk, dv = varlen_attention_backward(next(states), grad, q, k, v, out, lse.t(), True, scale)
            return _token_major(dq, query), _token_major(dk, key), _token_major(dv, value), grad_sinks, *(None,) * 5
        grad_q = q.new_zeros(tokens + 1, heads, dim, dtype=work)
        grad_k = k.new_zeros(tokens + 1, *k.shape[1:], dtype=work)
        grad_v = v.new_zeros(tokens + 1, *v.shape[1:], dtype=work)
        grad_held = [x.new_zeros(x.shape[0] + 1, *x.shape[1:], dtype=work) if ctx.needs_input_grad[9 + i] else None
                     for i, x in enumerate(flats)]  # fmt: skip
        grads = (grad_q, grad_k, grad_v)
        _own_tokens_backward(ctx, states, packed_nodes, grad, q, k, v, out, lse, grads, query.dtype)
        _packed_parts_backward(ctx, states, packed_depths, grad, q, k, v, out, lse, grads)
        _parts_backward(ctx, states, packed_depths, grad, q, k, v, out, lse, grads, query.dtype)
        _held_parts_backward(ctx, states, grad, q, out, lse, flats, grad_q, grad_held, query.dtype)
        token_major = lambda x, like: _token_major(x[: like.shape[2]], like)  # noqa: E731 (less the dump row)
        return (token_major(grad_q, query), token_major(grad_k, key), token_major(grad_v, value), grad_sinks, None,
                None, None, None, None,
                *(None if g is None else token_major(g, x) for g, x in zip(grad_held, held, strict=True)))  # fmt: skip


def tree_attention(query, key, value, sinks, layout: TreeLayout, window: int | None, scale: float,
                   sliding: bool = False, history: tuple | None = None, *held) -> torch.Tensor:  # fmt: skip
    """[`TreeAttention`]; where nothing needs a gradient (a no-grad pass) its forward alone, without an autograd node,
    which is host time per layer and forward where a GPU waits on the host (small micro-batches)."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (query, key, value, sinks, *held)):
        return TreeAttention.apply(query, key, value, sinks, layout, window, scale, sliding, history, *held)
    return TreeAttention.forward(SimpleNamespace(needs_input_grad=()), query, key, value, sinks, layout, window, scale,
                                 sliding, history, *held)  # fmt: skip
