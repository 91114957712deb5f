"""Moved to [`rloo_efficient.demo.workload`]; this name works for one more release, with a `DeprecationWarning`."""

from ._moved import moved


moved(__name__, "rloo_efficient.demo.workload")
