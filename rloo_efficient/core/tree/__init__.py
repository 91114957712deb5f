"""
The structure every phase reads, built on the host in NumPy from the token lists TRL holds: the batch's rows
([`rows`]: each row's group, lengths and tokens), the prefix tree over them ([`radix`]: each run of tokens the rows
share once, no padding), its index tensors on the device ([`layout`], their types [`parts`], planned from the runs
and length buckets of [`runs`]), and which of its prompt nodes are forwarded once for several micro-batches
([`holds`], within the held-state budget: [`hold_budget`]; a no-grad pass's chunks: [`pass_chunks`]).

Imports nothing of rloo_efficient outside this folder.
"""
