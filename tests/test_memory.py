"""Reading and resetting the CPU peak: per-window peaks, a capability check that changes nothing, a refused reset."""

import os

import pytest
import torch

import rloo_efficient.profiling.memory as memory
from rloo_efficient.profiling.memory import get_memory_stats, peak_rss_resettable, reset_peak_memory


CPU = torch.device("cpu")
MIB = 1024**2


@pytest.mark.skipif(not peak_rss_resettable(), reason="the kernel does not let this process reset its RSS peak")
def test_cpu_peak_is_per_window():
    get_memory_stats(CPU)  # start a window
    block = torch.ones(64 * MIB, dtype=torch.uint8)  # 64 MiB, touched
    peak_with = get_memory_stats(CPU)["peak_rss_gib"]
    del block
    get_memory_stats(CPU)  # a reset sets the peak to the RSS now: open the window after the free
    peak_after = get_memory_stats(CPU)["peak_rss_gib"]
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
