"""Reading and releasing memory: the device's peak counters, the process's resident set, and the allocator caches.

Every number is in GiB. On an accelerator the caching allocator's peaks are read and reset through
`torch.accelerator` (falling back to `torch.cuda`); on CPU the kernel's high-water mark of the resident set
(`VmHWM`) is read from `/proc/self/status` and reset by writing `5` to `/proc/self/clear_refs` (Linux >= 4.0).
"""

import ctypes
import ctypes.util
import os
import resource
import sys

import torch

from ..core import graphs


GIB = 1024**3
CLEAR_REFS = "/proc/self/clear_refs"

_clear_refs_works: bool | None = None
_libc = None


def is_accelerator(device: torch.device) -> bool:
    return device.type not in ("cpu", "meta")


def _device_memory_api(device: torch.device):
    """The module whose `max_memory_allocated` & co. describe `device`: `torch.accelerator`, else `torch.cuda`."""
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "max_memory_allocated"):
        return torch.accelerator
    return torch.cuda


def _read_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_gib() -> float:
    """The process's resident set size now, in GiB (`VmRSS`; `ru_maxrss` where `/proc` is missing)."""
    kib = _read_status_kib("VmRSS")
    if kib is None:  # not Linux: the best we have is the lifetime peak
        return _ru_maxrss_gib()
    return kib * 1024 / GIB


def _ru_maxrss_gib() -> float:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return maxrss / GIB if sys.platform == "darwin" else maxrss * 1024 / GIB


def peak_rss_resettable() -> bool:
    """
    Whether this process can reset its resident-set high-water mark: `/proc/self/clear_refs` is writable and `VmHWM`
    readable. Only looks: the one write to `clear_refs` is [`reset_peak_memory`]'s, which turns this to `False` if
    the kernel refuses it.
    """
    global _clear_refs_works
    if _clear_refs_works is None:
        _clear_refs_works = os.access(CLEAR_REFS, os.W_OK) and _read_status_kib("VmHWM") is not None
    return _clear_refs_works


def synchronize(device: torch.device) -> None:
    """Waits for the kernels queued on `device` (nothing to wait for on CPU)."""
    if is_accelerator(device):
        _device_memory_api(device).synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new peak window for [`get_memory_stats`]."""
    global _clear_refs_works
    if is_accelerator(device):
        _device_memory_api(device).reset_peak_memory_stats(device)
    elif peak_rss_resettable():
        try:
            with open(CLEAR_REFS, "w") as f:
                f.write("5")
        except OSError:  # writable by its mode yet refused (Linux < 4.0 rejects "5"): lifetime peaks from now on
            _clear_refs_works = False


def headline_peak_stat(device: torch.device) -> str:
    """
    The one [`get_memory_stats`] number that reports are headlined by (`peak_gib`): `peak_allocated_gib` on an
    accelerator, `peak_rss_gib` on CPU.
    """
    return "peak_allocated_gib" if is_accelerator(device) else "peak_rss_gib"


def get_memory_stats(device: torch.device, reset: bool = True) -> dict[str, float]:
    """
    Peak memory on `device` since the last reset, in GiB, then (by default) starts a new window.

    On an accelerator: `peak_allocated_gib` (tensors), `peak_reserved_gib` (held by the caching allocator) and
    `fragmentation_gib`, reserved minus allocated at their peaks: memory the allocator holds but no tensor uses. On
    CPU: `peak_rss_gib`, the process's peak resident set. Where the kernel does not let us reset that peak, it is the
    peak since the process started.
    """
    if is_accelerator(device):
        api = _device_memory_api(device)
        allocated = api.max_memory_allocated(device) / GIB
        reserved = api.max_memory_reserved(device) / GIB
        stats = {
            "peak_allocated_gib": allocated,
            "peak_reserved_gib": reserved,
            "fragmentation_gib": reserved - allocated,
        }
    else:
        hwm = _read_status_kib("VmHWM") if peak_rss_resettable() else None
        stats = {"peak_rss_gib": hwm * 1024 / GIB if hwm is not None else _ru_maxrss_gib()}
    if reset:
        reset_peak_memory(device)
    return stats


def current_memory_gib(device: torch.device) -> float:
    """Memory in use now: allocated tensors on an accelerator, the resident set on CPU."""
    stats = current_memory_stats(device)
    return stats.get("allocated_gib", stats.get("rss_gib"))


def current_memory_stats(device: torch.device) -> dict[str, float]:
    """Memory in use now, in GiB: `allocated_gib` and `reserved_gib` on an accelerator, `rss_gib` on CPU."""
    if is_accelerator(device):
        api = _device_memory_api(device)
        return {"allocated_gib": api.memory_allocated(device) / GIB, "reserved_gib": api.memory_reserved(device) / GIB}
    return {"rss_gib": current_rss_gib()}


def release_cached_memory(device: torch.device) -> None:
    """
    Returns cached, unused memory to the system: `empty_cache()` on an accelerator, the CUDA graphs' pools too (let
    go of first: [`core.graphs.release_pools`]); on CPU with glibc, `malloc_trim(0)`, which hands the C heap's free
    pages back to the kernel. A no-op where neither exists.
    """
    global _libc
    if is_accelerator(device):
        if device.type == "cuda":
            graphs.release_pools()
        _device_memory_api(device).empty_cache()
        return
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    if _libc and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


def device_description(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    if is_accelerator(device):
        return device.type
    import os
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
