"""Module names that moved, kept working for one release ([`moved`])."""

import importlib
import sys
import warnings


def _importer_stacklevel() -> int:
    """The stack level of the code importing the old name (past this package's frames), so that Python's default
    filters show the warning where the import is written (`__main__` included). `warnings.warn` skips the import
    machinery's frames itself: they are not counted."""
    level, frame = 2, sys._getframe(2)
    while frame is not None:
        internal = frame.f_code.co_filename.startswith("<frozen importlib")
        if not internal and not frame.f_globals.get("__name__", "").startswith("rloo_efficient"):
            break
        frame, level = frame.f_back, level + (not internal)
    return level


def moved(old: str, new: str) -> None:
    """Makes module `old` the module `new` (every name, private ones too), with one `DeprecationWarning`."""
    warnings.warn(f"{old} moved to {new}: import {new} instead ({old} goes in the next release).", DeprecationWarning,
                  stacklevel=_importer_stacklevel())  # fmt: skip
    sys.modules[old] = importlib.import_module(new)
