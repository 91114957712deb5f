"""The shared generation prefill: `generate` from a once-per-prompt prefill gives the stock call's logits and samples,
forwards exactly the tokens it should, and stock generation runs (with one warning) where it cannot be exact."""

import warnings

import pytest
import torch
import trl

from rloo_efficient import RLOOTrainer
from rloo_efficient.core.generation.generate import generate_with_shared_prefill, generation_unsupported_reason
from rloo_efficient.core.generation.prompt_cache import PrefixCache, prefix_cache_unsupported_reason
from rloo_efficient.core.layers.install import installed
from rloo_efficient.core.transformers_compat import output_cache

from .conftest import assert_metrics_close, run, step_metrics, training_args
from .helpers import (
    FAMILIES,
    SYSTEM,
    TOKEN_TYPES,
    VOCAB,
    WORKLOAD_FAMILIES,
    assert_same_generation,
    build,
    generation_config,
    left_pad,
    prompts_for,
)


# Falcon-H1 keeps keys and recurrent states in one cache layer: its prompt's cache is fanned out, not kept once;
# Phi-4-mini's `generate` drops its cache past 64 positions here (the system prompt's rows reach 96)
FANNED_OUT = ("falcon_h1", "phi4_mini")


def extra_rows(extra: dict, rows: int) -> dict:
    return {key: value[:rows] for key, value in extra.items()}


def stock_and_ours(model, ids, mask, config, once=False, before_ours=None, **extra):
    kwargs = dict(generation_config=config, output_logits=True, return_dict_in_generate=True, **extra)
    torch.manual_seed(123)
    stock = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    if before_ours is not None:
        before_ours()
    torch.manual_seed(123)
    ours, prefill_tokens = generate_with_shared_prefill(model, ids, mask, prompt_cache_once=once, **kwargs)
    return stock, ours, prefill_tokens


# once=False: the prompt's cache fanned out to its rows; once=True: kept once per prompt, attention split and merged
CASES = [("llama", False), ("mistral_sliding", False), ("gemma4", False), ("qwen3_next", False), ("llama", True),
         ("qwen3", True), ("mistral", True), ("mistral_sliding", True),
         *((family, family not in FANNED_OUT) for family in [*FAMILIES, *WORKLOAD_FAMILIES])]
SLIDING = ("mistral_sliding", "gemma3_sliding", "gpt_oss_sliding", "cohere2", "olmo3", "gemma3_vlm", "gemma4", "exaone4",
           "gemma2")


