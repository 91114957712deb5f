"""[`GRPOTrainer`]: TRL's GRPO trainer with each prompt once per group, profiled per phase."""

import trl

from .config import GRPOConfig
from .mixin import GroupSharingMixin


class GRPOTrainer(GroupSharingMixin, trl.GRPOTrainer):
    """
    A drop-in replacement for [`trl.GRPOTrainer`] (same constructor, same results) that processes each prompt once
    per group in every phase, profiles memory per phase, and can release cached memory at phase boundaries. See
    [`GRPOConfig`] for the switches; with all of them off, training is stock TRL's.

    Every GRPO feature runs through TRL's own code: each loss type, the reference and old-log-prob passes, tools (each
    turn's prompts prefilled as their tree; a later turn's rows continuing their caches from the turn before, within
    `tool_cache_budget_gib`), `rollout_func` and environments (prompts grouped by their tokens, environment included).
    TRL methods wrapped: those of [`GroupSharingMixin`] (profiling included: `trainer.memory_profiling`), each calling
    `super()`; no TRL method is copied.
    """

    _config_class = GRPOConfig
