"""
Generation backends: the way TRL's generation runs in a trainer, chosen once ([`choose`]), and what of each
generation we share in it. A backend is one class, registered with [`register`]; [`choose`] asks the registered
classes in order and takes the first that runs for the trainer's [`BackendFacts`], else one of our own two. The seam
decides our side of generation (whether our prefill runs in TRL's calls, and how they decode after it); which of its
paths TRL takes is TRL's flags' doing.

- [`VLLM`] and [`ContinuousBatching`] (registered): TRL's own backends, which share prompts in their own caches; our
  prefill stays out ([`GenerationBackend.own_sharing`]), and the log-prob, training and reward passes are still ours.
- [`StaticDecoding`] (where no registered backend runs, and static decoding is asked for or the device captures):
  `generate` after our shared prefill, decoding from static buffers, each step replayed from a graph where the device
  captures ([`static_decode`]).
- [`GenerateLoop`] (else): `generate` after our shared prefill, decoding in its own loop.
"""

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from . import static_decode


@dataclasses.dataclass(frozen=True)
class BackendFacts:
    """What picks a trainer's backend: TRL's flags for its own backends, our `static_decoding` setting (None: where
    steps are captured), the device and the policy (unwrapped)."""

    use_vllm: bool
    continuous_batching: bool
    static_decoding: bool | None
    device: torch.device
    policy: nn.Module


class GenerationBackend:
    """
    One way TRL's generation runs. `name`: as the warnings say it; `own_sharing`: what the backend shares by itself,
    where our shared prefill stays out of its calls (None: our prefill runs in them, each distinct prompt once);
    `static`: our prefill's calls decode from static buffers ([`generate.generate_with_shared_prefill`]'s `static`).
    """

    name: ClassVar[str]
    own_sharing: ClassVar[str | None] = None
    static: ClassVar[bool] = False

    @classmethod
    def runs(cls, facts: BackendFacts) -> bool:
        """Whether the trainer's generation runs through this backend."""
        raise NotImplementedError

    def __eq__(self, other) -> bool:  # stateless: one backend per class
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))

    @property
    def prefills(self) -> bool:
        """Whether our shared prefill runs in this backend's calls."""
        return self.own_sharing is None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_REGISTERED: list[type[GenerationBackend]] = []


def register(backend: type[GenerationBackend]) -> type[GenerationBackend]:
    """Adds `backend` to those [`choose`] asks, after every one registered before it."""
    _REGISTERED.append(backend)
    return backend


def registered() -> tuple[type[GenerationBackend], ...]:
    """The backends [`choose`] asks, in order."""
    return tuple(_REGISTERED)


def choose(facts: BackendFacts) -> GenerationBackend:
    """The first registered backend that runs for `facts`, else [`StaticDecoding`] where it runs, else
    [`GenerateLoop`]."""
    return next((backend for backend in (*_REGISTERED, StaticDecoding) if backend.runs(facts)), GenerateLoop)()


@register
class VLLM(GenerationBackend):
    name, own_sharing = "vLLM", "prompts in its own prefix cache"

    @classmethod
    def runs(cls, facts: BackendFacts) -> bool:
        return facts.use_vllm


@register
class ContinuousBatching(GenerationBackend):
    name, own_sharing = "transformers' continuous batching", "prompt blocks in its own paged cache"

    @classmethod
    def runs(cls, facts: BackendFacts) -> bool:
        return facts.continuous_batching


class StaticDecoding(GenerationBackend):  # not registered: ours, after every registered backend
    name, static = "static decoding", True

    @classmethod
    def runs(cls, facts: BackendFacts) -> bool:
        if facts.static_decoding is None:
            return static_decode.captures(facts.policy, facts.device)
        return facts.static_decoding


class GenerateLoop(GenerationBackend):  # not registered: ours, what every other backend leaves
    name = "generate"

    @classmethod
    def runs(cls, facts: BackendFacts) -> bool:
        return True
