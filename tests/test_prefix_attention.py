"""The prefix-attention backend: equal to dense-mask attention on random layouts (values and gradients), a fixed
number of operators per layer whatever k and the number of groups, no host synchronization, masks linear in the
packed length, the model's own attention where no layout is given, and any attention implementation the model was
loaded with."""

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import add_fused_lm_head

from rloo_efficient.core import prefix_attention
from rloo_efficient.core.families import attention_reason
from rloo_efficient.profiling.op_count import OpCounter
from rloo_efficient.core.packing import pack_groups, row_groups
from rloo_efficient.core.shared_generation import generate_with_shared_prefill


HEADS, KV_HEADS, DIM = 6, 2, 8  # 3 query heads per key/value head, 2 key/value heads: a wrong mapping is caught
VOCAB = 64


# -- the reference: dense-mask attention over the same flat sequence --------------------------------------------------
def stock_batch(prompt_lengths, group_of_row, scored, width_c, seed):
    """Stock TRL's (B, P + C) batch of left-padded prompts and right-padded completions, and its `rows`."""
    g = torch.Generator().manual_seed(seed)
    width_p = max(prompt_lengths)
    prompts = [torch.randint(3, VOCAB, (p,), generator=g).tolist() for p in prompt_lengths]
    ids = []
    for group in group_of_row:
        prompt = prompts[group]
        ids.append([0] * (width_p - len(prompt)) + prompt + torch.randint(3, VOCAB, (width_c,), generator=g).tolist())
    rows = row_groups([prompts[group] for group in group_of_row], scored)
    return torch.tensor(ids), rows


def dense_mask(prompt_lengths, group_of_row, scored, packed, window=None):
    """
    Independently of the layout code: which flat positions are real, and the (N, N) mask of who sees whom. Groups are
    numbered by first appearance among scored rows, rows grouped by prompt in batch order (the documented layout).
    Under a sliding `window`, a query at position p sees keys at positions (p - w, p] only, positions being the
    columns of stock's left-padded rows.
    """
    layout = packed.layout
    scored_rows = [row for row, n in enumerate(scored) if n > 0]
    groups = list(dict.fromkeys(group_of_row[row] for row in scored_rows))
    rows = sorted(scored_rows, key=lambda row: (groups.index(group_of_row[row]), row))
    length, row_length = layout.prompt_length, layout.row_length
    kind = []  # per flat position: ("body", group, index) or ("row", slot, group, index), real ones only
    for g, group in enumerate(groups):
        kind += [("body", g, j) if j < prompt_lengths[group] - 1 else None for j in range(length)]
    for slot, row in enumerate(rows):
        g = groups.index(group_of_row[row])
        kind += [("row", slot, g, c) if c < scored[row] else None for c in range(row_length)]
    n = len(kind)
    assert n == packed.num_tokens
    width_p = max(prompt_lengths)

    def column(k):  # a body token's column in stock's row, or a row token's ([prompt[-1], c0, ...] from width_p - 1)
        return width_p - prompt_lengths[groups[k[1]]] + k[2] if k[0] == "body" else width_p - 1 + k[3]

    allowed = torch.eye(n, dtype=torch.bool)  # padding sees itself (its output is never read)
    for i, qi in enumerate(kind):
        for j, kj in enumerate(kind):
            if qi is None or kj is None:
                continue
            if qi[0] == "body":
                allowed[i, j] = kj[0] == "body" and kj[1] == qi[1] and kj[2] <= qi[2]
            else:
                allowed[i, j] = (kj[0] == "body" and kj[1] == qi[2]) or (kj[0] == "row" and kj[1] == qi[1]
                                                                          and kj[3] <= qi[3])  # fmt: skip
            if window is not None and allowed[i, j]:
                allowed[i, j] = column(kj) > column(qi) - window
    return allowed, torch.tensor([k is not None for k in kind])


