"""Each row's KV cache continued across the turns of a tool loop: the same samples and logits as plain `generate` on
every turn, only the tokens added since a row's previous turn forwarded, nothing continued that should not be."""

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from rloo_efficient.core.generation.turn_cache import TurnCaches, continue_reason, plan_continuation
from rloo_efficient.core.transformers_compat import output_cache

from .helpers import (
    assert_same_generation,
    build,
    tool_loop,
)


# Families whose cache holds keys and values: each row's cache continues. Windows of 8, shorter than every history
# (a new token reads only its window's held keys; sinks on GPT-OSS's)
CONTINUED = ("llama", "qwen3", "phi3", "olmo2", "smollm3", "granite", "qwen3_moe", "seed_oss", "glm4_moe",
             "ernie4_5_moe", "minimax_m2", "qwen2_vl", "qwen2_5_vl", "mistral_sliding", "gemma3_sliding",
             "gpt_oss_sliding", "cohere2", "olmo3", "gemma3_vlm", "gemma4", "deepseek_v3")  # fmt: skip
# Recurrent states: each later turn prefilled as before (each row padded)
NOT_CONTINUED = ("qwen3_next",)


@pytest.mark.parametrize("once", [None, True])
@pytest.mark.parametrize("arch", CONTINUED)
def test_each_later_turn_forwards_only_what_its_rows_added(arch, once):
    """Every later turn: plain generate's samples and logits, from each row's cache continued (its tokens up to its
    end token; the first turn's prompt held once per group or fanned out to its rows), forwarding exactly the tokens
    added since (the end of its completion, the tool's answer, the generation prompt)."""
    assert continue_reason(build(arch)) is None
    turns = TurnCaches(budget=1 << 40)
    for turn, (stock, ours, tokens, added, histories) in enumerate(tool_loop(arch, turns, once=once)):
        assert_same_generation(stock, ours, arch, len(stock.logits))
        if turn:
            assert tokens == added
    assert turns.take() is not None  # the last turn's caches held, for a next turn
    assert turns.held is None


# 16 new tokens a turn past windows of 8, the first turn's prompt kept once: a windowed layer keeps its whole history
# (held for the next turn), and each step reads only the window's last keys of the row's own
@pytest.mark.parametrize("arch", ["mistral_sliding", "gemma3_sliding", "gpt_oss_sliding"])
def test_decoding_past_the_window_of_a_layer_kept_whole(arch, monkeypatch):
    from rloo_efficient.core.attention import backend

    cut, decode = [], backend._decode_attention

    def counting(module, query, key, value, cache, window, sinks, scale):
        cut.append(window is not None and key.shape[2] > window)
        return decode(module, query, key, value, cache, window, sinks, scale)

    monkeypatch.setattr(backend, "_decode_attention", counting)
    for stock, ours, *_ in tool_loop(arch, TurnCaches(budget=1 << 40), once=True, new_tokens=16):
        assert_same_generation(stock, ours, arch, len(stock.logits))
    assert any(cut)


def test_a_row_whose_history_changed_continues_nothing():
    """A row whose tokens changed inside what its cache holds is prefilled whole (a stale cache would read keys of
    tokens it no longer has); the others continue theirs. Same samples and logits as plain generate."""
    turns = TurnCaches(budget=1 << 40)
    for turn, (stock, ours, tokens, added, histories) in enumerate(tool_loop("llama", turns, stale=True)):
        assert_same_generation(stock, ours, "llama", len(stock.logits))
        if turn:
            assert tokens == added


def test_matching_rows_to_held_rows():
    """On the host: each row continues the held row whose tokens open it, in order; a changed or unknown row none."""
    from rloo_efficient.core.generation.turn_cache import HeldCache

    held_tokens = [np.array(t) for t in ([5, 6, 7], [5, 6, 8], [5, 6, 7, 9], [2, 2])]
    held = HeldCache(held_tokens, [], [], *(np.zeros(4, dtype=np.int64) for _ in range(4)))
    plan = plan_continuation(held, [[5, 6, 8, 1, 1], [5, 6, 7, 9], [5, 0, 7, 9, 4], [2, 2, 3]])
    # Row 0 extends held row 1 (not row 0, which shares only its first two tokens); row 1 is held row 2 exactly, and
    # keeps its last token for generate; row 2 changed inside; row 3 extends held row 3
    assert plan.source.tolist() == [1, 2, -1, 3]
    assert plan.reused.tolist() == [3, 3, 0, 2]
    assert plan_continuation(held, [[9, 9, 9]]) is None


@pytest.mark.parametrize("arch", ["llama", "mistral_sliding"])
def test_caches_over_the_budget_are_not_held(arch):
    """Over the budget nothing is held; a windowed model's call, whose whole histories would not fit (estimated before
    it), keeps only its windows, as stock's."""
    turns = TurnCaches(budget=1000)  # bytes: less than one layer's keys
    for turn, (stock, ours, tokens, added, histories) in enumerate(tool_loop(arch, turns)):
        assert_same_generation(stock, ours, arch, len(stock.logits))
        assert turns.held is None
        windowed = any(type(layer) is DynamicSlidingWindowLayer for layer in output_cache(ours).layers)
        assert windowed == (arch == "mistral_sliding")
    assert turns.over_budget == 3


