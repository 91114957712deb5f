"""[`RLOOTrainer`]: TRL's RLOO trainer with each prompt once per group, profiled per phase."""

import trl

from .config import RLOOConfig
from .mixin import GroupSharingMixin


class RLOOTrainer(GroupSharingMixin, trl.RLOOTrainer):
    """
    A drop-in replacement for [`trl.RLOOTrainer`] (same constructor, same results) that processes each prompt once
    per group in every phase, profiles memory per phase, and can release cached memory at phase boundaries. See
    [`RLOOConfig`] for the switches; with all of them off, training is stock TRL's.

    TRL methods wrapped: those of [`GroupSharingMixin`] (the group structure, the packed forwards, the shared prefill,
    the reward phase, Hydra, and the phase boundaries and memory metrics of the profiling part it holds,
    `trainer.memory_profiling`). Each calls `super()`; no TRL method is copied.
    """

    _config_class = RLOOConfig