@st.composite
def layouts(draw):
    """1-3 groups of 1-4 rows, rows of a group not necessarily adjacent; prompts of 1-9 tokens; 0-5 scored tokens."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    prompt_lengths = [draw(st.integers(1, 9)) for _ in sizes]
    group_of_row = [g for g, size in enumerate(sizes) for _ in range(size)]
    group_of_row = draw(st.permutations(group_of_row))
    scored = [draw(st.integers(0, 5)) for _ in group_of_row]
    if not any(scored):
        scored[0] = 1
    return prompt_lengths, list(group_of_row), scored, draw(st.integers(0, 2**16))


def dense_attention(q, k, v, allowed, scale, sinks=None):
    """The reference: materialized scores over the (N, N) mask, and a sink logit per head beside them."""
    scores = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
    probs = torch.softmax(scores, -1)[..., : allowed.shape[-1]]
    return (probs @ v.repeat_interleave(q.shape[1] // v.shape[1], 1)).transpose(1, 2)


def check_against_dense(prompt_lengths, group_of_row, scored, seed, magnitude=1.0, window=None, sinks=False):
    ids, rows = stock_batch(prompt_lengths, group_of_row, scored, width_c=5, seed=seed)
    packed = pack_groups(ids, 5, rows, torch.float64)
    allowed, real = dense_mask(prompt_lengths, group_of_row, scored, packed, window)
    n = packed.num_tokens
    g = torch.Generator().manual_seed(seed)
    # Token-major, as the model lays them out
    q, k, v = (torch.randn(1, n, h, DIM, generator=g, dtype=torch.float64).transpose(1, 2).mul(magnitude)
               .requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    s_aux = torch.randn(HEADS, generator=g, dtype=torch.float64).requires_grad_() if sinks else None
    weights = torch.randn(1, n, HEADS, DIM, generator=g, dtype=torch.float64) * real.view(1, n, 1, 1)

    ours, _ = prefix_attention.prefix_attention(None, q, k, v, None, scaling=0.3, rloo_prefix_layout=packed.layout,
                                                sliding_window=window, s_aux=s_aux)  # fmt: skip
    (ours * weights).sum().backward()
    grads = [x.grad for x in (q, k, v, s_aux) if x is not None]
    leaves = [x.detach().requires_grad_() for x in (q, k, v, s_aux) if x is not None]
    ref = dense_attention(*leaves[:3], allowed, 0.3, *leaves[3:])
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours[0, real], ref[0, real], rtol=1e-10, atol=1e-12)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12 * magnitude**2)


@settings(max_examples=60, deadline=None)
@given(layout=layouts())
def test_packed_attention_equals_dense_mask_attention(layout):
    check_against_dense(*layout)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), window=st.integers(1, 15), sinks=st.booleans())
def test_packed_attention_with_a_sliding_window_and_sinks_equals_dense_attention(layout, window, sinks):
    """Windows from 1 token to longer than any sequence (prompts up to 9 tokens, completions up to 5): prompt bodies
    and rows longer than the window (the banded path), prompts partly and wholly out of a completion token's window;
    with or without a sink logit per head (its gradient too)."""
    check_against_dense(*layout, window=window, sinks=sinks)


def test_padding_slots_stay_finite_with_large_scores():
    """Groups of unequal row counts leave padding slots in the prefix layout; with scores beyond exp's range their
    probabilities must still be computed against a finite log-sum-exp (no inf * 0 = NaN in the gradients)."""
    check_against_dense([6, 4], [0, 0, 0, 1], [4, 2, 3, 5], seed=5, magnitude=30.0)


# -- a fixed number of operators, no host syncs ----------------------------------------------------------------------
def tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                         **overrides)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def count_layer_ops(model, fn):
    """Operators dispatched inside the first decoder layer's forward (and its backward) while `fn` runs."""
    layer = model.model.layers[0]
    counter = OpCounter()
    original = layer.forward

    def counted(*args, **kwargs):
        with counter:
            out = original(*args, **kwargs)
        return out

    layer.forward = counted
    try:
        fn()
    finally:
        layer.forward = original
    return counter


def packed_forward_backward(model, k, groups, uneven=False):
    prompt_length, width_c = 24, 6
    sizes = [k + g for g in range(groups)] if uneven else [k] * groups
    group_of_row = [g for g, size in enumerate(sizes) for _ in range(size)]
    ids, rows = stock_batch([prompt_length - g for g in range(groups)], group_of_row, [width_c] * len(group_of_row),
                            width_c, seed=k)  # fmt: skip
    packed = pack_groups(ids, width_c, rows, torch.float32)
    out = model(**packed.model_inputs(), fused_lm_head=True)
    packed.unpack(out.log_probs).sum().backward()


@pytest.mark.parametrize("uneven", [False, True])  # uneven: groups of different sizes, the gather layout
def test_packed_forward_operators_per_layer_do_not_depend_on_k_or_groups(uneven):
    model = tiny_llama()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    prefix_attention.install(model)
    packed_forward_backward(model, 2, 2, uneven)  # first use: each kernel configuration is checked once (host reads)
    counts = {}
    for k, groups in [(2, 2), (16, 2), (2, 4), (16, 4)]:
        counter = count_layer_ops(model, lambda: packed_forward_backward(model, k, groups, uneven))  # noqa: B023
        counts[(k, groups)] = counter.total
        assert counter.host_syncs == 0, counter.counts
    assert len(set(counts.values())) == 1, counts


