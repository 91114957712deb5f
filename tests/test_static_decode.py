"""
Decoding from static buffers ([`core.generation.static_decode`]): the same samples and logits as plain `generate`
for each family it takes (the shared prefill's cache fanned out, or each row its own), the random generator left where
`generate` leaves it when rows finish early, one host read per 8 steps and none inside a step, buffers at fixed
addresses; one warning naming why where it steps aside; through the trainer as stock TRL runs.
"""

import warnings

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DummyLayer, LinearAttentionLayer

from rloo_efficient import RLOOTrainer
from rloo_efficient.core.generation import static_checks, static_decode
from rloo_efficient.core.generation.generate import generate_with_shared_prefill
from rloo_efficient.core.generation.static_buffers import StaticHybridLayer, StaticLayer, StaticPrefixLayer
from rloo_efficient.core.generation.static_decode import StaticStep
from rloo_efficient.core.transformers_compat import output_cache
from rloo_efficient.profiling.op_count import OpCounter

from .conftest import assert_metrics_close, per_micro_batch, run, step_metrics, training_args
from .helpers import (
    SYSTEM,
    TOKEN_TYPES,
    VOCAB,
    assert_same_generation,
    assert_same_run,
    build,
    generation_config,
    grpo_args,
    left_pad,
    prompts_for,
    tool_loop,
)


@pytest.fixture(autouse=True)
def warnings_afresh():
    """Each test sees the warnings its calls give (they are given once per reason and process)."""
    static_checks._warnings.clear()


def static_and_stock(model, ids, mask, config, once=False, **extra):
    """Stock `generate` and ours (static decoding, the prompt fanned out or with `once` kept once per group), each from
    seed 123; with each one's output, the next draw of the random generator after it."""
    kwargs = dict(generation_config=config, output_logits=True, return_dict_in_generate=True, **extra)
    torch.manual_seed(123)
    stock = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    stock_next = torch.rand(4)
    torch.manual_seed(123)
    ours, tokens = generate_with_shared_prefill(model, ids, mask, prompt_cache_once=once, static=True, **kwargs)
    assert tokens > 0  # the shared prefill ran
    return stock, stock_next, ours, torch.rand(4)


# Families whose cache is plain per-row keys and values and whose decoding inputs are generate's own: MLA (DeepSeek-V3),
# experts (float32), per-head norms, absolute positions (GPT-2), NoPE layers, Granite's multipliers
FAMILIES = ("llama", "qwen3", "gpt2", "olmo2", "granite", "smollm3", "qwen3_moe", "deepseek_v3", "seed_oss", "glm4_moe",
            # sliding windows of 8 (shorter than the prompts and the 12 tokens decoded): every layer's (Mistral), every
            # other layer's (a mask per attention type), with GPT-OSS's sinks and experts
            "mistral_sliding", "gemma3_sliding", "gpt_oss_sliding", "cohere2", "olmo3", "exaone4",
            "gemma2",  # attention-logit softcap, eager attention (float32)
            "phi3",  # its own decoding inputs, generate's within its original context (4096)
            "gemma4",  # layers reading an earlier layer's keys and values (no cache of their own), windows
            "falcon_h1",  # attention and a Mamba mixer in one layer, its own logits_to_keep
            # hybrids: recurrent and convolution states of a fixed size, updated in place by transformers
            "qwen3_next", "olmo_hybrid", "granitemoehybrid", "lfm2", "kimi_linear")


# The prompt kept once per group: the rows' own keys in static buffers (windows step aside: see below; GPT-2's
# attention is not ours, so its prompt is never kept once)
CASES = [*((arch, False) for arch in FAMILIES), *((arch, True) for arch in (*FAMILIES[:10], *FAMILIES[-5:])
                                                if arch != "gpt2")]


