"""
The packed forwards: a log-prob or training pass over TRL's chunks ([`passes`]), each chunk's rows as their prefix
tree, their log-probs unpacked into stock TRL's layout ([`packing`]), reward models' rows ([`reward`]), and a scope of
micro-batches holding prompts across them ([`scope`]; under FSDP2, [`sharded`]).

Imports [`tree`](../tree), [`attention`](../attention) and [`layers`](../layers).
"""
