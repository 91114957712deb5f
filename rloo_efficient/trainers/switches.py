"""
Which of our paths a run takes ([`Switches`]): the config's switches ([`config.SharingArguments`]), each turned off
where the model or the setup cannot take it exactly, with one warning naming the reason; and the fallbacks decided
later, per batch, each said once.
"""

import dataclasses
import warnings

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
        warnings.warn(f"rloo_efficient: {consequence}: {reason}.", stacklevel=4)
    return reason is None


@dataclasses.dataclass
class Setup:
    """What the switches depend on besides the config: the trainer's facts at the end of its `__init__`."""

    policy: object  # unwrapped
    generation_config: object  # None under vLLM (TRL sets none)
    device: object
    aux_loss: bool  # the MoE load-balancing loss is on
    other_backend: str | None  # "vLLM" or "transformers' continuous batching": TRL's generation backend, else None
    tools: bool  # a tool loop (GRPO's tools or environments)
    several_micro_batches: bool  # a generation feeds more than one micro-batch


@dataclasses.dataclass
class Switches:
    """
    The paths a run takes. `prefix`: the packed forwards (may be turned off for good by [`fall_back`]); `prefill`: the
    shared generation prefill; `prompt_cache_once`: the prompt's cache kept once while decoding (True, or None: chosen
    per call by its cost); `keep_groups`: micro-batches keep each group's rows together; `turn_budget`: the bytes a tool
    loop's held caches may take (None: not held). [`STOCK`]: every path off, each of our wrappers TRL's method.
    """

    settings: SharingArguments = dataclasses.field(default_factory=lambda: STOCK_SETTINGS)
    prefix: bool = False
    prefill: bool = False
    prompt_cache_once: bool | None = False
    keep_groups: bool = False
    turn_budget: int | None = None
    warnings: WarnOnce = dataclasses.field(default_factory=WarnOnce)  # this run's fallbacks, each said once

    @classmethod
    def resolve(cls, settings: SharingArguments, setup: Setup, shuffle_reason) -> "Switches":
        """The switches `settings` asks for, each where `setup` can take it (else off, with one warning);
        `shuffle_reason()`: why keeping groups together would change more than the order of a sum, or None."""
        switches = cls(settings)
        model = setup.policy
        if settings.share_prompt_prefix:
            reason = forward_unsupported_reason(model, settings.share_under_dropout)
            if reason is None and setup.aux_loss:
                reason = aux_loss_reason(model)
            switches.prefix = reason is None
            if reason is not None:
                switches.fall_back(reason)
        if setup.other_backend and settings.share_generation_prefill:
            warnings.warn(f"rloo_efficient: generation runs stock TRL's {setup.other_backend} backend (it shares "
                          f"prompts in its own cache), so our shared prefill is off; the log-prob, training and reward "
                          f"passes are still ours.", stacklevel=3)  # fmt: skip
        switches.prefill = (
            settings.share_generation_prefill
            and not setup.other_backend
            and _supported(generation_unsupported_reason(model, setup.generation_config, settings.share_under_dropout),
                           "the shared generation prefill is off, using stock TRL's generate")
        )  # fmt: skip
        keep_once = settings.share_prompt_kv_cache  # True, False, or None: chosen per call by its cost
        can_keep_once = (
            switches.prefill
            and keep_once is not False
            and _supported(prefix_cache_unsupported_reason(model),
                           "the prompt's KV cache is fanned out to every completion while decoding (the prefill is "
                           "still shared)")
        )  # fmt: skip
        switches.prompt_cache_once = keep_once if can_keep_once else False
        # A tool loop's rows continue their caches from turn to turn, within the budget
        budget = settings.tool_cache_budget_gib
        if (
            switches.prefill
            and setup.tools
            and budget != 0
            and _supported(continue_reason(model),
                           "each later tool turn prefills its rows' histories (as their prefix tree where it can)")
        ):  # fmt: skip
            switches.turn_budget = default_budget(setup.device) if budget is None else int(budget * 1024**3)
        # Groups kept together across a generation's micro-batches (one micro-batch: nothing to keep together, and its
        # rows stay in stock's order)
        several = switches.prefix and setup.several_micro_batches  # packed micro-batches to keep groups in
        switches.keep_groups = bool(settings.shuffle_groups) and several
        if settings.shuffle_groups is None and several:
            reason = shuffle_reason()  # by default, where keeping groups together only reorders a sum
            switches.keep_groups = reason is None
            if reason is not None:
                warnings.warn(f"rloo_efficient: micro-batches follow TRL's row shuffle, which splits groups "
                              f"(shuffle_groups=True keeps them together anyway): {reason}.", stacklevel=3)  # fmt: skip
        return switches

    @property
    def any_layout(self) -> bool:
        """Whether any of our forwards passes a layout to the attention modules (then our attention is installed)."""
        return self.prefix or self.prompt_cache_once is not False

    def fall_back(self, reason: str, permanent: bool = True) -> None:
        """Stock's forward from now on (`permanent`), or for such batches; said once per reason."""
        if permanent:
            self.prefix = False
        self.warnings.warn(f"rloo_efficient: prompt-prefix sharing is off{'' if permanent else ' for such batches'}, "
                           f"using stock TRL's forward: {reason}.", key=reason, stacklevel=3)  # fmt: skip

    def warn_once(self, message: str) -> None:
        self.warnings.warn(message, stacklevel=3)


STOCK = Switches()