# No padding (generate then drops the mask), left padding, a system prompt prefilled once as the prompts' tree
@pytest.mark.parametrize("layout", ["equal_lengths", "mixed_lengths", "system_prompt"])
@pytest.mark.parametrize("arch, once", CASES)
def test_same_logits_and_samples_as_generate(monkeypatch, arch, once, layout):
    """Stock's samples and logits; every tensor the cache's layers hold is among the step's buffers (what a graph
    keeps the addresses of, and what the capture's side stream records)."""
    steps = []
    call = StaticStep.__call__
    monkeypatch.setattr(StaticStep, "__call__", lambda self: steps.append(self) or call(self))
    model = build(arch)
    ids, mask = left_pad(prompts_for(layout))
    config = generation_config(max_new_tokens=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # static decoding ran: no fallback's warning
        stock, _, ours, _ = static_and_stock(model, ids, mask, config, once)
    kinds = {StaticLayer if type(layer) is StaticHybridLayer else type(layer)  # (Falcon-H1's: states and keys)
             for layer in output_cache(ours).layers} - {LinearAttentionLayer, DummyLayer}  # as they were
    assert kinds == {StaticPrefixLayer if once else StaticLayer}
    assert_same_generation(stock, ours, arch, config.max_new_tokens)
    assert output_cache(ours).get_seq_length() == output_cache(stock).get_seq_length()
    held = [getattr(layer, "keys", None) for layer in output_cache(ours).layers]
    for layer in output_cache(ours).layers:  # a recurrent layer's states, in dicts by state index
        held += [*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values()]
    assert {id(tensor) for tensor in held if tensor is not None} <= {id(tensor) for tensor in steps[-1].buffers()}


@pytest.mark.parametrize("new_tokens", [12, 50])
def test_longrope_decodes_static_within_its_original_context(monkeypatch, new_tokens):
    """Phi-4-mini's LongRoPE (long factors past 64 positions) from a 20-wide prompt batch: 12 tokens stay within the
    context: static decoding (the factors chosen on the device each step, as in `generate`'s loop: no host read in a
    step, which a graph capture would refuse); 50 cross it, where Phi-3's own decoding inputs drop the cache:
    `generate`'s loop, with one warning naming why. Both stock's samples."""
    syncs = []
    call = StaticStep.__call__

    def counted(self):
        with OpCounter() as ops:
            logits = call(self)
        syncs.append(ops.host_syncs)
        return logits

    monkeypatch.setattr(StaticStep, "__call__", counted)
    model = build("phi4_mini")
    ids, mask = left_pad(prompts_for("mixed_lengths"))
    config = generation_config(max_new_tokens=new_tokens, suppress_tokens=[1])  # every row decodes every token
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock, _, ours, _ = static_and_stock(model, ids, mask, config)
    aside = [str(w.message) for w in caught if "static decoding is off" in str(w.message)]
    assert_same_generation(stock, ours, "phi4_mini", new_tokens)
    if new_tokens == 12:
        assert not aside and all(type(layer) is StaticLayer for layer in output_cache(ours).layers)
        assert syncs == [0] * new_tokens
    else:
        assert len(aside) == 1 and "passes its original context (64 positions)" in aside[0] and not syncs


@pytest.mark.parametrize("eos, steps", [(list(range(1, 40)), None), (list(range(1, 12)), None), ([1], 20)])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_rows_finishing_early_leave_the_random_generator_as_generate_does(attention, eos, steps):
    """Rows finishing at different steps (padding after their EOS), all of them before the last step at a step that is
    no multiple of 8 (the loop reads back every 8): the steps past it are cut and their draws undone, so the next draw
    after ours is the one after stock's. Eager attention takes an additive mask (float32: stock's eager attention
    gives NaN for float64 rows with left padding)."""
    model = build("llama", dtype=torch.float64 if attention == "sdpa" else torch.float32, attention=attention)
    ids, mask = left_pad(prompts_for("mixed_lengths"))
    config = generation_config(max_new_tokens=20, eos_token_id=eos)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # static decoding ran
        stock, stock_next, ours, ours_next = static_and_stock(model, ids, mask, config)
    assert all(type(layer) is StaticLayer for layer in output_cache(ours).layers)
    finished = stock.sequences.shape[1] - ids.shape[1]
    if steps is None:
        assert finished < 20 and finished % 8  # stopped early, between two read-backs
    else:
        assert finished == steps
    assert_same_generation(stock, ours, "gemma2" if attention == "eager" else "llama", finished)
    torch.testing.assert_close(ours_next, stock_next, rtol=0, atol=0)
    # the returned cache's length is stock's: the positions forwarded up to the finish (not those of the steps past it)
    assert output_cache(ours).get_seq_length() == output_cache(stock).get_seq_length()


def test_a_step_reads_nothing_back_and_writes_in_place(monkeypatch):
    """Inside a step: no host synchronization, the cache's buffers and the mask at the same addresses; over a call of
    16 tokens, two read-backs (after steps 8 and 16) where stock's `generate` reads one per token."""
    model = build("llama")
    ids, mask = left_pad(prompts_for("mixed_lengths"))
    config = generation_config(max_new_tokens=16, suppress_tokens=[1])  # no row stops: all 16 steps run
    steps, addresses = [], set()
    call = StaticStep.__call__

    def counted(self):
        with OpCounter() as ops:
            logits = call(self)
        steps.append(ops.host_syncs)
        addresses.add((self.mask.data_ptr(), *(layer.keys.data_ptr() for layer in self.cache.layers)))
        return logits

    monkeypatch.setattr(StaticStep, "__call__", counted)
    decode = static_decode._decode
    loops = []

    def counted_decode(*args):
        with OpCounter() as ops:
            output = decode(*args)
        loops.append(ops)
        return output

    monkeypatch.setattr(static_decode, "_decode", counted_decode)
    generate_with_shared_prefill(model, ids, mask, prompt_cache_once=False, static=True, generation_config=config)
    with OpCounter() as stock:
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert steps == [0] * 16 and len(addresses) == 1
    # The two checks (`nonzero`) and the finished step's index at the last, where the length criterion stops every row
    assert loops[0].counts["aten::nonzero"] == 2 and loops[0].host_syncs == 3
    assert stock.host_syncs >= 16


def test_the_rows_copies_of_the_prompt_are_allocated_once_at_their_final_size(monkeypatch):
    """Fanned out for static decoding, the buffers are filled from the prefill's one row per distinct prompt, each
    layer's rows gathered straight into its buffers of the call's width: no fanned-out copy of every layer first (a
    caching allocator would then hold both sets: the fanned-out blocks, freed one by one, are a little too small for
    the next layer's buffer). Generate's loop, where static decoding steps aside, gets the rows fanned out."""
    rows = []
    build_cache = static_decode.static_cache
    monkeypatch.setattr(static_decode, "static_cache", lambda cache, *args: rows.append(
        {layer.keys.shape[0] for layer in cache.layers}) or build_cache(cache, *args))  # fmt: skip
    model = build("llama")
    ids, mask = left_pad(prompts_for("equal_lengths"))  # 6 rows, 2 distinct prompts
    stock, _, ours, _ = static_and_stock(model, ids, mask, generation_config(max_new_tokens=4))
    assert_same_generation(stock, ours, "llama", 4)
    assert rows == [{2}] and output_cache(ours).layers[0].keys.shape[0] == 6


@pytest.mark.parametrize(
    "arch, once, reason",
    [
        ("mistral_sliding", True, "sliding window over the prompt kept once"),
    ],
)
def test_steps_aside_with_one_warning_naming_why(arch, once, reason):
    model = build(arch)
    ids, mask = left_pad(prompts_for("mixed_lengths"))
    config = generation_config(max_new_tokens=10)
    extra = {TOKEN_TYPES[arch]: torch.zeros_like(ids)} if arch in TOKEN_TYPES else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock, stock_next, ours, ours_next = static_and_stock(model, ids, mask, config, once, **extra)
        static_and_stock(model, ids, mask, config, once, **extra)  # a second call: no second warning
    messages = [str(w.message) for w in caught if "static decoding is off" in str(w.message)]
    assert len(messages) == 1 and reason in messages[0]
    assert_same_generation(stock, ours, arch, config.max_new_tokens)  # generate's own loop
    torch.testing.assert_close(ours_next, stock_next, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["qwen3", "mistral_sliding"])
def test_every_row_its_own_prompt_decodes_from_its_own_cache(arch):
    """A tool loop's later turn: no two rows alike, the system prompt prefilled once as their tree, each row's cache its
    own (nothing fanned out), decoded from static buffers. With a window (8) shorter than the histories, each layer
    kept its last keys alone, which the buffers put back at their positions (fails with them written from column 0),
    and 12 new tokens decode past the window."""
    model = build(arch)
    g = torch.Generator().manual_seed(5)
    own = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (9, 30, 0, 17, 4, 22)]
    histories = [prompt + extra for prompt, extra in zip(prompts_for("system_prompt"), own, strict=True)]
    histories[2] = histories[2] + [3]
    ids, mask = left_pad(histories)
    config = generation_config(max_new_tokens=12 if arch == "mistral_sliding" else 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stock, _, ours, _ = static_and_stock(model, ids, mask, config)
    assert all(type(layer) is StaticLayer for layer in output_cache(ours).layers)
    assert_same_generation(stock, ours, arch, config.max_new_tokens)
    assert SYSTEM < ids.shape[1]


@pytest.mark.parametrize("arch, once", [("llama", False), ("llama", True), ("granite", False),
                                        ("gemma3_sliding", False)])  # fmt: skip
def test_tool_turns_continue_their_caches_from_static_buffers(arch, once):
    """Three turns of a tool loop (rows ending at different steps, each later turn continuing each row's held cache):
    plain generate's samples and logits every turn, each decoded from static buffers (the first turn's prompt fanned
    out or kept once), the next turn continuing the keys and values they hold, forwarding only what its rows added."""
    from rloo_efficient.core.generation.turn_cache import TurnCaches

    turns = TurnCaches(budget=1 << 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for turn, (stock, ours, tokens, added, _) in enumerate(tool_loop(arch, turns, once=once, static=True)):
            kept_once = once and turn == 0  # the first turn's prompt once per group; later turns each row its own
            assert all(type(layer) is (StaticPrefixLayer if kept_once else StaticLayer) for layer in output_cache(ours).layers)
            assert_same_generation(stock, ours, arch, len(stock.logits))
            if turn:
                assert tokens == added


class EmulatedGraph:
    """On CPU, what `capture` returns on CUDA: `replay()` runs the step again into one output buffer (a real replay
    writes the captured step's output buffer in place); `wrong` adds an error to each replay's output."""

    def __init__(self, step, wrong: bool):
        self.step, self.wrong, self.replays = step, wrong, 0
        # Capture runs nothing: the step's buffers (a hybrid's states too) as they were before it
        buffers = step.buffers()
        saved = [buffer.clone() for buffer in buffers]
        self.output = step()
        for buffer, value in zip(buffers, saved, strict=True):
            buffer.copy_(value)

    def replay(self):
        self.replays += 1
        self.output.copy_(self.step() + (1.0 if self.wrong else 0.0))


@pytest.fixture
def emulated_graphs(monkeypatch):
    """The graph path (`GraphedStep`) on CPU: capture and warm-up emulated, the rest of it as on CUDA."""
    graphs = []

    def capture(step, device, wrong=False, fails=False):
        if fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        graphs.append(EmulatedGraph(step, wrong))
        return graphs[-1], graphs[-1].output

    monkeypatch.setattr(static_decode, "CAPTURE_DEVICES", ("cpu",))
    monkeypatch.setattr(static_decode, "warm_up", lambda step, device, buffers=(): step())
    monkeypatch.setattr(static_decode, "capture", capture)
    return graphs


@pytest.fixture
def prompts_kept_once(monkeypatch):
    """The cost model's break-evens set so that only replayed steps keep a prompt once (0 bytes replayed, an eager one
    no prompt reaches); returns the list that gets an entry for each prompt cache kept once."""
    import rloo_efficient.core.generation.generate as shared_generation
    from rloo_efficient.core.generation import prompt_cache

    monkeypatch.setitem(prompt_cache.BREAK_EVEN_BYTES, "cpu", float("inf"))
    monkeypatch.setitem(prompt_cache.REPLAYED_BREAK_EVEN_BYTES, "cpu", 0)
    built = []

    class Recorded(prompt_cache.PrefixCache):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(shared_generation, "PrefixCache", Recorded)
    return built


# Hybrids too: a step advances their recurrent states in place, so the check's eager step must start from the states
# the replay started from
@pytest.mark.parametrize("arch, fault", [("llama", None), ("llama", "wrong"), ("llama", "fails"), ("qwen3_next", None),
                                         ("lfm2", None), ("falcon_h1", None)])  # fmt: skip
def test_graph_replays_are_checked_against_the_eager_step_at_first_use(emulated_graphs, monkeypatch, arch, fault):
    """Each call's step captured once (after an eager warm-up that gives the first token) and replayed: stock's samples
    and logits. On the model's first call, the first replays are checked against the eager step; a replay that
    differs, or a step that cannot be captured, returns to the eager step (the same samples) with one warning naming
    why, and later calls are not captured again."""
    if fault is not None:
        capture = static_decode.capture
        monkeypatch.setattr(static_decode, "capture", lambda step, device: capture(step, device, **{fault: True}))
    model = build(arch)
    ids, mask = left_pad(prompts_for("mixed_lengths"))
    config = generation_config(max_new_tokens=10)
    eager_steps = []
    call = StaticStep.__call__
    monkeypatch.setattr(StaticStep, "__call__", lambda self: eager_steps.append(1) or call(self))
    for attempt in range(2):
        eager_steps.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stock, _, ours, _ = static_and_stock(model, ids, mask, config)
        assert_same_generation(stock, ours, arch, config.max_new_tokens)
        messages = [str(w.message) for w in caught if "not from a CUDA graph" in str(w.message)]
        if fault is None:  # the warm-up, the capture (emulated: runs it), replays; the first call checks 3 of them
            assert not messages and emulated_graphs[-1].replays == 9
            assert len(eager_steps) == 2 + 9 + (static_decode.CHECKED_STEPS if attempt == 0 else 0)
        elif attempt == 0:
            reason = "differs from the eager step" if fault == "wrong" else "cannot be captured (RuntimeError"
            assert len(messages) == 1 and reason in messages[0]
        else:  # not captured again: the eager step throughout, no second warning
            assert not messages and len(eager_steps) == 10
    assert len(emulated_graphs) == (2 if fault is None else 1 if fault == "wrong" else 0)


@pytest.mark.parametrize("captured, split", [(False, False), (True, False), (True, True)])
def test_static_decoding_by_default_where_steps_are_captured(monkeypatch, request, captured, split):
    """`static=None` (the trainer's default): static decoding where the device's steps are captured as graphs (CUDA;
    here a CPU with capture emulated), `generate`'s loop elsewhere, and for a model split across devices (a capture
    runs on one stream)."""
    graphs = request.getfixturevalue("emulated_graphs") if captured else []
    calls = []
    decode = static_decode._decode
    monkeypatch.setattr(static_decode, "_decode", lambda *args: calls.append(1) or decode(*args))
    model = build("llama")
    if split:
        model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}
    ids, mask = left_pad(prompts_for("mixed_lengths"))
    generate_with_shared_prefill(model, ids, mask, static=None, generation_config=generation_config(max_new_tokens=4))
    assert len(calls) == len(graphs) == (captured and not split)


@pytest.mark.parametrize("arch, captured, kept", [("llama", True, True), ("llama", False, False),
                                                  ("qwen3_next", True, True), ("mistral_sliding", True, False)])
def test_the_cost_model_takes_the_replayed_break_even_where_kept_once_steps_replay(prompts_kept_once, request, arch,
                                                                                   captured, kept):  # fmt: skip
    """`prompt_cache_once=None`: the break-even of steps replayed from a graph where the call's steps would replay
    with the prompt kept once (here 0 bytes, against an eager break-even no prompt reaches), the eager one where they
    would not: `generate`'s loop, or a cache static decoding cannot hold kept once (windows); stock's samples."""
    if captured:
        request.getfixturevalue("emulated_graphs")
    model = build(arch)
    ids, mask = left_pad(prompts_for("mixed_lengths"))
    config = generation_config(max_new_tokens=6)
    stock, _, ours, _ = static_and_stock(model, ids, mask, config, once=None)
    assert bool(prompts_kept_once) == kept
    assert_same_generation(stock, ours, arch, config.max_new_tokens)


def test_a_prefix_caches_layer_types_are_known_before_it_is_built():
    """`PrefixCache.layer_types` (what the cost model asks static decoding about) names the layers a built cache
    holds: keys and values kept once, recurrent states, layers reading another's keys (Gemma 4)."""
    from rloo_efficient.core.generation import prompt_cache
    from rloo_efficient.core.generation.generate import prefill_prompts

    seen = set()
    for arch in ("llama", "qwen3_next", "gemma4", "kimi_linear"):
        model = build(arch)
        prompts = prompts_for("mixed_lengths")  # three prompts of two rows each
        ids, mask = left_pad(prompts)
        prefilled = prefill_prompts(model, ids, mask, [0, 2, 4], True)
        sources = prompt_cache.kv_sources(model.config.get_text_config(decoder=True))
        expected = prompt_cache.PrefixCache.layer_types(prefilled, sources)
        lengths = [len(prompts[row]) - 1 for row in (0, 2, 4)]
        cache = prompt_cache.PrefixCache(prefilled, [0, 0, 1, 1, 2, 2], lengths, ids.shape[1] - 1, sources)
        assert [type(layer) for layer in cache.layers] == expected, arch
        seen.update(expected)
    assert prompt_cache.SharedPrefixLayer in seen and any(issubclass(kind, LinearAttentionLayer) for kind in seen)


def test_a_model_with_its_own_generate_decodes_through_it(monkeypatch):
    """A model class whose `generate` is its own (it may not take `custom_generate`): generate's loop through it, the
    prompt's cache fanned out before it, with one warning naming why."""
    from transformers import LlamaForCausalLM

    class OwnGenerate(LlamaForCausalLM):
        def generate(self, *args, **kwargs):
            return super().generate(*args, **kwargs)

    model = build("llama")
    model.__class__ = OwnGenerate
    ids, mask = left_pad(prompts_for("mixed_lengths"))
    config = generation_config(max_new_tokens=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock, _, ours, _ = static_and_stock(model, ids, mask, config)
    aside = [str(w.message) for w in caught if "static decoding is off" in str(w.message)]
    assert len(aside) == 1 and "OwnGenerate has its own generate" in aside[0]
    assert_same_generation(stock, ours, "llama", config.max_new_tokens)
    assert not any(isinstance(layer, StaticLayer) for layer in output_cache(ours).layers)


@pytest.mark.parametrize("once, setting", [(False, True), (True, None)])
def test_trainer_decodes_from_static_buffers_as_stock_trl(workload, stock_run, tmp_path, monkeypatch, request, once,
                                                          setting):  # fmt: skip
    """`static_decoding=True` through the trainer (the prompt's cache fanned out), and its default (None) where steps
    are captured (a CPU with capture emulated; the prompt's cache kept once): stock TRL's completions and metrics,
    every generation decoded from static buffers."""
    cfg, path, dataset = workload
    graphs = request.getfixturevalue("emulated_graphs") if setting is None else None
    calls = []
    decode = static_decode._decode
    monkeypatch.setattr(static_decode, "_decode", lambda *args: calls.append(1) or decode(*args))
    args = training_args(tmp_path, static_decoding=setting, share_prompt_kv_cache=once)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(RLOOTrainer, path, args, dataset)
    assert not [w for w in caught if "static decoding is off" in str(w.message)]
    assert list(ours._logs["completion"]) == list(stock_run._logs["completion"])
    # The packed log-prob passes sum in other orders (TRL's log-prob head in float32), as without static decoding
    assert_metrics_close(step_metrics(stock_run), step_metrics(ours), 1e-5, 1e-7, per_micro_batch(ours))
    assert len(calls) == 2 and ours.shared_prefill_tokens > 0  # one generation per two steps, three steps
    assert graphs is None or len(graphs) == 2


def test_grpo_decodes_from_static_buffers_as_stock_trl(workload, tmp_path, exact_head, monkeypatch):
    """GRPO with its defaults but sampling's options, and end tokens common enough (a third of the vocabulary,
    through TRL's `generation_kwargs`) that every row of a generation finishes early, between two read-backs: stock
    TRL's completions and metrics (float64), the second generation's draws included (the first's draws past its
    finish undone), both generations decoded from static buffers."""
    import trl

    from rloo_efficient import GRPOTrainer

    cfg, path, dataset = workload
    calls = []
    decode = static_decode._decode
    monkeypatch.setattr(static_decode, "_decode", lambda *args: calls.append(1) or decode(*args))
    # Sampling's filters and a penalty reading each row's earlier tokens: the processors `generate` prepared, applied
    # to the static buffers' sequences view
    settings = dict(max_completion_length=48, max_steps=4, generation_kwargs={"eos_token_id": list(range(40, 120))},
                    temperature=0.7, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.3)  # fmt: skip
    stock = run(trl.GRPOTrainer, path, grpo_args(tmp_path / "stock", config_class=trl.GRPOConfig, **settings), dataset)
    ours = run(GRPOTrainer, path, grpo_args(tmp_path / "ours", static_decoding=True, **settings), dataset)
    assert_same_run(stock, ours)
    assert len(calls) == 2  # four steps, a generation every two
    longest = [e["completions/max_length"] for e in stock.state.log_history if "completions/max_length" in e]
    assert len(longest) == 2 and all(length < 48 and length % 8 for length in longest)  # stopped between read-backs


def test_a_window_longer_than_the_prompts_closes_its_columns_from_the_wrapped_index():
    """Prompts shorter than the window (8) and 12 tokens decoded past it: the window's closing index starts at
    `(W - 1 - w) mod columns` (a column not written yet) and must wrap to 0 when it reaches the buffers' end.
    Catches `closing.add_(1)` without `.remainder_(columns)` (an index past the buffer: IndexError here, a device
    assert on CUDA)."""
    model = build("mistral_sliding")
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(2, 64, (n,), generator=g).tolist() for n in (5, 3))
    ids, mask = left_pad([a] * 3 + [b] * 3)
    config = generation_config(max_new_tokens=12, suppress_tokens=[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # static decoding ran
        stock, stock_next, ours, ours_next = static_and_stock(model, ids, mask, config)
    assert all(type(layer) is StaticLayer for layer in output_cache(ours).layers)
    assert_same_generation(stock, ours, "mistral_sliding", 12)
    torch.testing.assert_close(ours_next, stock_next, rtol=0, atol=0)


def test_the_loop_stops_at_the_first_read_back_after_every_row_finished(monkeypatch):
    """Rows all finished between steps 8 and 16 of 40: the loop reads back every 8 steps and stops at the first read
    after the finish (16 forwards), not at max_new_tokens. Catches the read-back window not advancing
    (`checked` left at 0: every call decodes to max_new_tokens, the same output, 2.5x the forwards here)."""
    forwards = []
    call = StaticStep.__call__
    monkeypatch.setattr(StaticStep, "__call__", lambda self: forwards.append(1) or call(self))
    model = build("llama")
    ids, mask = left_pad([[5, 9, 13, 17, 21, 25]] * 3 + [[6, 10, 14]] * 3)
    # Every token after step 9 is an EOS: every row has finished by step 10
    class EndAfter(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - ids.shape[1] >= 9:
                scores = torch.full_like(scores, -float("inf"))
                scores[:, 1] = 0
            return scores

    config = generation_config(max_new_tokens=40, eos_token_id=1, suppress_tokens=None)
    kwargs = dict(generation_config=config, return_dict_in_generate=True,
                  logits_processor=LogitsProcessorList([EndAfter()]))
    torch.manual_seed(123)
    stock = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    torch.manual_seed(123)
    ours, _ = generate_with_shared_prefill(model, ids, mask, prompt_cache_once=False, static=True, **kwargs)
    assert torch.equal(ours.sequences, stock.sequences) and ours.sequences.shape[1] - ids.shape[1] == 10
    assert len(forwards) == 16


def test_the_cost_model_takes_the_eager_break_even_once_a_capture_failed(emulated_graphs, prompts_kept_once):
    """After the model's capture failed (`_rloo_graph_failed`), its later calls decode eagerly: the cost model must
    take the eager break-even (here no prompt reaches it), not the replayed one. Catches `replays_kept_once` dropping
    its `_rloo_graph_failed` check (on CUDA: the prompt kept once at 88 MB per layer where it is 1.27x slower)."""
    model = build("llama")
    model._rloo_graph_failed = "its step cannot be captured (an earlier call)"
    ids, mask = left_pad([[5, 9, 13, 17, 21, 25]] * 3 + [[6, 10, 14]] * 3)
    static_and_stock(model, ids, mask, generation_config(max_new_tokens=4), once=None)
    assert not prompts_kept_once


def test_a_model_in_training_mode_with_dropout_set_to_zero_decodes_static():
    """TRL's `disable_dropout=True` sets every dropout's p to 0 and leaves the model in training mode while it
    generates: nothing is drawn, so static decoding runs (no warning). Catches `dropout_active` without its `p > 0`
    (every model with a dropout module, GPT-2's, Phi-3's, would decode in generate's loop, its graphs off)."""
    model = build("gpt2").train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    assert any(isinstance(module, torch.nn.Dropout) for module in model.modules())
    ids, mask = left_pad([[5, 9, 13, 17, 21, 25]] * 3 + [[6, 10, 14]] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # static decoding ran: no fallback's warning
        ours, _ = generate_with_shared_prefill(model, ids, mask, prompt_cache_once=False, static=True,
                                               generation_config=generation_config(max_new_tokens=4),
                                               return_dict_in_generate=True)  # fmt: skip
    assert all(type(layer) is StaticLayer for layer in output_cache(ours).layers)


def test_on_cuda_the_steps_past_the_finish_are_undone_on_cudas_generator(monkeypatch):
    """On CUDA, `torch.multinomial` draws from the device's generator: the state saved after each step, and put back
    where the loop ran past the finish, is CUDA's (CUDA's calls stubbed). Catches `_rng_state` reading the CPU
    generator on CUDA (the device's generator left advanced by the wasted steps: later draws differ from stock's)."""
    calls = []
    get = lambda device="cuda": calls.append(("get", device)) or "cuda-state"  # noqa: E731
    monkeypatch.setattr(torch.cuda, "get_rng_state", get)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append(("set", state, device)))
    assert static_decode._rng_state(torch.device("cuda", 0)) == "cuda-state"
    static_decode._set_rng_state(torch.device("cuda", 0), "cuda-state")
    assert calls == [("get", torch.device("cuda", 0)), ("set", "cuda-state", torch.device("cuda", 0))]
