"""Moved to [`rloo_efficient.demo.tiny_models`]; this name works for one more release, with a `DeprecationWarning`."""

from ._moved import moved


moved(__name__, "rloo_efficient.demo.tiny_models")