@pytest.mark.parametrize("arch", ["llama", "mistral_sliding"])
def test_adjacent_groups_of_different_sizes_each_read_their_own_prompt_kept_once(arch):
    """Rows grouped prompt after prompt, 3, 1 and 2 of them: with each prompt kept once, every row's split attention
    reads its own prompt. Fails with equally many rows per prompt assumed wherever the rows are adjacent (the second
    prompt's row would read the first's)."""
    model = build(arch)
    ids, mask = left_pad(prompts_for("uneven_groups"))
    config = generation_config(max_new_tokens=12 if arch in SLIDING else 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing falls back to fanning out
        stock, ours, prefill_tokens = stock_and_ours(model, ids, mask, config, once=True)
    assert prefill_tokens > 0 and isinstance(output_cache(ours), PrefixCache)
    assert output_cache(ours).split.rows_per_group is None  # (not a view of the batch: the groups are uneven)
    assert_same_generation(stock, ours, arch, config.max_new_tokens)


# Whose prompts are prefilled as their prefix tree: caches of keys and values or latents (not recurrent states)
NO_TREE_PREFILL = ("qwen3_next", "olmo_hybrid", "nemotron_h", "granitemoehybrid", "falcon_h1", "lfm2",
                   "qwen3_5", "qwen3_5_moe", "kimi_linear")


@pytest.mark.parametrize("layout", ["equal_lengths", "mixed_lengths", "one_apart", "interleaved", "system_prompt"])
@pytest.mark.parametrize("arch, once", CASES)
def test_same_logits_and_samples_as_generate(arch, once, layout):
    """Plain generate's samples and logits from each distinct prompt prefilled once, with its cache fanned out or kept
    once. With a system prompt (70 tokens, then tasks of 20, 13 and 1), the distinct prompts are prefilled as their
    prefix tree: the system prompt once for the call, each task's remainder after it, no padding."""
    from rloo_efficient.core.generation.tree_prefill import tree_prefill_reason

    model = build(arch)
    ids, mask = left_pad(prompts_for(layout))
    # With a window, 12 new tokens: late ones see none of the prompt, and only the last 8 of their own
    config = generation_config(max_new_tokens=12 if arch in SLIDING else 6)
    # A multimodal family's processor returns all-zero token types with text prompts, which TRL passes to generate
    extra = {TOKEN_TYPES[arch]: torch.zeros_like(ids)} if arch in TOKEN_TYPES else {}
    before_ours = None
    if arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_vl", "glm4v"):  # an earlier generate (of other rows) leaves its rope offsets
        before_ours = lambda: model.generate(input_ids=ids[:2], attention_mask=mask[:2], generation_config=config,  # noqa: E731
                                             **extra_rows(extra, 2))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing falls back (to fanning out, or to the math path)
        stock, ours, prefill_tokens = stock_and_ours(model, ids, mask, config, once, before_ours, **extra)
    assert prefill_tokens > 0
    if layout == "system_prompt" and arch in NO_TREE_PREFILL:  # each distinct prompt once, padded
        assert tree_prefill_reason(model) is not None and prefill_tokens == 3 * (ids.shape[1] - 1)
    elif layout == "system_prompt":  # the system prompt once, each task but its last token (generate's first input)
        assert tree_prefill_reason(model) is None and prefill_tokens == SYSTEM + (20 - 1) + (13 - 1) + 0
    assert_same_generation(stock, ours, arch, config.max_new_tokens)


@pytest.mark.parametrize("lengths, new_tokens", [((65, 40), 4), ((60, 30), 10)])
def test_longrope_prefill_chooses_its_factors_as_generates(lengths, new_tokens):
    """LongRoPE (Phi-4-mini, long factors past 64 positions): stock's prefill of a 65-wide batch takes the long
    factors, where a prefill of its first 64 columns would take the short ones; Phi-3's `generate` would drop such a
    cache when the sequence reaches 65 and forward every row again, so none is prefilled. A 60-wide batch decoding 10
    tokens crosses 64, where `generate` drops the cache too (the prompt's cache fanned out: kept once, it could not
    serve that)."""
    model = build("phi4_mini")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]
    ids, mask = left_pad([prompts[0]] * 3 + [prompts[1]] * 3)
    config = generation_config(max_new_tokens=new_tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fanned-out cache's warning
        stock, ours, prefill_tokens = stock_and_ours(model, ids, mask, config, once=True)
    assert prefill_tokens == (0 if ids.shape[1] == 65 else 2 * (ids.shape[1] - 1))
    assert_same_generation(stock, ours, "phi4_mini", new_tokens)


TOOL_TURN_FAMILIES = ("llama", "qwen3", "mistral_sliding", "gemma3_sliding", "gpt_oss_sliding", "cohere2", "gemma4",
                      "qwen2_vl", "granite")


@pytest.mark.parametrize("arch", TOOL_TURN_FAMILIES)
def test_a_tool_turn_shares_what_its_rows_still_share(arch):
    """A later turn of a tool loop: every row its own history (the prompt, its completion, the tool's answer, the
    template's generation prompt), rows that stopped earlier shorter, no two alike. The rows still share the system
    prompt: prefilled once as their tree, each row's own history after it (windows of 8 shorter than every history).
    Same samples and logits as plain generate."""
    model = build(arch)
    g = torch.Generator().manual_seed(5)
    own = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (9, 30, 0, 17, 4, 22)]  # a row may add nothing
    prompts = prompts_for("system_prompt")
    histories = [prompt + extra for prompt, extra in zip(prompts, own, strict=True)]
    histories[2] = histories[2] + [3]  # then no two rows are alike: a third turn's row
    ids, mask = left_pad(histories)
    config = generation_config(max_new_tokens=12 if arch in SLIDING else 6)
    extra = {TOKEN_TYPES[arch]: torch.zeros_like(ids)} if arch in TOKEN_TYPES else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stock, ours, prefill_tokens = stock_and_ours(model, ids, mask, config, None, **extra)
    # The tree: the system prompt once, then each row's task and own tokens but its last (generate's first input); a
    # task of 20 tokens or fewer saves less than a node must (tree.MIN_SAVED_TOKENS) and is copied into its rows
    assert prefill_tokens == SYSTEM + sum(len(history) - 1 - SYSTEM for history in histories)
    assert_same_generation(stock, ours, arch, config.max_new_tokens)


