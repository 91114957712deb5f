"""
Where each phase's peak goes, in one optimizer step:

- on CUDA ([`record_step`], `run_rloo.py --memory_history PATH`): the allocator's history, recorded with
  `torch.cuda.memory._record_memory_history`, replayed event by event to each phase's peak of allocated memory, and
  the blocks live at that peak grouped by where they were allocated (the innermost frames in the library, TRL,
  transformers, PEFT or torch.nn);
- on any device ([`record_live_bytes`], `run_rloo.py --live_bytes PATH`): the live tensor bytes of
  `rloo_efficient.profiling.live_bytes.LiveBytes`, each phase's peak and the largest tensors alive then, as JSON (the
  CPU stand-in for the device's allocated memory: `experiments/bench_device_memory.py`).

Phase boundaries come from the trainer's `PhaseProfiler` (on CUDA marked in the history by a small allocation made in
`_phase_marker`).
"""

import collections
import json
from pathlib import Path

import torch


MARKER_BYTES = 512
# The optimizer step `run_rloo.py --memory_history` and `--live_bytes` record: the second, past the first's one-time
# costs. Recording slows it: timings leave it out (`bench_gpu.py`)
RECORDED_STEP = 2
INTERESTING = ("rloo_efficient/", "trl/", "transformers/", "peft/", "torch/nn/", "torch/utils/checkpoint",
               "torch/autograd", "torch/amp", "accelerate/")  # fmt: skip
SKIP = ("memory_history.py",)


def _phase_marker(label: str, markers: list[str]) -> None:
    markers.append(label)
    torch.empty(MARKER_BYTES, dtype=torch.uint8, device="cuda")  # freed at once: only its allocation event matters


def _site(frames: list[dict], depth: int = 4) -> str:
    """The innermost `depth` frames in the code we read, innermost first, as `file:line name`."""
    kept = []
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in INTERESTING) and not any(part in name for part in SKIP):
            short = name.split("site-packages/")[-1].split("rloo_efficient/", 1)[-1]
            kept.append(f"{short}:{frame.get('line')} {frame.get('name')}")
        if len(kept) == depth:
            break
    return " < ".join(kept) or "(no Python frame in the code we read)"


def _is_marker(event: dict) -> bool:
    """Whether an allocation event is [`_phase_marker`]'s: a phase boundary, not a tensor."""
    frames = event.get("frames", [])
    return event["size"] == MARKER_BYTES and any(frame.get("name") == "_phase_marker" for frame in frames)


def analyze(trace: list[dict], markers: list[str], start_allocated: int, start_reserved: int = 0,
            top: int = 10) -> dict:  # fmt: skip
    """Replays `trace` (a device's allocator events) from `start_allocated` bytes allocated and `start_reserved`
    reserved: per phase segment label, the peak of allocated bytes and the blocks live then, by allocation site, and
    the peak of reserved bytes with the sites whose allocations made the allocator reserve more (`segment_alloc`,
    `segment_map` under expandable segments). Frees of blocks allocated before the recording lower the count but have
    no site. Two passes: the first finds each label's peak, the second the blocks live at those peaks alone, and only
    their sites are read (a recorded step holds up to millions of events, each with a Python stack)."""
    # pass 1: each label's peak allocated (and the index of the event reaching it) and peak reserved
    current, reserved, label, marker = start_allocated, start_reserved, "before", 0
    peaks: dict[str, dict] = {}
    grown: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for index, event in enumerate(trace):
        action, size = event["action"], event["size"]
        if action in ("segment_alloc", "segment_map"):
            reserved += size
            grown[label][_site(event.get("frames", []))] += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        elif action == "alloc":
            current += size
            if _is_marker(event):
                label = markers[marker] if marker < len(markers) else "after"
                marker += 1
                continue
        elif action == "free_completed":
            current -= size
        record = peaks.setdefault(label, {"peak": -1, "reserved": 0, "at": None})
        record["reserved"] = max(record["reserved"], reserved)
        if action == "alloc" and current > record["peak"]:
            record.update(peak=current, at=index)
    # pass 2: the blocks live at each peak (address -> the index of the event that allocated it)
    at_peak = {record["at"]: label for label, record in peaks.items() if record["at"] is not None}
    live: dict[int, int] = {}
    for index, event in enumerate(trace[: max(at_peak, default=-1) + 1]):
        if event["action"] == "alloc":
            live[event["addr"]] = index
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
        if index in at_peak:
            peaks[at_peak[index]]["live"] = list(live.values())
    report = {}
    for label, record in peaks.items():
        by_site = collections.Counter()
        count = collections.Counter()
        for index in record.get("live", []):
            event = trace[index]
            site = "marker" if _is_marker(event) else _site(event.get("frames", []))
            by_site[site] += event["size"]
            count[site] += 1
        tracked = sum(by_site.values())
        report[label] = {
            "peak_allocated_gib": max(record["peak"], 0) / 1024**3,
            "from_before_the_step_gib": (max(record["peak"], 0) - tracked) / 1024**3,
            "peak_reserved_gib": record["reserved"] / 1024**3,
            "largest": [{"gib": size / 1024**3, "blocks": count[site], "site": site}
                        for site, size in by_site.most_common(top)],
            "reserved_by": [{"gib": size / 1024**3, "site": site} for site, size in grown[label].most_common(5)],
        }  # fmt: skip
    return report


