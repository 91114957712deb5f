"""
The no-grad log-prob passes (the old policy's, the reference's) replayed from CUDA graphs, where a micro-batch is one
or two rows ([`MAX_ROWS`]). With prompts held across chunks ([`scope`]), such a chunk forwards only its rows' own
tokens over their held prompt's keys: a few milliseconds of device work under the host's launches of a whole forward.
Each chunk's rows are packed in full, their completions' padding included ([`scored_in_full`]: stock's forward
computes those columns too, and they come after every scored token, which attends only to what precedes it), so that
the chunks of a group pack to the same shapes and read the same held keys; the second chunk with a layout seen before
([`signature`]) captures the forward once ([`graphs.capture`]), and each later one copies its tokens, positions and
labels into the captured inputs and replays it ([`GraphedForwards`]).

Trusted as static decoding is: on a model's first captured pass, the first [`CHECKED_REPLAYS`] replays are checked
against the eager forward; a mismatch, or a forward that cannot be captured, runs the eager forward from there on
(for the model's later passes too), with one warning naming why.
"""

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from ..graphs import REPLAY_ATOL, REPLAY_RTOL, capture, warm_up
from ..once import WarnOnce
from .packing import PackedBatch


# Devices on which the small no-grad chunks are captured as graphs (with `graph_scoring_passes`, the default)
CAPTURE_DEVICES = ("cuda",)
# The most rows a replayed chunk holds: more, and a chunk is rarely host-bound, its layouts rarely repeat
MAX_ROWS = 2
# Graphs a pass keeps at once (all in the device's one capture pool, [`graphs.capture_pool`]): past it, all are dropped
# for a new one (with prompts held, all as soon as a prompt one reads is released: [`GraphedForwards.drop`])
MAX_LIVE_GRAPHS = 4
# On a model's first captured pass, this many replays are checked against the eager forward
CHECKED_REPLAYS = 2
_INPUTS = ("input_ids", "position_ids", "shift_labels")  # what differs between the chunks of one layout
_warnings = WarnOnce()  # the process's: a kernel's or the device's reasons