def test_the_tree_prefill_runs_under_the_models_mixed_precision_wrapper():
    """accelerate's bf16 (TRL's default) wraps the model's `forward` in autocast, and `generate`'s prefill runs inside
    it: so does the tree prefill (a call of the model's decoder alone would skip it and cache float32 values). Its keys
    and values equal the padded prefill's at every real position, to bf16's rounding."""
    from types import MethodType

    from accelerate.utils import convert_outputs_to_fp32

    from rloo_efficient.core.generation.generate import prefill_prompts
    from rloo_efficient.core.generation.tree_prefill import plan_tree_prefill, tree_prefill

    model = build("llama", dtype=torch.float32)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model.forward = MethodType(convert_outputs_to_fp32(autocast(model.forward.__func__)), model)  # as accelerate does
    prompts = prompts_for("system_prompt")
    ids, mask = left_pad(prompts)
    first, width = [0, 2, 4], ids.shape[1]
    cache = tree_prefill(model, plan_tree_prefill(prompts, first, width))
    reference = prefill_prompts(model, ids, mask, first, padded=True)
    for ours, stock in zip(cache.layers, reference.layers, strict=True):
        # Values in bf16 (keys leave the rotary embedding in float32, in stock's cache as in ours)
        assert (ours.keys.dtype, ours.values.dtype) == (stock.keys.dtype, stock.values.dtype)
        assert stock.values.dtype == torch.bfloat16
        for row, prompt in enumerate(prompts[i] for i in first):
            real = slice(width - len(prompt), width - 1)  # the prompt's columns but its last
            for got, want in ((ours.keys, stock.keys), (ours.values, stock.values)):
                torch.testing.assert_close(got[row, :, real].float(), want[row, :, real].float(), rtol=2e-2, atol=2e-2)


def test_the_tree_prefill_forwards_each_shared_token_once():
    """What the embedding is given: the prefix tree's tokens once, then generate's steps (the last prompt column, then
    one token a row), against stock's every prompt at full width."""
    model = build("llama")
    ids, mask = left_pad(prompts_for("system_prompt"))
    rows, width = ids.shape
    config = generation_config(eos_token_id=None)
    counts, hook = count_tokens(model)
    torch.manual_seed(0)
    generate_with_shared_prefill(model, ids, mask, prompt_cache_once=True, generation_config=config)
    hook.remove()
    assert sum(counts) == SYSTEM + 19 + 12 + rows * config.max_new_tokens
    assert rows * width + rows * (config.max_new_tokens - 1) > 4 * sum(counts)  # stock's


@pytest.mark.parametrize("once", [False, True])
def test_a_config_naming_the_dynamic_cache(once):
    """`cache_implementation="dynamic"` names the default's cache; generate refuses it beside a cache passed in, so
    the shared prefill passes a copy of the config without it (the user's config is left as it was)."""
    model = build("llama")
    ids, mask = left_pad(prompts_for("mixed_lengths"))
    config = generation_config(cache_implementation="dynamic")
    stock, ours, tokens = stock_and_ours(model, ids, mask, config, once)
    assert tokens > 0 and torch.equal(ours.sequences, stock.sequences)
    assert config.cache_implementation == "dynamic"


@pytest.mark.parametrize("once", [False, True])
def test_same_logits_in_float32_eager(once):
    model = build("llama", dtype=torch.float32, attention="eager")
    ids, mask = left_pad(prompts_for("mixed_lengths"))
    stock, ours, _ = stock_and_ours(model, ids, mask, generation_config(), once)
    assert torch.equal(ours.sequences, stock.sequences)
    for a, b in zip(stock.logits, ours.logits, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)  # float32, different matmul shapes


def count_tokens(model):
    counts = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda module, args: counts.append(args[0].numel()))
    return counts, hook


@pytest.mark.parametrize("once", [False, True])
@pytest.mark.parametrize("layout", ["equal_lengths", "mixed_lengths"])
def test_each_prompt_is_prefilled_once(layout, once):
    model = build("llama")
    prompts = prompts_for(layout)
    ids, mask = left_pad(prompts)
    rows, width = ids.shape
    distinct = len({tuple(p) for p in prompts})
    config = generation_config(eos_token_id=None)  # no early stop: every call runs max_new_tokens steps
    steps = config.max_new_tokens
    counts, hook = count_tokens(model)
    torch.manual_seed(0)
    model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    stock = sum(counts)
    counts.clear()
    torch.manual_seed(0)
    generate_with_shared_prefill(model, ids, mask, prompt_cache_once=once, generation_config=config)
    hook.remove()
    # stock: B prompts of W tokens, then B tokens for each later step; ours: each distinct prompt's W - 1 tokens once,
    # then the last prompt column, then the same decoding
    assert stock == rows * width + rows * (steps - 1)
    assert sum(counts) == distinct * (width - 1) + rows * steps