def decode_rows(k, groups, interleaved=False):
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(3, VOCAB, (20 - 3 * i,), generator=g).tolist() for i in range(groups)]
    order = [i for _ in range(k) for i in range(groups)] if interleaved else [i for i in range(groups) for _ in range(k)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in order])
    mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in order])
    return ids, mask


@pytest.mark.parametrize("interleaved", [False, True])  # interleaved: a prompt's rows not adjacent, the gather layout
def test_decode_step_operators_per_layer_do_not_depend_on_k_or_groups(interleaved):
    model = tiny_llama().eval()
    config = GenerationConfig(max_new_tokens=4, min_new_tokens=4, do_sample=True, pad_token_id=0, eos_token_id=None)
    # First use: each kernel configuration is checked once (host reads), before the counted calls
    generate_with_shared_prefill(model, *decode_rows(2, 2, interleaved), prompt_cache_once=True, generation_config=config)
    counts = {}
    for k, groups in [(2, 2), (16, 2), (2, 3), (16, 3)]:
        ids, mask = decode_rows(k, groups, interleaved)
        per_call = []
        layer = model.model.layers[0]
        original = layer.forward

        def counted(*args, **kwargs):
            with OpCounter() as counter:
                out = original(*args, **kwargs)
            per_call.append(counter)
            return out

        layer.forward = counted
        try:
            generate_with_shared_prefill(model, ids, mask, prompt_cache_once=True, generation_config=config)
        finally:
            layer.forward = original
        # The first call is the shared prefill; the rest decode from the prompt cache (the first of them also creates
        # the rows' own cache)
        steps = per_call[1:]
        assert len(steps) == 4 and all(c.host_syncs == 0 for c in steps)
        assert len({c.total for c in steps[1:]}) == 1
        counts[(k, groups)] = (steps[0].total, steps[1].total)
    assert len(set(counts.values())) == 1, counts


def test_packing_dispatches_no_host_sync():
    ids, rows = stock_batch([9, 5, 1], [0, 1, 0, 2, 1, 0], [3, 0, 5, 2, 4, 1], 5, seed=0)
    with OpCounter() as counter:
        pack_groups(ids, 5, rows, torch.float32)
    assert counter.host_syncs == 0 and counter.total < 30, counter.counts


# -- memory linear in the packed length ------------------------------------------------------------------------------
def attention_peak_bytes(k, prompt_length, width_c=16, window=None):
    ids, rows = stock_batch([prompt_length], [0] * k, [width_c] * k, width_c, seed=0)
    packed = pack_groups(ids, width_c, rows, torch.float32)
    n = packed.num_tokens
    layout_bytes = sum(t.numel() * t.element_size() for t in (packed.layout.split.prefix_bias,
                       packed.layout.split.gather, packed.layout.split.scatter) if t is not None)  # fmt: skip
    q, k_, v = (torch.randn(1, n, h, DIM).transpose(1, 2).requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out, _ = prefix_attention.prefix_attention(None, q, k_, v, None, scaling=0.3, rloo_prefix_layout=packed.layout,
                                                   sliding_window=window)  # fmt: skip
        out.sum().backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return max(itertools.accumulate((b for _, b in events), initial=0)), layout_bytes, n


@pytest.mark.parametrize("window", [None, 128])  # 128: prompts 4 and 16 times longer than the window (banded)
def test_attention_memory_grows_linearly_with_the_packed_length(window):
    """Four times the packed length (prompt and k) costs about four times the attention's memory (forward and
    backward); a (L, L) mask alone would cost sixteen times (at the larger size it would be 21 MB, more than all of
    this attention's memory). The CPU kernel's workspace depends on its block sizes, hence the margin. Under a sliding
    window the banded prompt's mask is (chunks, 1, w, 2w - 1): linear in the length too."""
    small, small_layout, n_small = attention_peak_bytes(k=4, prompt_length=512, window=window)
    large, large_layout, n_large = attention_peak_bytes(k=16, prompt_length=2048, window=window)
    assert n_large == 4 * n_small + 3  # a prompt body is P - 1 tokens
    assert large / small < 5, (small, large)
    assert large < n_large**2 * 4  # less than the float32 dense mask it replaces
    assert large_layout <= 4 * small_layout  # uneven prompts add a (G, 1, 1, P) bias: linear too


# -- the model's own attention where no layout is given; any implementation loaded -----------------------------------
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_installed_model_without_a_layout_is_the_model(implementation):
    model, reference = tiny_llama(), tiny_llama()
    for m in (model, reference):
        m.config._attn_implementation = implementation
    assert prefix_attention.install(model) == 2 and prefix_attention.install(model) == 2  # idempotent
    ids = torch.randint(3, VOCAB, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                               reference(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)  # fmt: skip
    assert model.config._attn_implementation == implementation


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention", "flash_attention_2"])
def test_packed_forward_is_the_same_whatever_attention_the_model_was_loaded_with(implementation):
    """Our forwards use our backend, so a model loaded with flash or flex attention shares prompts too (their kernels
    cannot run here: the packed forward never calls them)."""
    model, reference = tiny_llama(), tiny_llama()
    model = model.double()
    reference = reference.double()
    model.config._attn_implementation = implementation
    for m in (model, reference):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    assert attention_reason(model) is None
    prefix_attention.install(model)
    ids, rows = stock_batch([9, 5], [0, 0, 1, 1, 1], [4, 2, 5, 0, 3], 5, seed=3)
    packed = pack_groups(ids, 5, rows, torch.float64)
    ours = packed.unpack(model(**packed.model_inputs(), fused_lm_head=True).log_probs)
    mask = torch.cat([ids[:, :-5] != 0, torch.arange(5).expand(5, 5) < rows[:, 2:3]], dim=1).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-5] = -100
    stock = reference(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -5:]
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-6)  # TRL's head computes in float32