def test_ranks_in_step_hold_no_cache_between_turns(tmp_path):
    """Where every forward gathers sharded parameters (ZeRO-3, FSDP), no cache is held from turn to turn (one rank
    continuing its rows while another prefills whole histories would gather different modules): each later turn
    prefills its rows' histories, with plain generate's samples and logits (one process in step with itself)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        turns = TurnCaches(budget=1 << 40)
        for turn, (stock, ours, tokens, added, histories) in enumerate(tool_loop("llama", turns, synced=True)):
            assert_same_generation(stock, ours, "llama", len(stock.logits))
            assert turns.held is None
            if turn:
                assert tokens > added  # more than the tokens added since each row's previous turn
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", NOT_CONTINUED)
def test_other_caches_prefill_each_later_turn(arch):
    """Recurrent states: later turns prefilled as before, nothing held."""
    assert continue_reason(build(arch)) is not None
    turns = TurnCaches(budget=1 << 40)
    for turn, (stock, ours, tokens, added, histories) in enumerate(tool_loop(arch, turns)):
        assert_same_generation(stock, ours, arch, len(stock.logits))
        assert turns.held is None


def test_a_tool_loop_under_bf16_autocast(monkeypatch):
    """Under accelerate's bf16 autocast (TRL's default mixed precision), Qwen3's keys leave its q/k norms and rotary
    embedding in float32: stock's cache stores them so, ours in bf16, as attention reads them ([`ReadDtypeCache`]: a
    third less), and a continued prefill lays the model's float32 keys into that bf16 cache. Stock's samples, its logits
    to bf16's rounding of the prefill's other shapes, only the added tokens forwarded."""
    from types import MethodType

    from accelerate.utils import convert_outputs_to_fp32

    from rloo_efficient.core.transformers_compat import output_cache

    from . import helpers

    def autocast_model(arch):  # as accelerate wraps the policy's forward
        model = build(arch, dtype=torch.float32)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        model.forward = MethodType(convert_outputs_to_fp32(autocast(model.forward.__func__)), model)
        return model

    monkeypatch.setattr(helpers, "build", autocast_model)
    for turn, (stock, ours, tokens, added, _) in enumerate(tool_loop("qwen3", TurnCaches(budget=1 << 40), once=True)):
        assert torch.equal(ours.sequences, stock.sequences)
        for a, b in zip(stock.logits, ours.logits, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-2)  # 2e-3 apart here: bf16's rounding
        if turn:
            assert tokens == added
        assert output_cache(stock).layers[0].keys.dtype == torch.float32
        assert {layer.keys.dtype for layer in output_cache(ours).layers} == {torch.bfloat16}


def test_a_windowed_models_whole_history_bytes_are_what_its_turn_cache_stores():
    """What [`windows_over_budget`] estimates before a call, per row and token, from the config: the bytes the call's
    cache then stores (every layer's whole history, Gemma 4's layers reading another's none, its global layers wider);
    nothing for a model without windows. Under-counting would keep whole histories past the budget."""
    from rloo_efficient.core.generation.turn_cache import _whole_token_bytes, turn_cache

    rows, tokens = 2, 20  # past every window (8): a windowed layer of stock's cache would keep 7
    for arch in ("llama", "mistral_sliding", "gemma4", "gpt_oss_sliding"):
        model = build(arch)
        cache = turn_cache(model)
        with torch.no_grad():
            model(input_ids=torch.randint(12, 60, (rows, tokens)), past_key_values=cache, use_cache=True)
        stored = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                     if t is not None)  # fmt: skip
        assert _whole_token_bytes(model) * rows * tokens == (0 if arch == "llama" else stored), arch


def test_a_held_layer_is_released_as_soon_as_it_is_copied(monkeypatch):
    """A continued turn copies each layer's held keys and values into the new cache's storage and releases that
    layer's held ones before the next layer's storage is made: one layer's keys alive twice at most, not the cache's."""
    from rloo_efficient.core.generation import turn_cache as module

    events, copy, zeros = [], module._copy_held, torch.Tensor.new_zeros

    class Watched(list):
        def __setitem__(self, index, value):
            if value is None:
                events.append("R")
            super().__setitem__(index, value)

    def making(self, *args, **kwargs):
        events.append("M")
        return zeros(self, *args, **kwargs)

    def watching(cache, held, *args):
        held.own = Watched(held.own)
        monkeypatch.setattr(torch.Tensor, "new_zeros", making)
        try:
            return copy(cache, held, *args)
        finally:
            monkeypatch.setattr(torch.Tensor, "new_zeros", zeros)
            events.append("|")

    monkeypatch.setattr(module, "_copy_held", watching)
    for _ in tool_loop("llama", TurnCaches(budget=1 << 40)):
        pass
    calls = "".join(events).split("|")[:-1]
    layers = build("llama").config.num_hidden_layers
    # Two later turns; per layer its keys' and values' storage made, then its held ones released
    assert calls == ["MMR" * layers] * 2
