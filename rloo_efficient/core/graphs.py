"""
CUDA graphs: a step warmed up on a side stream ([`warm_up`]) and captured once ([`capture`]), then replayed, one launch
for the whole step. Used by static decoding ([`generation.static_decode`]) and the no-grad log-prob passes
([`forward.graphed`]). A graph replays the kernels it captured over the same addresses: its inputs are copied into the
captured step's buffers, its outputs read from the buffers it wrote.
"""

from collections.abc import Callable, Iterable

import torch
from torch.utils import _pytree as pytree


# A replay checked against the eager step: the same kernels on the same inputs, equal but for a kernel's
# nondeterministic order
REPLAY_RTOL, REPLAY_ATOL = 1e-3, 1e-3

# Each device's side stream, made once ([`side_stream`])
_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}
# Each device's memory pool for every capture there ([`capture_pool`]), until [`release_pools`]
_POOLS: dict[int, "torch.cuda.MemPool"] = {}


def _index(device: torch.device) -> int:
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """
    The one side stream on `device` on which every warm-up and capture runs. The caching allocator hands a freed block
    only to later work on the stream that freed it, and a new `torch.cuda.Stream` is the next of a pool of 32: a
    fresh side stream per warm-up would leave each warm-up's freed memory reserved for a stream that may not come
    round again for 31 more (PyTorch's own `torch.cuda.graph` keeps one default capture stream too).
    """
    index = _index(device)
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return stream


def capture_pool(device: torch.device) -> tuple[int, int]:
    """
    The id of the one memory pool on `device` that every capture there allocates from (static decoding's and the
    scoring passes'), until [`release_pools`] (`torch.cuda.MemPool`: in every torch release we support, 2.9 on).

    A capture given no pool gets a private one, whose blocks no later capture reuses: it stays reserved after its graph
    dies, until `empty_cache()` or an allocation that would otherwise fail releases it, so each step's decoding and
    scoring graphs reserved memory anew (on an H200 at one row per micro-batch, ours reserved 1.38x stock's). In one
    pool a capture reuses the blocks dead graphs freed, and those a live graph freed after its own capture (its
    intermediates, which each of its replays writes before it reads them). Safe for the graphs here, because:
    - replays run one at a time, on the current stream;
    - what a replay reads that it did not write itself was made outside the pool: its inputs, buffers, masks and cached
      keys (before its capture, or in its warm-up);
    - each replay's outputs (which may lie where a graph captured earlier keeps its intermediates) are copied before
      another graph replays: static decoding clones its logits, a scoring chunk's log-probs are unpacked into new
      tensors.
    The pool is held by a `torch.cuda.MemPool`, so that it lives between the captures of a step: a pool whose graphs
    have all died cannot be captured into again (c10's `use_count > 0` assert).
    """
    index = _index(device)
    pool = _POOLS.get(index)
    if pool is None:
        with torch.cuda.device(index):  # a pool is made on the current device
            pool = _POOLS[index] = torch.cuda.MemPool()
    return pool.id


def release_pools() -> None:
    """
    Lets go of every device's capture pool; the next capture makes a new one. Where no graph in it is alive (the
    trainer calls this once a step's generation and scoring passes are done, before training), `MemPool`'s destructor
    returns its blocks to the device at once; otherwise they are released once its last graph dies, by the next
    `empty_cache()` or an allocation that would otherwise fail.
    """
    _POOLS.clear()


def warm_up(step, device: torch.device, buffers: Callable[[], Iterable] | None = None) -> object:
    """Runs `step()` once on the device's side stream ([`side_stream`]): what capture needs first (lazily initialized
    kernels and workspaces). Returns its output. The tensors the step allocated there that the current stream reads
    next (its output's, and `buffers()`, read after the step: a kept-once cache's own keys, a layout's memoized bias)
    are marked as used by the current stream, so that their memory is not handed to other work before it is done
    with them."""
    current = torch.cuda.current_stream(device)
    stream = side_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        output = step()
    current.wait_stream(stream)
    kept = [*pytree.tree_leaves(output), *(pytree.tree_leaves(list(buffers())) if buffers is not None else ())]
    for tensor in kept:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
            tensor.record_stream(current)
    return output


def capture(step, device: torch.device) -> tuple["torch.cuda.CUDAGraph", object]:
    """
    `step` captured as a CUDA graph on the device's side stream ([`side_stream`]) into the device's pool
    ([`capture_pool`]), not run: `(graph, its output)`; each `graph.replay()` runs the step again over the same
    buffers and writes its output there.
    `CUDAGraph.capture_begin` and `capture_end` directly: `torch.cuda.graph` would also synchronize and empty the
    allocator's cache at every capture (on an H200 a `generate` right after `empty_cache()` took 1.13-1.16x the time).
    Errors only for this thread's unsafe calls (`thread_local`): another thread's work does not fail the capture.
    """
    current = torch.cuda.current_stream(device)
    stream = side_stream(device)
    stream.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=capture_pool(device), capture_error_mode="thread_local")
            try:
                output = step()
            finally:
                graph.capture_end()
    except BaseException:
        # A failed capture may leave its pool marked as being captured into (some torch releases skip that cleanup
        # when `capture_end` fails): later captures get a new pool
        _POOLS.pop(_index(device), None)
        raise
    current.wait_stream(stream)
    return graph, output
