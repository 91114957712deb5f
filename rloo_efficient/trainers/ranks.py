"""
Agreement across processes ([`Ranks`]). Under DeepSpeed ZeRO-3 and FSDP every forward (and backward) gathers parameters
from all processes, so that all of them must run the same forwards: where one process would take stock's path (or hold
a prompt, or merge its chunks) and another not, they agree first, by one all-reduce. Elsewhere each process decides
alone, and nothing is exchanged.
"""

import numpy as np
import torch

from ..core.generation.generate import on_every_rank


class Ranks:
    """The processes of `accelerator`, whose forwards run `policy()` (the policy, unwrapped)."""

    def __init__(self, accelerator, policy):
        self._accelerator, self.policy = accelerator, policy

    def collective(self, model=None) -> bool:
        """Whether every forward of `model` (default: the policy) gathers parameters from all ranks (so that ranks
        must run the same forwards)."""
        if self._accelerator.num_processes == 1:
            return False
        from torch.distributed.fsdp import FSDPModule
        from transformers.distributed.fsdp import is_fsdp_managed_module
        from transformers.integrations import is_deepspeed_zero3_enabled

        model = self.policy() if model is None else model
        # As transformers' generate decides to keep ranks in step (`synced_gpus`), and FSDP2 applied by accelerate
        return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model) or isinstance(model, FSDPModule)

    def can(self, can: bool) -> bool:
        """`can`, agreed by every process (one all-reduce) where forwards are collective."""
        if not self.collective():
            return can
        return on_every_rank(can, self._accelerator.device)

    def agree(self, values) -> bool:
        """Whether every process has the same integer `values` (a 1-D array of one length on all of them), by one
        all-reduce where forwards are collective (else True)."""
        if not self.collective():
            return True
        import torch.distributed as dist

        values = np.asarray(values, dtype=np.int64)
        both = torch.as_tensor(np.concatenate([values, -values]), device=self._accelerator.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        highest, lowest = both.chunk(2)
        return bool(torch.equal(highest, -lowest))
