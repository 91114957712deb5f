"""The attention kernels with their log-sum-exp match the math reference, forward and backward, and their backward
with a merged output and log-sum-exp gives the gradients of attention over the concatenated keys."""

import warnings

import pytest
import torch

from rloo_efficient.core.attention import checks, kernels, varlen
from rloo_efficient.core.attention.checks import attention_backward, attention_forward
from rloo_efficient.core.attention.kernels import math_attention
from rloo_efficient.core.forward.packing import pack_rows
from rloo_efficient.core.layers.install import install
from rloo_efficient.core.tree import layout as layouts
from rloo_efficient.core.tree.radix import build_tree


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


# -- the first-use check ---------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_checks(monkeypatch):
    """No configuration checked or disabled yet (the module keeps them for the process)."""
    monkeypatch.setattr(checks, "_status", {})


USES = ("causal", "prefix", "decode")


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 64), (4, 4, 128)])
# A bias (prompt padding) comes with the non-causal uses only: causal calls attend within one unpadded sequence
# (use, masked): a bias (prompt padding by key, a sliding window by query) comes with the non-causal uses only
@pytest.mark.parametrize("use, masked", [("causal", None), ("prefix", None), ("prefix", "by key"),
                                         ("prefix", "by query"), ("decode", None), ("decode", "by key")])  # fmt: skip
def test_the_check_passes_the_cpu_kernel_for_every_use_also_under_autocast(dtype, heads, kv_heads, dim, use, masked,
                                                                           autocast):  # fmt: skip
    """The check runs the same code on the CPU kernel as on a GPU's: under TRL's default bf16 autocast too, where a
    reference computed in the caller's autocast would be rounded to bf16 and reject a correct kernel."""
    config = ("cpu_flash", torch.device("cpu"), dtype, heads, kv_heads, dim, masked, use)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert checks.check_kernel(config) is None


def test_the_check_rejects_a_kernel_that_is_slightly_wrong(monkeypatch):
    """A kernel whose log-sum-exp or gradient is off (here: the log-sum-exp of the wrong scale, a key gradient
    halved) fails its check, with what was off."""
    forward, backward = kernels._kernel_forward, kernels._kernel_backward
    config = ("cpu_flash", torch.device("cpu"), torch.bfloat16, 8, 2, 64, "by key", "prefix")
    monkeypatch.setattr(kernels, "_kernel_forward", lambda *a: (lambda o, l, s: (o, l * 1.01, s))(*forward(*a)))
    assert "log-sum-exp off by" in checks.check_kernel(config)
    monkeypatch.setattr(kernels, "_kernel_forward", forward)
    monkeypatch.setattr(kernels, "_kernel_backward", lambda *a: (lambda q, k, v: (q, k / 2, v))(*backward(*a)))
    assert "key gradient off by" in checks.check_kernel(config)


@pytest.mark.parametrize("use", ["varlen causal", "varlen causal window", "varlen"])
def test_the_variable_length_check_rejects_a_kernel_that_is_slightly_wrong(monkeypatch, use):
    """The variable-length calls' check (flash's on CUDA): the reference passes; a kernel whose log-sum-exp is off, or
    whose key gradient is, or that ignores the window, fails, with what was off."""
    config = ("math_varlen", torch.device("cpu"), torch.float32, 8, 2, 64, None, use)
    assert checks.check_kernel(config) is None
    forward, backward = varlen.math_varlen_forward, varlen.math_varlen_backward
    monkeypatch.setattr(varlen, "math_varlen_forward", lambda *a: (lambda o, l: (o, l * 1.01))(*forward(*a)))
    assert "log-sum-exp off by" in checks.check_kernel(config)
    monkeypatch.setattr(varlen, "math_varlen_forward", forward)
    monkeypatch.setattr(varlen, "math_varlen_backward", lambda *a: (lambda q, k, v: (q, k / 2, v))(*backward(*a)))
    assert "key gradient off by" in checks.check_kernel(config)
    monkeypatch.setattr(varlen, "math_varlen_backward", backward)
    if use == "varlen causal window":
        monkeypatch.setattr(varlen, "math_varlen_forward", lambda *a: forward(*a[:-1], None))  # no window
        assert "output off by" in checks.check_kernel(config)