def test_nothing_to_share_is_plain_generate():
    model = build("llama")
    ids, mask = left_pad(prompts_for("mixed_lengths")[::2])  # three distinct prompts, one row each
    stock, ours, prefill_tokens = stock_and_ours(model, ids, mask, generation_config())
    assert prefill_tokens == 0 and torch.equal(ours.sequences, stock.sequences)


@pytest.mark.parametrize(
    "config_overrides, model_overrides, reason",
    [
        ({"cache_implementation": "static"}, {}, "cache_implementation='static'"),
        ({"num_beams": 2, "do_sample": False}, {}, "beam search"),
        ({"use_cache": False}, {}, "use_cache=False"),
        ({}, {"attention_dropout": 0.1}, "dropout is active"),
    ],
)
def test_unsupported_reasons(config_overrides, model_overrides, reason):
    model = build("llama")
    for key, value in model_overrides.items():
        setattr(model.config, key, value)
    assert reason in generation_unsupported_reason(model, generation_config(**config_overrides))


def test_supported_models_have_no_reason():
    for arch in ("llama", "mistral_sliding", "qwen3", "gemma4", "qwen2_vl"):
        assert generation_unsupported_reason(build(arch), generation_config()) is None
    for arch in ("llama", "qwen3", "mistral", "mistral_sliding"):
        assert prefix_cache_unsupported_reason(build(arch)) is None
    # One list gates every path: a family outside it (GPT-2) gets no shared prefill either
    assert "only verified" in generation_unsupported_reason(build("gpt2"), generation_config())
    assert "only verified" in prefix_cache_unsupported_reason(build("gpt2"))


def test_models_whose_prompt_cache_cannot_be_kept_once_say_why():
    """The trainer keeps the prompt's cache once only where this says nothing: told to keep it once, generation fails
    for these (Falcon-H1's layers are no attention layers a split can read)."""
    assert "Falcon-H1's parallel blocks" in prefix_cache_unsupported_reason(build("falcon_h1"))
    assistant = build("gemma4")
    config = assistant.config.get_text_config(decoder=True)
    config.num_kv_shared_layers = config.num_hidden_layers  # every layer "reuse", none "store": an assistant model's
    try:
        modes = config.kv_sharing_modes
    except ValueError:  # transformers 5.23 refuses such a config itself (5.25 builds it)
        return
    assert "store" not in modes
    assert "no layer of this model stores" in prefix_cache_unsupported_reason(assistant)


def test_a_tokens_key_and_value_bytes_are_what_a_cache_stores_per_token():
    """[`kv_token_bytes`] (what holding a prompt token costs the hold planner), from the config alone: the bytes a
    forward's cache stores per token, keys and values, Gemma 4's layers that read another's counted as nothing and its
    global layers at their wider heads, a hybrid's recurrent layers (a state per sequence) and Nemotron-H's MLP layers
    as nothing, multi-head latent attention's latents (DeepSeek-V3; Kimi-Linear beside recurrent layers). Under-counting
    would hold more prompts than the budget allows, over-counting fewer."""
    from transformers import DynamicCache

    from rloo_efficient.core.generation.prompt_cache import kv_token_bytes

    rows, tokens = 2, 6  # fewer tokens than every window (8): each layer stores every one
    for arch in ("llama", "mistral_sliding", "gemma4", "gpt_oss_sliding", "qwen3_next", "nemotron_h", "falcon_h1",
                 "deepseek_v3", "kimi_linear"):  # fmt: skip
        model = build(arch)
        config = model.config.get_text_config(decoder=True)
        cache = DynamicCache(config=config)
        with torch.no_grad():
            model(input_ids=torch.randint(12, VOCAB, (rows, tokens)), past_key_values=cache, use_cache=True)
        # (a recurrent layer has states, no keys)
        stored = {id(t): t.numel() * t.element_size() for layer in cache.layers
                  for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                  if t is not None and t.numel()}  # fmt: skip
        expected = rows * tokens * kv_token_bytes(config, next(model.parameters()).element_size())
        assert sum(stored.values()) == expected, arch


