"""Measuring, apart from any trainer: memory and its release ([`memory`]), the per-phase record of a run
([`phase_profiler`]), the part a trainer holds to profile its phases and write their files ([`trainer_profiling`]),
self-describing results files ([`results`]), and operator and host-sync counts ([`op_count`])."""
