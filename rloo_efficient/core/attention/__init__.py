"""
One attention function for training, scoring and decoding ([`backend`], registered in transformers' attention
interface): attention over a packed prefix tree ([`tree`]), merged by log-sum-exp, on the fused kernels
([`kernels`], flash's variable-length calls in [`varlen`]) checked at first use ([`checks`]), sliding windows and
sinks ([`windows`]), and the state a held prompt's forward leaves for later micro-batches, with its banked gradient
([`held`]).

Imports [`tree`](../tree) only.
"""