def test_prompt_cache_once_keeps_one_copy_and_leaves_the_model_as_it_was():
    model = build("llama")
    ids, mask = left_pad(prompts_for("mixed_lengths"))  # 3 prompts, 2 rows each
    reference = build("llama")
    seen = {}

    def record_cache(module, args, kwargs, output):
        cache = output_cache(output)
        if isinstance(cache, PrefixCache):
            seen["prefix_rows"] = cache.layers[0].prefix_keys.shape[0]
            seen["rows"] = cache.layers[0].keys.shape[0]

    hook = model.model.register_forward_hook(record_cache, with_kwargs=True)
    generate_with_shared_prefill(model, ids, mask, prompt_cache_once=True, generation_config=generation_config())
    hook.remove()
    assert seen == {"prefix_rows": 3, "rows": 6}
    # The model's own config and attention are untouched: a plain forward is the model's own
    assert model.config._attn_implementation == "sdpa" and installed(model)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                               reference(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)  # fmt: skip


def test_trainer_falls_back_with_one_warning(workload, stock_run, tmp_path):
    cfg, path, dataset = workload
    args = training_args(tmp_path, cache_implementation="static")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(RLOOTrainer, path, args, dataset)
    messages = [str(w.message) for w in caught if "shared generation prefill is off" in str(w.message)]
    assert len(messages) == 1 and "cache_implementation='static'" in messages[0]
    assert ours.shared_prefill_tokens == 0


@pytest.mark.parametrize("prefill, once", [(True, True), (True, False), (False, True)])
def test_trainer_switches(workload, stock_run, tmp_path, prefill, once):
    cfg, path, dataset = workload
    args = training_args(tmp_path, share_generation_prefill=prefill, share_prompt_kv_cache=once)
    ours = run(RLOOTrainer, path, args, dataset)
    assert list(ours._logs["completion"]) == list(stock_run._logs["completion"])
    assert (ours.shared_prefill_tokens > 0) == prefill
    assert ours._switches.prompt_cache_once == (prefill and once)


@pytest.mark.parametrize("keeps", [True, False])
def test_trainer_default_chooses_per_call_by_the_cost_model(workload, stock_run, tmp_path, monkeypatch, keeps):
    """`share_prompt_kv_cache=None` (the default): each generate call keeps the prompt's cache once where the cost
    model says it reads enough fewer bytes (here forced either way through the break-even), else fans it out; both
    give stock's completions."""
    import rloo_efficient.core.generation.generate as shared_generation
    import rloo_efficient.core.generation.prompt_cache as prefix_cache

    cfg, path, dataset = workload
    monkeypatch.setitem(prefix_cache.BREAK_EVEN_BYTES, "cpu", 0 if keeps else float("inf"))
    built = []
    monkeypatch.setattr(shared_generation, "PrefixCache", lambda *a, **kw: built.append(1) or PrefixCache(*a, **kw))
    ours = run(RLOOTrainer, path, training_args(tmp_path, share_prompt_kv_cache=None), dataset)
    assert ours._switches.prompt_cache_once is None and ours.shared_prefill_tokens > 0
    assert list(ours._logs["completion"]) == list(stock_run._logs["completion"])
    assert bool(built) == keeps


