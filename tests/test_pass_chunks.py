"""A no-grad pass's rows merged into chunks of at most one of stock's forwards ([`core.tree.pass_chunks`]); through
the held-prefix planning in tests/test_held_prefix.py."""

import numpy as np

from rloo_efficient.core.tree.pass_chunks import scoring_chunks


def test_split_groups_count_their_rows_and_a_group_that_fits_goes_whole_with_its_prompt():
    """Three groups in TRL's row order: two of four rows (a 10-token prompt, 3 scored tokens each) too long for one
    forward of 13 tokens (stock's width), split over two chunks each with their prompts held (counted there by their
    scored tokens alone), and a small group (a 2-token prompt, two rows of 1) in one chunk with its prompt: three
    forwards where stock's one row per chunk takes ten. Fails with a held group's prompt counted again in its chunks,
    or a held group left in one chunk (its prompt would not be held)."""
    group = np.array([0] * 4 + [1] * 4 + [2] * 2)
    plen = np.array([10] * 8 + [2] * 2)
    scored = np.array([3] * 8 + [1] * 2)
    chunks = scoring_chunks(group, plen, scored, budget=13)
    assert chunks == [(0, 3), (3, 7), (7, 10)]
    # Each chunk within the budget: its rows' scored tokens, and the prompt of a group it holds whole
    assert [int(scored[a:b].sum()) + (2 if b == 10 else 0) for a, b in chunks] == [9, 12, 7]
    # A budget of a whole group with its prompt (10 + 4 x 3): the first group goes whole into the first chunk, prompt
    # and all; the second, with nothing left there, is split and held, its last row beside the small group
    assert scoring_chunks(group, plen, scored, budget=22) == [(0, 4), (4, 7), (7, 10)]
