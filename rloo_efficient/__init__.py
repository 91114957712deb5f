"""
Memory-efficient drop-in replacements for TRL's group trainers:
`from rloo_efficient import RLOOTrainer, RLOOConfig` (or `GRPOTrainer, GRPOConfig`).
"""

from .trainers.config import GRPOConfig, RLOOConfig
from .trainers.grpo import GRPOTrainer
from .trainers.memory_profiling import MemoryProfilingMixin, profiled  # (the mixin: deprecated, warns when subclassed)
from .trainers.mixin import GroupSharingMixin
from .trainers.rloo import RLOOTrainer


__all__ = ["GRPOConfig", "GRPOTrainer", "GroupSharingMixin", "MemoryProfilingMixin", "RLOOConfig", "RLOOTrainer",
           "profiled"]
__version__ = "0.2.0"