def test_the_cost_model_keeps_a_prompt_once_where_its_copies_would_read_more_than_the_split_costs(monkeypatch):
    from transformers import DynamicCache

    from rloo_efficient.core.generation.prompt_cache import BREAK_EVEN_BYTES, keep_prompt_once

    def prefilled(distinct, length, layers=2, dtype=torch.float32):
        cache = DynamicCache()
        for layer in range(layers):
            cache.update(torch.zeros(distinct, 2, length, 16, dtype=dtype), torch.zeros(distinct, 2, length, 16,
                                                                                          dtype=dtype), layer)  # fmt: skip
        return cache

    import types

    from rloo_efficient.core.generation import prompt_cache as prefix_cache

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    device_memory = types.SimpleNamespace(total_memory=141e9)  # an H200's
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: device_memory)
    per_token = 2 * 2 * 16 * 4  # a layer's key and value bytes per prompt token (2 heads of 16, float32)
    even = BREAK_EVEN_BYTES["cpu"] / per_token / 7  # prompt tokens at which one prompt's 7 copies reach it
    assert not keep_prompt_once(prefilled(1, int(even) - 1), 8, cpu)
    assert keep_prompt_once(prefilled(1, int(even) + 1), 8, cpu)
    assert not keep_prompt_once(prefilled(1, int(even) + 1, dtype=torch.float16), 8, cpu)  # half the bytes
    assert not keep_prompt_once(prefilled(2, int(even) + 1), 8, cpu)  # two prompts of 4 rows: 3 copies each
    assert not keep_prompt_once(prefilled(8, 10**4), 8, cpu)  # every row its own prompt: nothing to skip
    assert not keep_prompt_once(prefilled(1, int(even) + 1), 8, cuda)  # launches cost more there
    assert keep_prompt_once(prefilled(1, int(BREAK_EVEN_BYTES["cuda"] / per_token / 15) + 1, layers=1), 16, cuda)
    # Steps replayed from a graph: the split attention's operators cost no launches, so fewer skipped bytes repay it
    replayed = prefix_cache.REPLAYED_BREAK_EVEN_BYTES["cuda"] / per_token / 7
    assert replayed < BREAK_EVEN_BYTES["cuda"] / per_token / 7
    assert not keep_prompt_once(prefilled(1, int(replayed) - 1, layers=1), 8, cuda, replayed=True)
    assert keep_prompt_once(prefilled(1, int(replayed) + 1, layers=1), 8, cuda, replayed=True)
    assert not keep_prompt_once(prefilled(1, int(replayed) + 1, layers=1), 8, cuda)
    assert keep_prompt_once(prefilled(1, int(even) + 1), 8, cpu, replayed=True)  # no replayed figure: the eager one
    # On a device of 80 MB, copies of more than 8 MB in all (2 layers): kept once however few bytes a step skips
    device_memory.total_memory = 80e6
    assert prefix_cache.MEMORY_SHARE * 80e6 == 8e6
    assert not keep_prompt_once(prefilled(1, int(8e6 / per_token / 7 / 2) - 1), 8, cuda)
    assert keep_prompt_once(prefilled(1, int(8e6 / per_token / 7 / 2) + 1), 8, cuda)


def test_continuous_batching_generates_as_stock_and_every_other_phase_shares(workload, stock_run, tmp_path):
    """`use_transformers_continuous_batching=True`: generation is stock TRL's own backend (its paged cache shares
    prompt blocks already; ours' shared prefill stays off), and the log-prob and training passes are ours, packed:
    stock's completions and metrics, run the same way."""
    cfg, path, dataset = workload
    settings = dict(use_transformers_continuous_batching=True, max_steps=2)
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "stock", config_class=trl.RLOOConfig, **settings),
                dataset)  # fmt: skip
    with pytest.warns(UserWarning, match="generation runs stock TRL's transformers' continuous batching backend"):
        ours = run(RLOOTrainer, path, training_args(tmp_path / "ours", **settings), dataset)
    assert not ours._switches.prefill and not ours._switches.prompt_cache_once and ours.shared_prefill_tokens == 0
    assert ours.packed_forward_tokens > 0  # the packed log-prob and training passes ran
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    assert_metrics_close(step_metrics(stock), step_metrics(ours), 1e-6, 1e-8)


def test_a_sliding_layer_keeps_its_rows_last_tokens_only():
    """As transformers' sliding cache layer does, a sliding layer of the prompt cache keeps the last w - 1 of its rows'
    decoded tokens (their attention reads them and the new one), whatever the number of steps; a full layer all."""
    model = build("gemma3_sliding")  # window 8: layer 0 slides, layer 1 does not
    ids, mask = left_pad(prompts_for("mixed_lengths"))
    seen = []

    def record(module, args, kwargs, output):
        cache = output_cache(output)
        if isinstance(cache, PrefixCache):
            seen.append([(layer.keys.shape[-2], layer.own_length) for layer in cache.layers])

    hook = model.model.register_forward_hook(record, with_kwargs=True)
    config = generation_config(max_new_tokens=14, min_new_tokens=14, eos_token_id=None)
    generate_with_shared_prefill(model, ids, mask, prompt_cache_once=True, generation_config=config)
    hook.remove()
    (kept_sliding, decoded), (kept_full, _) = seen[-1]
    assert decoded == 14 and kept_sliding == 8 - 1 and kept_full == 14
