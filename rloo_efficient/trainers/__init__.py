"""
The glue between [`rloo_efficient.core`] and TRL's group trainers: one mixin ([`mixin.GroupSharingMixin`]) that wraps
TRL's own methods and delegates to the parts a trainer holds ([`switches`], [`ranks`], [`generation`], [`packed`],
[`held_prefix`], [`rewards`], and [`profiling.trainer_profiling`]), Hydra reward adapters ([`hydra`]), our config fields
([`config`]), stock trainers profiled as ours are ([`memory_profiling`]), and the two trainers built from them
([`rloo`], [`grpo`]).
"""