def test_under_bf16_autocast_as_sdpa_is():
    """TRL's `bf16=True` trains float32 weights under autocast: rotary embeddings leave queries and keys in float32
    and values in bf16, which SDPA's autocast rule casts. Ours casts the same way, in the packed forward (with its
    backward) and while decoding from the prompt cache."""
    model = tiny_llama()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    prefix_attention.install(model)
    ids, rows = stock_batch([9, 6], [0, 0, 1, 1], [5, 3, 5, 2], 5, seed=4)
    mask = torch.cat([ids[:, :9] != 0, torch.arange(5).expand(4, 5) < rows[:, 2:3]], dim=1).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :9] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -5:]
        packed = pack_groups(ids, 5, rows, torch.bfloat16)
        ours = packed.unpack(model(**packed.model_inputs(), fused_lm_head=True).log_probs)
        ours.sum().backward()
    torch.testing.assert_close(ours, stock, rtol=0, atol=2e-2)  # bf16 attention
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)

    prompts, prompt_mask = decode_rows(3, 2)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    kwargs = dict(generation_config=config, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        stock = model.generate(input_ids=prompts, attention_mask=prompt_mask, **kwargs)
        ours = generate_with_shared_prefill(model, prompts, prompt_mask, prompt_cache_once=True, **kwargs)[0]
    for a, b in zip(stock.logits, ours.logits, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=5e-2)


def _tensors(value, found):
    """Every tensor in `value`, through dataclasses, tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            _tensors(getattr(value, name), found)
    return found


@pytest.mark.parametrize("window", [None, 4])
def test_the_packed_attention_keeps_its_sequence_in_saved_tensors_only(window):
    """Gradient checkpointing frees what an autograd node saved with `save_for_backward`, not its attributes: none of
    them may hold the keys, values or anything the size of the sequence (the layout's per-batch indices aside, which
    every layer shares). Under a window, the prompt tail's mask is built once per batch for every layer."""
    import rloo_efficient.core.prefix_attention as backend

    ids, rows = stock_batch([9, 6], [0, 0, 1, 1, 1], [5, 3, 4, 2, 5], 5, seed=0)
    packed = pack_groups(ids, 5, rows, torch.float64)
    n = packed.num_tokens
    g = torch.Generator().manual_seed(0)
    built = []
    original = backend.tail_bias
    backend.tail_bias = lambda *args: built.append(1) or original(*args)
    try:
        for _ in range(2):  # two layers, one layout
            q, k, v = (torch.randn(1, n, h, DIM, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
                       for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
            out, _ = prefix_attention.prefix_attention(None, q, k, v, None, scaling=0.3, sliding_window=window,
                                                       rloo_prefix_layout=packed.layout)  # fmt: skip
            node = out.grad_fn
            kept = _tensors({name: value for name, value in vars(node).items() if name != "layout"}, [])
            assert all(t.numel() < n for t in kept), [tuple(t.shape) for t in kept]
            assert all(t.untyped_storage().data_ptr() not in (k.untyped_storage().data_ptr(),
                                                             v.untyped_storage().data_ptr()) for t in kept)  # fmt: skip
            out.sum().backward()
    finally:
        backend.tail_bias = original
    assert len(built) == (0 if window is None else 1)