def markdown(report: dict, title: str) -> str:
    lines = [f"# {title}", ""]
    for label, record in report.items():
        lines += [f"## {label}: peak allocated {record['peak_allocated_gib']:.3f} GiB, of which allocated before the "
                  f"step {record['from_before_the_step_gib']:.3f} GiB; peak reserved {record['peak_reserved_gib']:.3f}"
                  " GiB", "", "| GiB | blocks | where |", "|---:|---:|---|"]  # fmt: skip
        lines += [f"| {entry['gib']:.3f} | {entry['blocks']} | {entry['site']} |" for entry in record["largest"]]
        lines += ["", "reserved more for:", *(f"- {entry['gib']:.3f} GiB: {entry['site']}" for entry in record["reserved_by"]),
                  ""]  # fmt: skip
    return "\n".join(lines)


def record_step(profiler_class, step: int, path: str, max_entries: int = 2_000_000) -> None:
    """Patches `profiler_class` (the trainer's PhaseProfiler) to record optimizer step `step` (1-based) on CUDA and write
    its analysis to `path` (Markdown) when that step ends."""
    markers: list[str] = []
    start = {}

    def begin(profiler):
        torch.cuda.synchronize()
        start["allocated"], start["reserved"] = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=max_entries)  # fmt: skip
        _phase_marker(profiler.current_phase or "outside", markers)

    def end(profiler):
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        report = analyze(trace, markers, start["allocated"], start["reserved"])
        Path(path).write_text(markdown(report, f"Allocator history of optimizer step {step} ({len(trace)} events)"))

    _patch_steps(profiler_class, step, begin, lambda profiler, before: _phase_marker(
        profiler.current_phase or "outside", markers), end)  # fmt: skip


def _patch_steps(profiler_class, step: int, begin, boundary, end) -> None:
    """Patches `profiler_class` so that optimizer step `step` (1-based) calls `begin(profiler)` when it starts,
    `boundary(profiler, phase_before)` at each phase boundary in it, and `end(profiler)` when it ends."""
    state = {"steps": 0}
    begin_step, end_step, start, stop = (profiler_class.begin_step, profiler_class.end_step, profiler_class.start,
                                         profiler_class.stop)  # fmt: skip

    def recording() -> bool:
        return state["steps"] == step

    def patched_begin(self):
        begin_step(self)
        state["steps"] += 1
        if recording():
            begin(self)

    def patched_start(self, phase, evaluating=False):
        before = self.current_phase
        start(self, phase, evaluating)
        if recording():
            boundary(self, before)

    def patched_stop(self, phase):
        stop(self, phase)
        if recording():
            boundary(self, phase)

    def patched_end(self, step_number):
        entry = end_step(self, step_number)
        if recording():
            end(self)
            state["steps"] += 10**9  # once
        return entry

    profiler_class.begin_step, profiler_class.end_step = patched_begin, patched_end
    profiler_class.start, profiler_class.stop = patched_start, patched_stop


def record_live_bytes(profiler_class, step: int, path: str, top: int = 10) -> None:
    """Counts live tensor bytes through optimizer step `step` (1-based) and writes, per phase, the peak above what
    existed when the step began (the weights and optimizer states) and the `top` largest tensors alive then, to
    `path` (JSON)."""
    from rloo_efficient.profiling.live_bytes import PhasePeaks

    counting = {}

    def begin(profiler):
        counting["peaks"] = PhasePeaks(profiler, top).__enter__()

    def end(profiler):
        peaks = counting.pop("peaks")
        peaks.__exit__(None, None, None)
        Path(path).write_text(json.dumps({"step": step, "phases": peaks.phases}, indent=1))

    _patch_steps(profiler_class, step, begin, lambda profiler, before: None, end)
