"""
What each model's layers need over the tree beyond attention, and which models are served: recurrent layers forked
along the tree ([`recurrent`], their kernels checked by [`recurrent_checks`]), the MoE load-balancing loss of packed
tokens ([`moe`]), images once per group ([`vision`]), the families each path serves and why others cannot
([`families`]), and installing our attention and forks on a model ([`install`]).

Imports [`tree`](../tree) and [`attention`](../attention).
"""
