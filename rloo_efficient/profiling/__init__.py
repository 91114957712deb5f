"""Measuring, apart from any trainer: memory and its release ([`memory`]), the per-phase record of a run
([`phase_profiler`]), and operator and host-sync counts ([`op_count`])."""
