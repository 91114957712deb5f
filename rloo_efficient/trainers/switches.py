"""
Which of our paths a run takes ([`Switches`]): the config's switches ([`config.SharingArguments`]) resolved once, each
turned off where the model or the setup cannot take it exactly, with one warning naming the reason. Immutable: each
part is handed its own decisions. The fallbacks decided later, per batch, are said once each ([`Fallbacks`]).
"""

import dataclasses
import warnings

from ..core.generation.backends import GenerateLoop, GenerationBackend
from ..core.generation.generate import generation_unsupported_reason
from ..core.generation.prompt_cache import prefix_cache_unsupported_reason
from ..core.generation.turn_cache import continue_reason
from ..core.layers.families import forward_unsupported_reason
from ..core.layers.moe import aux_loss_reason
from ..core.once import WarnOnce
from .config import STOCK_SETTINGS, SharingArguments, default_budget


def _supported(reason: str | None, consequence: str) -> bool:
    """True when there is no `reason` against a feature; otherwise warns `consequence: reason` and returns False."""
    if reason is not None:
        warnings.warn(f"rloo_efficient: {consequence}: {reason}.", stacklevel=5)
    return reason is None


@dataclasses.dataclass
class Setup:
    """What the switches depend on besides the config: the trainer's facts at the end of its `__init__`."""

    policy: object  # unwrapped
    generation_config: object  # None under vLLM (TRL sets none)
    device: object
    aux_loss: bool  # the MoE load-balancing loss is on
    backend: GenerationBackend  # the way generation runs ([`core.generation.backends.choose`])
    tools: bool  # a tool loop (GRPO's tools or environments)
    several_micro_batches: bool  # a generation feeds more than one micro-batch


