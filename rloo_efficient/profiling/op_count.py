"""
Counting the aten operators a piece of code dispatches, and its host synchronizations.

On a GPU each operator is a kernel launch (microseconds whatever its size) and each host synchronization stalls the
launch queue until the device catches up; a CPU hides both. Counted on CPU, they are deterministic numbers that tests
can assert and benchmarks can compare, standing in for what a GPU profile would show.
"""

import collections

from torch.utils._python_dispatch import TorchDispatchMode


# Operators that read a device value back to the host (or need its size from the device): each one waits for every
# kernel queued before it
HOST_SYNC_OPS = ("_local_scalar_dense", "item", "equal", "nonzero", "is_nonzero")
# Operators that only allocate memory: no kernel runs on a GPU
_ALLOCATING = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


class OpCounter(TorchDispatchMode):
    """
    Counts every aten operator dispatched while active, by name (`aten::add` for `aten.add.Tensor`). Views and
    in-place operators count too: each is a dispatch, and on a GPU most are a launch.

        with OpCounter() as ops:
            model(**inputs)
        ops.total, ops.host_syncs, ops.counts["aten::mm"]
    """

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.metadata: collections.Counter = collections.Counter()  # views and allocations: no kernel on a GPU

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten::{func._overloadpacket.__name__}"
        self.counts[name] += 1
        if func.is_view or func._overloadpacket.__name__ in _ALLOCATING:
            self.metadata[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def launching(self) -> int:
        """Operators that run a kernel: all but views and bare allocations."""
        return self.total - sum(self.metadata.values())

    @property
    def host_syncs(self) -> int:
        return sum(self.counts[f"aten::{name}"] for name in HOST_SYNC_OPS)


class ModuleOpCounter:
    """
    Counts the aten operators dispatched inside `modules` (their forwards), while active: a model's decoder layers,
    for the operators per layer apart from the embedding, the head and the loss; `calls` each forward's count (the
    first layer's includes what a forward builds once for every layer).

        with ModuleOpCounter(model.model.layers) as ops:
            model(**inputs)
        ops.total / len(model.model.layers), ops.calls
    """

    def __init__(self, modules):
        self.modules = list(modules)
        self.counts: collections.Counter = collections.Counter()
        self._handles: list = []
        self._running: list[OpCounter] = []
        self.calls: list[int] = []

    def _enter(self, module, args):
        self._running.append(OpCounter().__enter__())

    def _exit(self, module, args, output):
        counter = self._running.pop()
        counter.__exit__(None, None, None)
        self.counts.update(counter.counts)
        self.calls.append(counter.total)

    def __enter__(self):
        for module in self.modules:
            self._handles += [module.register_forward_pre_hook(self._enter), module.register_forward_hook(self._exit)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())