@pytest.mark.parametrize("failure", ["check", "raises", "raises_folded"])
def test_variable_length_calls_that_fail_leave_the_tree_to_its_buckets(fresh_checks, monkeypatch, failure):
    """A variable-length kernel that fails its first-use check: the packed forward pads its length buckets instead;
    one that raises after its check: that call and later ones in the buckets (the nodes' call, or the one folded call
    reading every ancestor's keys). The same attention either way, and one warning per configuration, naming the
    kernel."""
    from .conftest import emulate_varlen
    from .helpers import check_against_dense

    calls = emulate_varlen(monkeypatch)
    if failure != "raises_folded":  # the nodes' call and the level's (not the one folded call)
        monkeypatch.setattr(layouts, "FOLD_COPIES", 0)
    rows = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11, 12], [3, 4, 13], [3, 4, 14, 15]]
    tree = build_tree(rows, min_saved=0)
    if failure == "check":
        monkeypatch.setattr(checks, "check_varlen", lambda config: "did not match the float64 reference: output off")
    else:
        monkeypatch.setattr(checks, "check_varlen", lambda config: None)  # it passed its check
        reference = varlen.math_varlen_forward

        def raising(*args):
            if not raised:
                raised.append(True)
                raise RuntimeError("a kernel that changed under us")
            return reference(*args)

        raised = []
        monkeypatch.setattr(varlen, "math_varlen_forward", raising)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            check_against_dense(tree, 0)
    messages = [str(w.message) for w in caught if "attention kernel" in str(w.message)]
    # One warning per configuration: both fail their check (the nodes' causal call, the level's), or the nodes' call
    # raises (then its buckets run, in this forward and the next) while the level's runs on, in both forwards; or the
    # folded call raises (its causal configuration disabled: the nodes' buckets and the level's call, in both)
    uses = ["varlen causal", "varlen)"] if failure == "check" else ["varlen causal"]
    assert len(messages) == len(uses) and all(use in message for use, message in zip(uses, messages))
    assert all("math_varlen on cpu" in message and "padded length buckets" in message for message in messages)
    assert calls == ([] if failure == "check" else ["math_varlen"] * 3)


def packed_grads(model, ids, rows, width_c):
    packed = pack_rows(ids, width_c, rows, min_saved=0)
    model.zero_grad()
    out = model(**packed.model_inputs(), fused_lm_head=True)
    packed.unpack(out.log_probs).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("error", [TypeError, RuntimeError, NotImplementedError])
def test_a_kernel_that_raises_later_falls_back_to_the_math_path_without_a_crash(fresh_checks, monkeypatch, where,
                                                                                error):  # fmt: skip
    """A kernel that passed its check and raises later (a new shape, a changed signature): that configuration runs
    the math path from then on, with one warning naming the kernel and the error, and the gradients are the same."""
    from trl.trainer.utils import add_fused_lm_head

    from .helpers import stock_batch, tiny_llama

    model = tiny_llama().to(torch.float64)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install(model)
    ids, rows = stock_batch([9, 5], [0, 0, 1, 1], [3, 4, 2, 4], 4, seed=0)
    expected = packed_grads(model, ids, rows, 4)
    original = getattr(kernels, f"_kernel_{where}")

    def raising(*args):
        if getattr(args[0], "kernel", args[0]) == "cpu_flash":  # the forward's first argument, or the backward's state
            raise error("a kernel that changed under us")
        return original(*args)

    monkeypatch.setattr(kernels, f"_kernel_{where}", raising)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # one warning per configuration, not per call
            got = packed_grads(model, ids, rows, 4)
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    messages = [str(w.message) for w in caught if "attention kernel" in str(w.message)]
    assert messages and all("cpu_flash on cpu" in m and f"raised {error.__name__}" in m for m in messages)
    assert len(messages) == len(set(messages)) == sum(reason is not None for reason in checks._status.values())


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_running_out_of_memory_in_a_kernel_is_not_hidden(fresh_checks, monkeypatch, where):
    """The math path needs more memory than the kernel: an out-of-memory error propagates (as for stock's SDPA)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = rand(g, 2, 5, 4, 8), rand(g, 2, 5, 2, 8), rand(g, 2, 5, 2, 8)
    out, lse, state = attention_forward(q, k, v, None, True, 0.3)  # checked and used
    original = getattr(kernels, f"_kernel_{where}")

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(kernels, f"_kernel_{where}", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        if where == "forward":
            attention_forward(q, k, v, None, True, 0.3)
        else:
            attention_backward(state, q, q, k, v, None, out, lse, True, 0.3)
    assert all(reason is None for reason in checks._status.values()) and original


@pytest.mark.parametrize("query_length", [1, 7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_heads_folded_into_the_query_length_give_the_same_attention(fresh_checks, monkeypatch, query_length,
                                                                            with_bias):  # fmt: skip
    """The fold the CUDA efficient kernel gets (no grouped-query heads: the query heads that share a key/value head
    read it as one longer query sequence), run here on the CPU kernel: forward and backward equal the reference."""
    monkeypatch.setattr(kernels, "FOLDED_KERNELS", ("cpu_flash",))
    g = torch.Generator().manual_seed(3)
    q, grad = rand(g, 3, query_length, 6, 8), rand(g, 3, query_length, 6, 8)
    k, v = rand(g, 3, 11, 2, 8), rand(g, 3, 11, 2, 8)
    bias = None
    if with_bias:
        bias = torch.zeros(3, 1, 1, 11, dtype=torch.float64)
        bias[0, ..., :4] = bias[2, ..., :1] = torch.finfo(torch.float64).min
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fold that raised would fall back to the math path with a warning
        out, lse, state = attention_forward(q, k, v, bias, False, 0.3)
        token_major = lse.transpose(1, 2).contiguous().transpose(1, 2)
        grads = attention_backward(state, grad, q, k, v, bias, out, token_major, False, 0.3)
    assert state.kernel == "cpu_flash" and state.folded
    ref_out, ref_lse = math_attention(q, k, v, bias, False, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    math_attention(*leaves, bias, False, 0.3)[0].backward(grad)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)
    # A causal call is never folded (its mask depends on where each query sits)
    assert not attention_forward(q[:, :, :1], k[:, :, :1], v[:, :, :1], None, True, 0.3)[2].folded
