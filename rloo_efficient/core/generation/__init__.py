"""
`generate` with each prompt prefilled once ([`generate`]): the prompts' prefix tree prefilled through the packed
forward ([`tree_prefill`]), each prompt's cache kept once per group while decoding where that is faster
([`prompt_cache`]), and a tool loop's rows continuing their caches from turn to turn ([`turn_cache`]).

Imports [`tree`](../tree), [`attention`](../attention) and [`layers`](../layers).
"""
