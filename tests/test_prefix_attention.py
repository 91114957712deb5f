"""The prefix-attention backend in a model: a fixed number of operators per layer whatever k and the number of groups,
no host synchronization, memory linear in the packed length, the model's own attention where no layout is given, and
any attention implementation the model was loaded with. (Attention over random trees against a dense mask:
`tests/test_tree.py`.)"""

import itertools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import GenerationConfig
from trl.trainer.utils import add_fused_lm_head

from rloo_efficient.core.attention import backend as prefix_attention
from rloo_efficient.core.forward.packing import pack_rows
from rloo_efficient.core.generation.generate import generate_with_shared_prefill
from rloo_efficient.core.layers.families import attention_reason
from rloo_efficient.core.layers.install import install
from rloo_efficient.core.tree import runs as tree_runs
from rloo_efficient.profiling.op_count import OpCounter

from .helpers import DIM, HEADS, KV_HEADS, VOCAB, stock_batch, tiny_llama


# -- a fixed number of operators, no host syncs ----------------------------------------------------------------------
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
    # Every prompt shared (23 tokens by 2 rows or more); completions that open alike by chance (random tokens from 61)
    # not: a tree of depth 2 in every case
    packed = pack_rows(ids, width_c, rows, min_saved=8)
    assert packed.tree.depth.max() == 1
    out = model(**packed.model_inputs(), fused_lm_head=True)
    packed.unpack(out.log_probs).sum().backward()


@pytest.mark.parametrize("uneven", [False, True])  # uneven: groups of different sizes, the gather layout
def test_packed_forward_operators_per_layer_do_not_grow_with_k_or_groups(uneven, monkeypatch):
    model = tiny_llama()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install(model)
    shapes = [(2, 2), (16, 2), (2, 4), (16, 4)]

    def per_layer():
        for k, groups in shapes:  # first use: each kernel configuration is checked once (host reads)
            packed_forward_backward(model, k, groups, uneven)
        counts = {}
        for k, groups in shapes:
            counter = count_layer_ops(model, lambda: packed_forward_backward(model, k, groups, uneven))  # noqa: B023
            counts[(k, groups)] = counter.total
            assert counter.host_syncs == 0, counter.counts
        return counts

    # Many rows: one call per length bucket, the same calls whatever the number of rows and groups; few rows: nodes a
    # few padding slots apart share a call (fewer calls, never more)
    counts = per_layer()
    assert counts[(16, 2)] == counts[(16, 4)] == max(counts.values()) > counts[(2, 2)], counts
    # The ratio alone (no small-call merging) would split the uneven groups' subtrees by size at small k
    monkeypatch.setattr(tree_runs, "SMALL_PADDING", 0)
    assert per_layer()[(16, 4)] == counts[(16, 4)]


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
            _, shared = generate_with_shared_prefill(model, ids, mask, prompt_cache_once=True, generation_config=config)
            assert shared > 0
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
        pack_rows(ids, 5, rows)
    assert counter.host_syncs == 0 and counter.total < 30, counter.counts


# -- memory linear in the packed length ------------------------------------------------------------------------------
def attention_peak_bytes(k, prompt_length, width_c=16, window=None):
    ids, rows = stock_batch([prompt_length], [0] * k, [width_c] * k, width_c, seed=0)
    packed = pack_rows(ids, width_c, rows)
    n = packed.num_tokens
    layout_bytes = sum(t.numel() * t.element_size() for t in _tensors(packed.layout, []))
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
    assert large_layout < 4.1 * small_layout  # the index tensors: linear in the tokens too


# -- the model's own attention where no layout is given; any implementation loaded -----------------------------------
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_installed_model_without_a_layout_is_the_model(implementation):
    model, reference = tiny_llama(), tiny_llama()
    for m in (model, reference):
        m.config._attn_implementation = implementation
    assert install(model) == 2 and install(model) == 2  # idempotent
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
    install(model)
    ids, rows = stock_batch([9, 5], [0, 0, 1, 1, 1], [4, 2, 5, 0, 3], 5, seed=3)
    packed = pack_rows(ids, 5, rows)
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
    install(model)
    ids, rows = stock_batch([9, 6], [0, 0, 1, 1], [5, 3, 5, 2], 5, seed=4)
    mask = torch.cat([ids[:, :9] != 0, torch.arange(5).expand(4, 5) < rows[:, 2:3]], dim=1).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :9] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -5:]
        packed = pack_rows(ids, 5, rows)
        ours = packed.unpack(model(**packed.model_inputs(), fused_lm_head=True).log_probs)
        ours.sum().backward()
    torch.testing.assert_close(ours, stock, rtol=0, atol=2e-2)  # bf16 attention
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)

    prompts, prompt_mask = decode_rows(3, 2)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    kwargs = dict(generation_config=config, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        stock = model.generate(input_ids=prompts, attention_mask=prompt_mask, **kwargs)
        ours, shared = generate_with_shared_prefill(model, prompts, prompt_mask, prompt_cache_once=True, **kwargs)
    assert shared > 0  # the shared prefill ran (not stock's generate)
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
    import rloo_efficient.core.attention.tree as tree_attention

    ids, rows = stock_batch([9, 6], [0, 0, 1, 1, 1], [5, 3, 4, 2, 5], 5, seed=0)
    packed = pack_rows(ids, 5, rows, min_saved=0)
    n = packed.num_tokens
    g = torch.Generator().manual_seed(0)
    biases = []
    original = tree_attention._keys_of

    def recording(*args):
        keys, bias = original(*args)
        biases.append(bias)
        return keys, bias

    tree_attention._keys_of = recording
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
        tree_attention._keys_of = original
    # Every layer's forward and backward read the same bias per level, built once (the prompts' nodes are of other
    # lengths: a padding mask, or the window's)
    assert len(packed.layout.parts) == 1 and len(biases) == 4
    assert biases[0] is not None and all(bias is biases[0] for bias in biases)
