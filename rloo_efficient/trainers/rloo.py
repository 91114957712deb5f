"""[`RLOOTrainer`]: TRL's RLOO trainer with each prompt once per group, profiled per phase."""

import trl

from .config import RLOOConfig
from .memory_profiling import MemoryProfilingMixin
from .mixin import GroupSharingMixin


class RLOOTrainer(MemoryProfilingMixin, GroupSharingMixin, trl.RLOOTrainer):
    """
    A drop-in replacement for [`trl.RLOOTrainer`] (same constructor, same results) that processes each prompt once
    per group in every phase, profiles memory per phase, and can release cached memory at phase boundaries. See
    [`RLOOConfig`] for the switches; with all of them off, training is stock TRL's.

    TRL methods wrapped: those of [`GroupSharingMixin`] (the group structure, the packed forwards, the shared prefill,
    the reward phase, Hydra) and of [`MemoryProfilingMixin`] (`_generate`, `_calculate_rewards`,
    `_get_per_token_logps_and_entropies`, `training_step`, `log`: phase boundaries and memory metrics). Each calls
    `super()`; no TRL method is copied.
    """

    _config_class = RLOOConfig
