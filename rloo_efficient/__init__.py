"""A memory-efficient drop-in replacement for TRL's RLOO trainer: `from rloo_efficient import RLOOTrainer, RLOOConfig`."""

from .config import RLOOConfig
from .trainer import RLOOTrainer


__all__ = ["RLOOConfig", "RLOOTrainer"]
__version__ = "0.1.0"
