"""An embedding's gradient on the rows its tokens touch ([`core.forward.embedding_rows`]); bit-equality with autograd
through the trainer, tied or not, is tests/test_in_place_grads.py's."""

import torch

from rloo_efficient.core.forward.embedding_rows import Tied, add_rows, distinct_rows


def test_distinct_rows_are_one_slot_per_token():
    """Each token renamed to its index's rank among the distinct ones (ascending), the spare slots past them 0."""
    distinct, renamed, ranks = distinct_rows(torch.tensor([7, 3, 7, 9, 3, 3]))
    assert distinct.tolist() == [3, 7, 9, 0, 0, 0]
    assert renamed.tolist() == [1, 0, 1, 2, 0, 0]
    assert ranks.tolist() == [0, 0, 0, 1, 1, 2]


def test_a_lookup_of_no_tokens_adds_nothing():
    """An empty lookup's gradient (a micro-batch with nothing to embed): nothing added, tied or not."""
    grad = torch.randn(40, 8)
    before = grad.clone()
    add_rows(grad, torch.zeros(0, 8), torch.zeros(0, dtype=torch.long), -1)
    weight = torch.nn.Parameter(torch.zeros(40, 8))
    weight.grad = grad
    tied = Tied(torch.zeros(0, dtype=torch.long), -1, weight)
    tied.hold()
    tied.take(torch.zeros(40, 8), 0)
    assert tied.add(torch.zeros(0, 8)) and torch.equal(grad, before)
