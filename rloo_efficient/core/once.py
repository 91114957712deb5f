"""
One warning per reason. A fallback that applies to every batch of a run (a setting, a model's module) says so once, not
once per step: a trainer keeps its own [`WarnOnce`] (each run warns), a module one per process (its reasons are the
process's: a kernel, the device).
"""

import warnings


class WarnOnce:
    """The reasons already warned for. `warn(message, key)` warns `message` unless `key` (the message itself by
    default) was warned for; returns whether it warned. `stacklevel` counts from the caller of `warn`."""

    def __init__(self):
        self.seen: set = set()

    def warn(self, message: str, key=None, stacklevel: int = 2) -> bool:
        key = message if key is None else key
        if key in self.seen:
            return False
        self.seen.add(key)
        warnings.warn(message, stacklevel=stacklevel + 1)
        return True

    def clear(self) -> None:
        self.seen.clear()