def scored_in_full(rows: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """
    A copy of `rows` ([`tree.rows.row_groups`]) in which each row scores all `logits_to_keep` completion columns: the
    columns past its scored tokens (its padding, or a masked truncated completion's tokens) are packed too, keyed by a
    token no other row has (their tokens are not known to agree). Their log-probs are stock's own values at those
    columns, which TRL's completion mask leaves out as it leaves out stock's.
    """
    table = rows.numpy()
    count = len(table)
    width = max(table.shape[1], 3 + int(table[:, 1].max()) + logits_to_keep)  # (a batch's table: its widest row)
    out = np.full((count, width), 0, dtype=np.int64)
    out[:, : table.shape[1]] = table
    for row in range(count):  # a micro-batch of one or two rows: host work, once per chunk
        plen, scored = int(table[row, 1]), int(table[row, 2])
        out[row, 3 + plen + scored : 3 + plen + logits_to_keep] = -2 - row
    out[:, 2] = logits_to_keep
    return torch.from_numpy(out)


def signature(packed: PackedBatch) -> tuple:
    """What fixes a packed chunk's shapes and layout besides its tokens, positions and labels: its tokens, the held
    sources it reads (and, for a path, the runs of their keys: [`tree.parts.TreeLayout.chain`]), and its tree's
    shape (each node's parent, length and position; the layout's tensors are functions of these)."""
    tree, chain = packed.tree, packed.layout.chain
    return (packed.num_tokens, packed.held_sources, None if chain is None else tuple(chain), tree.parent.tobytes(),
            tree.length.tobytes(), tree.position.tobytes())  # fmt: skip


@dataclasses.dataclass
class _Captured:
    graph: object
    inputs: PackedBatch  # the captured chunk's, whose tensors the graph reads
    outputs: tuple  # (log_probs, entropy or None): the buffers each replay writes


class GraphedForwards:
    """
    A pass's chunks replayed from CUDA graphs where their layouts repeat: `forward(packed)` returns
    `(log_probs, entropy)` of a packed chunk, from `call(**inputs)` (the model) or a replay of it (counted in
    `counts.graph_replays`). A replay's outputs are the graph's own buffers, to be copied before the next `forward` (the
    graphs share a pool: another graph's replay may write there). Graphs live as long as the pass ([`release`] and
    the live limit drop them all at once: [`drop`]).
    """

    def __init__(self, model, device: torch.device, call: Callable, entropy: bool, counts=None):
        self.model, self.device, self.call, self.entropy, self.counts = model, device, call, entropy, counts
        self.graphs: dict[tuple, _Captured] = {}
        self.seen: set[tuple] = set()
        self.checking = CHECKED_REPLAYS if not getattr(model, "_rloo_scoring_graph_checked", False) else 0

    @staticmethod
    def applies(model, device: torch.device) -> bool:
        """Whether a pass on `device` replays its chunks: a device where they are captured, and no capture of the
        model's failed."""
        return device.type in CAPTURE_DEVICES and getattr(model, "_rloo_scoring_graph_failed", None) is None

    def forward(self, packed: PackedBatch) -> tuple:
        if getattr(self.model, "_rloo_scoring_graph_failed", None) is not None:
            return self._eager(packed)
        key = signature(packed)
        captured = self.graphs.get(key)
        if captured is None:
            if key not in self.seen:  # a layout seen once: eager (it may never repeat)
                self.seen.add(key)
                return self._eager(packed)
            return self._capture(key, packed)
        for name in _INPUTS:
            getattr(captured.inputs, name).copy_(getattr(packed, name))
        captured.graph.replay()
        if self.counts is not None:
            self.counts.graph_replays += 1
        if self.checking:
            return self._checked(captured, packed)
        return captured.outputs

    def release(self, held: set) -> None:
        """Once a graph reads a source no longer in `held` (its keys are freed: never replayed again), drops every
        graph ([`drop`])."""
        if any(not set(key[1]) <= held for key in self.graphs):
            self.drop()

    def drop(self) -> None:
        """
        Drops every graph: never one while others live. Recent torch releases' `CUDAGraph.reset` (run when a graph
        dies) frees the cuBLAS workspace of the stream it was captured on (pytorch#193402), and every graph here was
        captured on the device's one side stream ([`graphs.side_stream`]) with that workspace: a live graph's later
        replays would write memory handed to other tensors. (A pass's graphs rarely outlive one another: a group's
        chunks share one layout, so a prompt's release drops its graph alone.)
        """
        self.graphs.clear()

    def _eager(self, packed: PackedBatch) -> tuple:
        outputs = self.call(**packed.model_inputs())
        return outputs.log_probs, outputs.entropy if self.entropy else None

    def _capture(self, key: tuple, packed: PackedBatch) -> tuple:
        """The warm-up (eager: this chunk's result), then the capture (nothing runs): later chunks replay it."""
        step = lambda: self._eager(packed)  # noqa: E731 (the captured step reads this chunk's tensors, kept alive)
        first = warm_up(step, self.device, packed.layout.memo.values)  # (the memo: built in the warm-up, read after)
        try:
            graph, outputs = capture(step, self.device)
        except Exception as error:  # noqa: BLE001 - any failure to capture: the eager forward, exactly
            self._give_up("its forward cannot be captured", f" ({type(error).__name__}: {error})")
            return first
        if len(self.graphs) >= MAX_LIVE_GRAPHS:
            self.drop()
        self.graphs[key] = _Captured(graph, packed, outputs)
        return first

    def _checked(self, captured: _Captured, packed: PackedBatch) -> tuple:
        """A replay's outputs against the eager forward's (the model's first captured pass)."""
        self.checking -= 1
        replayed = tuple(None if value is None else value.clone() for value in captured.outputs)
        eager = self._eager(packed)
        for name, a, b in zip(("log-probs", "entropies"), replayed, eager, strict=True):
            if a is not None and not torch.allclose(a, b, rtol=REPLAY_RTOL, atol=REPLAY_ATOL):
                difference = (a - b).abs().max().item()
                self._give_up("a replay differs from the eager forward", f" by {difference:.3g} ({name})")
                return eager
        if not self.checking:
            self.model._rloo_scoring_graph_checked = True
        return replayed

    def _give_up(self, reason: str, detail: str = "") -> None:
        """The eager forward from here on, and for the model's later passes: one warning per reason in the process
        (the policy's and the reference's passes alike)."""
        self.graphs.clear()
        self.model._rloo_scoring_graph_failed = reason
        _warnings.warn(f"rloo_efficient: the small log-prob chunks run eagerly, not from CUDA graphs: {reason}"
                       f"{detail}.", key=reason, stacklevel=4)  # fmt: skip
