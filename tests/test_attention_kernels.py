"""The attention kernels with their log-sum-exp match the math reference, forward and backward, and their backward
with a merged output and log-sum-exp gives the gradients of attention over the concatenated keys."""

import pytest
import torch

from rloo_efficient.attention_kernels import attention_backward, attention_forward, math_attention


def rand(generator, *shape, dtype=torch.float64):
    """(B, L, h, D) laid out, returned as (B, h, L, D): the strides transformers hands the attention."""
    return torch.randn(*shape, generator=generator, dtype=dtype).transpose(1, 2)


# The combinations the split attention uses: prompt bodies causal without a mask, a group's queries over its padded
# prompt with a bias, each row over its own keys causal without one
@pytest.mark.parametrize("causal, with_bias", [(True, False), (False, True), (False, False)])
def test_cpu_kernel_matches_the_math_reference(causal, with_bias):
    g = torch.Generator().manual_seed(0)
    # 6 query heads on 2 key/value heads: head h reads key head h // 3, so a wrong grouping is caught
    q, k, v, grad = rand(g, 3, 7, 6, 8), rand(g, 3, 7, 2, 8), rand(g, 3, 7, 2, 8), rand(g, 3, 7, 6, 8)
    bias = None
    if with_bias:  # left padding of 2 and 3 tokens in two rows, broadcast over heads and queries
        bias = torch.zeros(3, 1, 1, 7, dtype=torch.float64)
        bias[0, ..., :2] = bias[1, ..., :3] = torch.finfo(torch.float64).min
    out, lse, state = attention_forward(q, k, v, bias, causal, 0.3)
    ref_out, ref_lse = math_attention(q, k, v, bias, causal, 0.3)
    assert state.kernel == "cpu_flash"
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    grads = attention_backward(state, grad, q, k, v, bias, out, lse, causal, 0.3)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    math_attention(*leaves, bias, causal, 0.3)[0].backward(grad)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)


def test_merged_backward_gives_the_gradient_of_attention_over_both_key_sets():
    """The identity the split attention rests on: each part's kernel backward, given the merged output and
    log-sum-exp, is that part's share of the gradient of attention over the concatenated keys."""
    g = torch.Generator().manual_seed(1)
    q, grad = rand(g, 2, 5, 6, 8), rand(g, 2, 5, 6, 8)
    k1, v1, k2, v2 = rand(g, 2, 9, 2, 8), rand(g, 2, 9, 2, 8), rand(g, 2, 5, 2, 8), rand(g, 2, 5, 2, 8)
    out1, lse1, s1 = attention_forward(q, k1, v1, None, False, 0.4)
    out2, lse2, s2 = attention_forward(q, k2, v2, None, True, 0.4)
    lse = torch.logaddexp(lse1, lse2)
    out = torch.lerp(out2, out1, torch.sigmoid(lse1 - lse2).unsqueeze(-1))
    # Reference: one attention over [k1 | k2], the second part causal
    leaves = [x.detach().requires_grad_() for x in (q, k1, v1, k2, v2)]
    mask = torch.ones(5, 14, dtype=torch.bool)
    mask[:, 9:] = torch.ones(5, 5, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], torch.cat(leaves[1::2], 2), torch.cat(leaves[2::2], 2), attn_mask=mask, scale=0.4, enable_gqa=True
    )
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    ref.backward(grad)
    dq1, dk1, dv1 = attention_backward(s1, grad, q, k1, v1, None, out, lse, False, 0.4)
    dq2, dk2, dv2 = attention_backward(s2, grad, q, k2, v2, None, out, lse, True, 0.4)
    for got, leaf in zip((dq1 + dq2, dk1, dv1, dk2, dv2), leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)


def test_a_fully_masked_row_stays_finite_and_carries_no_weight():
    """A one-token prompt beside longer ones has no key at all in the prefix part: its log-sum-exp must be so low that
    the merge gives it no weight, and nothing may be NaN."""
    g = torch.Generator().manual_seed(2)
    q, k, v = rand(g, 2, 3, 6, 8), rand(g, 2, 4, 2, 8), rand(g, 2, 4, 2, 8)
    bias = torch.zeros(2, 1, 1, 4, dtype=torch.float64)
    bias[0] = torch.finfo(torch.float64).min  # row 0: every key is padding
    out, lse, _ = attention_forward(q, k, v, bias, False, 0.3)
    assert torch.isfinite(out).all() and (lse[0] < -1e300).all() and (lse[1] > -100).all()
    assert torch.sigmoid(lse[0] - 0.0).max() == 0  # its weight in the merge against any real part
