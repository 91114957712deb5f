"""
The parts one trainer holds ([`Parts`]), built once at the end of its `__init__` from the config's switches and the
trainer's facts: the resolved [`switches.Switches`], the generation backend they run
([`core.generation.backends.choose`]), and each part handed its own decisions and fallbacks.
"""

import dataclasses
from collections.abc import Callable

from accelerate.utils import DistributedType

from ..core.generation.backends import BackendFacts, choose
from ..core.layers.vision import ModelVision
from .config import SharingArguments
from .generation import SharedGeneration
from .held_prefix import HeldPrefixes
from .packed import PackedPasses, Unwrap
from .ranks import Ranks
from .rewards import RewardScoring
from .switches import Fallbacks, Setup, Switches


@dataclasses.dataclass(frozen=True)
class Parts:
    """A trainer's parts: its `switches`, `ranks`, `fallbacks`, the `held` prefixes (None: nothing held), the packed
    `passes`, the shared `generation` and the `rewards`' scoring."""

    switches: Switches
    ranks: Ranks
    fallbacks: Fallbacks
    held: HeldPrefixes | None
    passes: PackedPasses
    generation: SharedGeneration
    rewards: RewardScoring

    @classmethod
    def of(cls, trainer, settings: SharingArguments, counts, shuffle_reason: Callable[[], str | None]) -> "Parts":
        """
        The parts of `trainer` (a TRL group trainer at the end of its `__init__`, read through its public attributes)
        under `settings`: `counts` (what our paths processed) and `shuffle_reason()` (why keeping groups together
        would change more than the order of a sum, or None).
        """
        accelerator, args = trainer.accelerator, trainer.args
        unwrap = Unwrap(accelerator)
        unwrapped = unwrap(trainer.model)
        aux_loss = bool(trainer.aux_loss_enabled)
        backend = choose(BackendFacts(use_vllm=bool(trainer.use_vllm),
                                      continuous_batching=bool(trainer.use_transformers_continuous_batching),
                                      static_decoding=settings.static_decoding, device=accelerator.device,
                                      policy=unwrapped))  # fmt: skip
        setup = Setup(unwrapped, getattr(trainer, "generation_config", None), accelerator.device, aux_loss,
                      backend=backend, tools=bool(getattr(trainer, "tools", None)),
                      several_micro_batches=args.steps_per_generation > 1)  # fmt: skip
        switches = Switches.resolve(settings, setup, shuffle_reason)
        policy = lambda: unwrap(trainer.model)  # noqa: E731 (the Trainer may replace `model` when it prepares it)
        ranks = Ranks(accelerator, policy)
        vision = ModelVision.of(unwrapped)  # batches with images: packed for the families whose layout is known
        fsdp = 0
        if getattr(trainer, "is_fsdp_enabled", False):
            fsdp = 2 if getattr(accelerator, "is_fsdp2", False) else 1
        # Nothing but autograd watches a gradient's accumulation: it may be done as gradients arrive
        owns_accumulation = accelerator.distributed_type == DistributedType.NO and not args.torch_compile
        fallbacks = Fallbacks()
        held = None
        if switches.hold_budget:  # prompts held across a pass's chunks and a step's micro-batches
            held = HeldPrefixes.of(switches.hold_budget, policy, args, ranks.agree, fallbacks.warn, vision, fsdp=fsdp,
                                   aux_loss=aux_loss, alias_parameters=owns_accumulation)  # fmt: skip
        passes = PackedPasses(accelerator.autocast, unwrap, ranks, vision, held.planner if held else None, counts,
                              prefix=switches.prefix, graphs=switches.graphed_passes, fall_back=fallbacks.packed,
                              fsdp=bool(fsdp), grads_in_place=owns_accumulation)  # fmt: skip
        generation = SharedGeneration(ranks, vision, counts, cache_once=switches.prompt_cache_once, tree=switches.tree,
                                      backend=switches.backend, turn_budget=switches.turn_budget,
                                      fall_back=fallbacks.generation, warn=fallbacks.warn)  # fmt: skip
        rewards = RewardScoring(accelerator.device, unwrap, counts, share=switches.reward_prefix, warn=fallbacks.warn)
        return cls(switches, ranks, fallbacks, held, passes, generation, rewards)
