"""
Generation backends: the way TRL's generation runs in a trainer, chosen once ([`choose`]), and what of each
generation we share in it. A backend is one class, registered with [`register`]; [`choose`] asks the registered
classes in order and takes the first that runs for the trainer's [`BackendFacts`], else [`GenerateLoop`].

- [`VLLM`] and [`ContinuousBatching`]: TRL's own backends, which share prompts in their own caches; our prefill stays
  out ([`GenerationBackend.own_sharing`]), and the log-prob, training and reward passes are still ours.
- [`StaticDecoding`]: `generate` after our shared prefill, decoding from static buffers, each step replayed from a
  graph where the device captures ([`static_decode`]).
- [`GenerateLoop`]: `generate` after our shared prefill, decoding in its own loop: where no registered backend runs.
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
    """The first registered backend that runs for `facts`, else [`GenerateLoop`]."""
    return next((backend for backend in _REGISTERED if backend.runs(facts)), GenerateLoop)()


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


@register
class StaticDecoding(GenerationBackend):
    name, static = "static decoding", True

    @classmethod
    def runs(cls, facts: BackendFacts) -> bool:
        if facts.static_decoding is None:
            return static_decode.captures(facts.policy, facts.device)
        return facts.static_decoding


class GenerateLoop(GenerationBackend):  # not registered: what every registered backend leaves
    name = "generate"

    @classmethod
    def runs(cls, facts: BackendFacts) -> bool:
        return True
