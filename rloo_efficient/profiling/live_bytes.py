"""
Counting the bytes of live tensors: what a device's caching allocator calls allocated, measured on any device.

A GPU's peak allocated memory is the largest sum of the storages alive at once. [`LiveBytes`] keeps that sum from
the operators themselves: each storage an operator creates counts once (its views share it) from its creation until
it dies. The numbers are deterministic (no allocator rounding, no cached blocks, no other process), so that tests can
assert them and a CPU run can stand in for a device's (`experiments/bench_device_memory.py`).
"""

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


# Where a tensor is said to come from: the innermost frame in one of these (the library, TRL, transformers, PEFT)
_SITES = ("rloo_efficient/", "trl/", "transformers/", "peft/")
_SKIP = ("rloo_efficient/profiling/",)


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if any(part in name for part in _SITES) and not any(part in name for part in _SKIP):
            short = name.rsplit("site-packages/", 1)[-1].rsplit("/rloo_efficient/", 1)[-1]
            return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "(outside the code we read)"


def _aliases_input(func) -> bool:
    """Whether an operator's output is (a view of) one of its inputs: a view, an in-place or `out=` operator."""
    return func.is_view or any(ret.alias_info is not None for ret in func._schema.returns)


def _described(record: tuple) -> dict:
    nbytes, shape, dtype, op, site = record
    return {"bytes": nbytes, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "op": op, "site": site}


class LiveBytes(TorchDispatchMode):
    """
    The bytes of the storages operators create while active, each counted until it dies, and their peak. Storages
    that existed before (the weights, the optimizer's states) are not counted: what it measures is the memory above
    them. `peak_tensors(n)` names the `n` largest storages alive at the peak: bytes, shape, dtype, the operator that
    made each and where it was called. [`mark`] starts a new segment: its peak and tensors are kept apart.

        with LiveBytes() as live:
            model(**inputs)
        live.peak, live.peak_tensors(10)
    """

    def __init__(self, sites: bool = True):
        super().__init__()
        self.sites = sites
        self.current = 0  # bytes alive now
        self.peak = 0  # the most alive at once since the last mark
        self._live: dict[int, tuple] = {}  # id(storage) -> (bytes, shape, dtype, operator, site)
        self._refs: dict[int, weakref.ref] = {}
        self._at_peak: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _aliases_input(func):
            return out
        grew = False
        for value in tree_leaves(out):
            if not isinstance(value, torch.Tensor) or value.device.type == "meta":
                continue
            storage = value.untyped_storage()
            key = id(storage)
            if key in self._live or storage.nbytes() == 0:
                continue
            nbytes = storage.nbytes()
            self._live[key] = (nbytes, tuple(value.shape), value.dtype, func._overloadpacket.__name__,
                               _site() if self.sites else "")  # fmt: skip
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._freed(key))
            self.current += nbytes
            grew = True
        if grew and self.current > self.peak:
            self.peak = self.current
            self._at_peak = list(self._live.values())
        return out

    def _freed(self, key: int) -> None:
        record = self._live.pop(key, None)
        self._refs.pop(key, None)
        if record is not None:
            self.current -= record[0]

    def mark(self) -> None:
        """Starts a new segment: its peak counts from what is alive now."""
        self.peak, self._at_peak = self.current, list(self._live.values())

    def peak_tensors(self, n: int = 10) -> list[dict]:
        """The `n` largest storages alive at the segment's peak, largest first."""
        return [_described(record) for record in sorted(self._at_peak, key=lambda record: -record[0])[:n]]

    def live_tensors(self) -> list[dict]:
        """Every storage alive now, largest first (as [`peak_tensors`] gives them, with `storage`: `id()` of its
        `untyped_storage()`, the same object while it lives)."""
        records = sorted(self._live.items(), key=lambda item: -item[1][0])
        return [{**_described(record), "storage": key} for key, record in records]


class PhasePeaks:
    """
    [`LiveBytes`] per phase of a trainer's [`phase_profiler.PhaseProfiler`], while active: `phases[name]` is the phase's
    largest peak over its segments (`peak_bytes`, above what was alive when the block began) and the `top` largest
    tensors alive then (`largest`). Time outside every phase counts as `"outside"`.

        with PhasePeaks(trainer.memory_profiling.profiler) as peaks:
            trainer.train()
        peaks.phases["train"]["peak_bytes"]
    """

    def __init__(self, profiler, top: int = 10):
        self.profiler, self.top = profiler, top
        self.live = LiveBytes()
        self.phases: dict[str, dict] = {}

    def _close(self, label: str | None) -> None:
        record = self.phases.setdefault(label or "outside", {"peak_bytes": -1})
        if self.live.peak > record["peak_bytes"]:
            record.update(peak_bytes=self.live.peak, largest=self.live.peak_tensors(self.top))
        self.live.mark()

    def __enter__(self):
        start, stop = self.profiler.start, self.profiler.stop

        def started(phase, evaluating=False):
            before = self.profiler.current_phase
            start(phase, evaluating)
            self._close(before)

        def stopped(phase):
            stop(phase)
            self._close(phase)

        self.profiler.start, self.profiler.stop = started, stopped
        self.live.__enter__()
        self.live.mark()
        return self

    def __exit__(self, *exc):
        self._close(self.profiler.current_phase)
        self.live.__exit__(*exc)
        del self.profiler.start, self.profiler.stop  # the class's methods again
        return False
