"""
The glue between [`rloo_efficient.core`] and TRL's group trainers: one mixin ([`mixin.GroupSharingMixin`], with the
reward phase of [`rewards`] and Hydra adapters of [`hydra`]) that wraps TRL's own methods, our config fields
([`config`]), per-phase memory profiling ([`memory_profiling`]), and the two trainers built from them ([`rloo`],
[`grpo`]).
"""
