"""Reading and resetting the peaks: the CPU's per-window peaks, a capability check that changes nothing, a refused
reset; an accelerator's stats and each phase's own peak there, with the accelerator's memory API stood in for (the
branches a CPU run never takes)."""

import gc
import mmap
import os

import pytest
import torch

import rloo_efficient.profiling.memory as memory
from rloo_efficient.profiling.memory import get_memory_stats, peak_rss_resettable, reset_peak_memory
from rloo_efficient.profiling.phase_profiler import PhaseProfiler


CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)
MIB = 1024**2
GIB = memory.GIB


@pytest.mark.skipif(not peak_rss_resettable(), reason="the kernel does not let this process reset its RSS peak")
def test_cpu_peak_is_per_window():
    # The block is a mapping of its own, unmapped when closed: one from the allocator may stay in the process after
    # its free (the quick pass saw the resident set not fall, after earlier tests), and then no window could tell it
    # apart. No collection inside the windows: an earlier test's garbage freed while the block is made would lower the
    # resident set by as much as the block raises it
    gc.collect()
    gc.disable()
    try:
        get_memory_stats(CPU)  # start a window
        block = mmap.mmap(-1, 64 * MIB)
        for page in range(0, 64 * MIB, 4096):  # 64 MiB, every page touched
            block[page] = 1
        peak_with = get_memory_stats(CPU)["peak_rss_gib"]
        block.close()
        get_memory_stats(CPU)  # a reset sets the peak to the RSS now: open the window after the free
        peak_after = get_memory_stats(CPU)["peak_rss_gib"]
    finally:
        gc.enable()
    assert peak_with - peak_after > 0.05  # the 64 MiB block shows in its window only


@pytest.mark.skipif(not os.access(memory.CLEAR_REFS, os.W_OK), reason="no /proc/self/clear_refs to write to")
def test_asking_whether_the_peak_is_resettable_does_not_reset_it(monkeypatch):
    monkeypatch.setattr(memory, "_clear_refs_works", None)  # not yet asked in this process
    block = torch.ones(128 * MIB, dtype=torch.uint8)  # touched, then freed (an mmap: it leaves the RSS)
    del block
    hwm = memory._read_status_kib("VmHWM")  # above the RSS now by the block: a reset would lower it
    assert peak_rss_resettable()
    assert memory._read_status_kib("VmHWM") == hwm


def test_a_refused_reset_falls_back_to_lifetime_peaks(monkeypatch, tmp_path):
    # A path that os.access calls writable but open(..., "w") refuses, as a kernel that rejects "5" would
    monkeypatch.setattr(memory, "CLEAR_REFS", str(tmp_path))
    monkeypatch.setattr(memory, "_clear_refs_works", None)
    assert peak_rss_resettable()
    reset_peak_memory(CPU)  # no error escapes
    assert not peak_rss_resettable()  # get_memory_stats reads the lifetime peak from now on


class FakeAllocator:
    """`torch.accelerator`'s memory calls as a caching allocator answers them: allocated and reserved bytes now, their
    peaks since the last reset."""

    def __init__(self):
        self.allocated = self.reserved = self.max_allocated = self.max_reserved = 0
        self.resets = 0

    def alloc(self, gib):
        self.allocated += gib * GIB
        self.reserved = max(self.reserved, self.allocated)
        self.max_allocated = max(self.max_allocated, self.allocated)
        self.max_reserved = max(self.max_reserved, self.reserved)

    def free(self, gib):
        self.allocated -= gib * GIB

    def memory_allocated(self, device):
        return self.allocated

    def memory_reserved(self, device):
        return self.reserved

    def max_memory_allocated(self, device):
        return self.max_allocated

    def max_memory_reserved(self, device):
        return self.max_reserved

    def reset_peak_memory_stats(self, device):
        self.resets += 1
        self.max_allocated, self.max_reserved = self.allocated, self.reserved

    def synchronize(self, device):
        pass

    def empty_cache(self):
        self.reserved = self.allocated


def fake_allocator(monkeypatch) -> FakeAllocator:
    fake = FakeAllocator()
    monkeypatch.setattr(memory, "_device_memory_api", lambda device: fake)
    return fake


def test_an_accelerators_stats_are_its_peaks_and_start_a_new_window(monkeypatch):
    """Catches `peak_reserved_gib` read from `memory_reserved` (now) instead of `max_memory_reserved`, the
    accelerator's peaks not reset after they are read, and `current_memory_gib` reading reserved for allocated."""
    fake = fake_allocator(monkeypatch)
    fake.alloc(3)
    fake.free(2)
    assert memory.current_memory_gib(CUDA) == 1.0  # allocated (3 GiB reserved)
    fake.empty_cache()  # reserved now 1 GiB, its peak 3
    fake.alloc(0.5)
    stats = memory.get_memory_stats(CUDA)
    assert stats == {"peak_allocated_gib": 3.0, "peak_reserved_gib": 3.0, "fragmentation_gib": 0.0}
    assert memory.get_memory_stats(CUDA)["peak_allocated_gib"] == 1.5  # a new window


def test_each_phases_accelerator_peak_is_its_own(monkeypatch):
    """Per phase, the accelerator's peak allocated within the phase's own segments: not what was allocated before
    the first phase (catches the reset at a boundary outside every phase dropped), the most of a phase's segments
    and not its last (catches `record[name] = value`), and not an earlier phase's (catches the peaks never reset)."""
    fake = fake_allocator(monkeypatch)
    profiler = PhaseProfiler(CUDA)
    fake.alloc(5)  # outside every phase (the model loaded, TRL's own bookkeeping)
    fake.free(5)
    profiler.start("train")
    fake.alloc(3)
    fake.free(3)
    with profiler.phase("generation"):  # train paused
        fake.alloc(1)
        fake.free(1)
    fake.alloc(2)
    fake.free(2)
    profiler.stop("train")
    phases = profiler.end_step(1)["phases"]
    assert phases["generation"]["peak_allocated_gib"] == 1.0
    assert phases["train"]["peak_allocated_gib"] == 3.0