class Fallbacks:
    """This run's fallbacks decided per batch, each said once: [`packed`] (a batch's forward runs stock's),
    [`generation`] (a call runs stock's generate) and [`warn`] (any other)."""

    def __init__(self):
        self._said = WarnOnce()

    def packed(self, reason: str) -> None:
        """Stock's forward for such batches (`reason`: why)."""
        self._said.warn(f"rloo_efficient: prompt-prefix sharing is off for such batches, using stock TRL's forward: "
                        f"{reason}.", key=reason, stacklevel=3)  # fmt: skip

    def generation(self, reason: str) -> None:
        """Stock's generate for such calls (`reason`: why); the forwards share as they may."""
        self._said.warn(f"rloo_efficient: the shared generation prefill is off for such calls, using stock TRL's "
                        f"generate: {reason}.", key=("generation", reason), stacklevel=3)  # fmt: skip

    def warn(self, message: str, key=None) -> None:
        self._said.warn(message, key=key, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class Switches:
    """
    The paths a run takes, decided once. `prefix`: the packed forwards; `distinct_prompts`: each distinct prompt
    tokenized once; `prefill`: the shared generation prefill; `tree`: its prompts' prefix tree; `prompt_cache_once`: the
    prompt's cache kept once while decoding (True, or None: chosen per call by its cost); `backend`: the way generation
    runs ([`core.generation.backends`]: TRL's vLLM or continuous batching, static decoding, `generate`'s loop);
    `graphed_passes`: the no-grad passes' small chunks
    replayed from graphs; `reward_prefix`: reward models scored from packed rows; `hold_budget`: the bytes prompts may
    be held in across a pass's chunks and a step's micro-batches (0: none held); `keep_groups`: micro-batches keep each
    group's rows together; `turn_budget`: the bytes a tool loop's held caches may take (None: not held). [`STOCK`]:
    every path off, each of our wrappers TRL's method.
    """

    prefix: bool = False
    distinct_prompts: bool = False
    prefill: bool = False
    tree: bool = False
    prompt_cache_once: bool | None = False
    backend: GenerationBackend = dataclasses.field(default_factory=GenerateLoop)
    graphed_passes: bool = False
    reward_prefix: bool = False
    hold_budget: int = 0
    keep_groups: bool = False
    turn_budget: int | None = None

    @classmethod
    def resolve(cls, settings: SharingArguments, setup: Setup, shuffle_reason) -> "Switches":
        """The switches `settings` asks for, each where `setup` can take it (else off, with one warning);
        `shuffle_reason()`: why keeping groups together would change more than the order of a sum, or None."""
        model = setup.policy
        prefix = False
        if settings.share_prompt_prefix:
            reason = forward_unsupported_reason(model, settings.share_under_dropout)
            if reason is None and setup.aux_loss:
                reason = aux_loss_reason(model)
            prefix = reason is None
            if reason is not None:
                warnings.warn(f"rloo_efficient: prompt-prefix sharing is off, using stock TRL's forward: {reason}.",
                              stacklevel=4)  # fmt: skip
        prefill = cls._prefill(settings, setup)
        keep_once = settings.share_prompt_kv_cache  # True, False, or None: chosen per call by its cost
        can_keep_once = (
            prefill
            and keep_once is not False
            and _supported(prefix_cache_unsupported_reason(model),
                           "the prompt's KV cache is fanned out to every completion while decoding (the prefill is "
                           "still shared)")
        )  # fmt: skip
        hold_budget = 0
        if prefix and settings.held_prefix_budget_gib != 0:
            budget = settings.held_prefix_budget_gib
            hold_budget = default_budget(setup.device) if budget is None else int(budget * 1024**3)
        return cls(prefix=prefix, distinct_prompts=settings.share_prompt_prefix, prefill=prefill,
                   tree=settings.share_prefill_tree, prompt_cache_once=keep_once if can_keep_once else False,
                   backend=setup.backend, graphed_passes=settings.graph_scoring_passes,
                   reward_prefix=settings.share_reward_prefix, hold_budget=hold_budget,
                   keep_groups=cls._keep_groups(settings, setup, prefix, shuffle_reason),
                   turn_budget=cls._turn_budget(settings, setup, prefill))  # fmt: skip

    @staticmethod
    def _prefill(settings: SharingArguments, setup: Setup) -> bool:
        """Whether generation prefills each distinct prompt once."""
        backend = setup.backend
        if not backend.prefills and settings.share_generation_prefill:
            warnings.warn(f"rloo_efficient: generation runs stock TRL's {backend.name} backend (it shares "
                          f"{backend.own_sharing}), so our shared prefill is off; the log-prob, training and reward "
                          f"passes are still ours.", stacklevel=5)  # fmt: skip
        return (
            settings.share_generation_prefill
            and backend.prefills
            and _supported(generation_unsupported_reason(setup.policy, setup.generation_config,
                                                         settings.share_under_dropout),
                           "the shared generation prefill is off, using stock TRL's generate")
        )  # fmt: skip

    @staticmethod
    def _turn_budget(settings: SharingArguments, setup: Setup, prefill: bool) -> int | None:
        """The bytes a tool loop's rows may hold their caches in from turn to turn (None: not held)."""
        budget = settings.tool_cache_budget_gib
        if (
            prefill
            and setup.tools
            and budget != 0
            and _supported(continue_reason(setup.policy),
                           "each later tool turn prefills its rows' histories (as their prefix tree where it can)")
        ):  # fmt: skip
            return default_budget(setup.device) if budget is None else int(budget * 1024**3)
        return None

    @staticmethod
    def _keep_groups(settings: SharingArguments, setup: Setup, prefix: bool, shuffle_reason) -> bool:
        """Whether a generation's micro-batches keep each group's rows together (one micro-batch: nothing to keep
        together, and its rows stay in stock's order)."""
        several = prefix and setup.several_micro_batches  # packed micro-batches to keep groups in
        if settings.shuffle_groups is None and several:
            reason = shuffle_reason()  # by default, where keeping groups together only reorders a sum
            if reason is not None:
                warnings.warn(f"rloo_efficient: micro-batches follow TRL's row shuffle, which splits groups "
                              f"(shuffle_groups=True keeps them together anyway): {reason}.", stacklevel=5)  # fmt: skip
            return reason is None
        return bool(settings.shuffle_groups) and several

    @property
    def any_layout(self) -> bool:
        """Whether any of our forwards passes a layout to the attention modules (then our attention is installed)."""
        return self.prefix or self.prompt_cache_once is not False


STOCK = Switches()
