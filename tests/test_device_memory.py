"""
Device memory, counted on CPU ([`profiling.live_bytes`]): what a GPU's allocator would hold, as live tensor bytes.
No weight copy held through a no-grad forward ([`core.layers.casts`]); no parameter gradient left waiting in a held
prompt's backward ([`core.forward.param_alias`]).
"""

import pytest
import torch
import trl
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, TrainerCallback
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import rloo_efficient
from rloo_efficient import RLOOTrainer
from rloo_efficient.core.generation.generate import generate_with_shared_prefill
from rloo_efficient.core.transformers_compat import output_cache
from rloo_efficient.demo.workload import build_dataset, build_model_dir, build_tokenizer, vowel_reward
from rloo_efficient.profiling.live_bytes import LiveBytes, PhasePeaks
from rloo_efficient.profiling.phase_profiler import PhaseProfiler
from rloo_efficient.trainers.memory_profiling import profiled

from .conftest import run, tiny_workload, training_args
from .helpers import HEADS, KV_HEADS, VOCAB, left_pad, prompts_for


def test_live_bytes_count_each_storage_once_until_it_dies():
    with LiveBytes() as live:
        a = torch.ones(1000)  # 4000 bytes
        view = a[10:]  # the same storage
        a.add_(1)  # in place: nothing new
        b = a * 2  # 4000 more
        del a
        assert live.current == 8000  # the view keeps the first storage alive
        del view
        assert live.current == 4000
        c = torch.ones(250, dtype=torch.float64)  # 2000
        del b, c
    assert live.peak == 8000 and live.current == 0
    assert [t["bytes"] for t in live.peak_tensors(2)] == [4000, 4000]
    assert {t["op"] for t in live.peak_tensors(2)} == {"ones", "mul"}


def _casts_alive(live: LiveBytes, weight_shapes: set) -> int:
    """The bf16 copies of weights alive now: autocast's casts, shaped as a weight."""
    return sum(1 for t in live.live_tensors()
               if t["dtype"] == "bfloat16" and t["op"] == "_to_copy" and tuple(t["shape"]) in weight_shapes)  # fmt: skip


class _During(TrainerCallback):
    """`counter` (a [`LiveBytes`], or [`PhasePeaks`]) active through optimizer step `step` (1-based: its generation,
    log-prob passes, training and optimizer step)."""

    def __init__(self, counter, step: int = 1):
        self.counter, self.step = counter, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            self.counter.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.counter.__exit__(None, None, None)


@pytest.mark.parametrize("trainer_class", [trl.RLOOTrainer, RLOOTrainer])
def test_no_grad_forwards_hold_one_layers_weight_casts(model_cache, tmp_path, trainer_class):
    """
    TRL's default precision: float32 weights under bf16 autocast, gradient checkpointing on. Autocast caches each
    weight's bf16 copy until the forward ends; ours releases them after each decoder layer, in no-grad forwards
    (generation's prefill and steps, the log-prob passes) and in the checkpointed training forward (which saves none
    of them): at the last layer's end no earlier layer's copy is alive. Stock holds every layer's (the count this test
    would see if ours did too).
    """
    cfg = tiny_workload(model_cache, arch="qwen3", model_dtype="float32", num_hidden_layers=4)
    config_class = trl.RLOOConfig if trainer_class is trl.RLOOTrainer else rloo_efficient.RLOOConfig
    args = training_args(tmp_path, config_class=config_class, bf16=True, use_cpu=True, max_steps=1,
                         steps_per_generation=1, gradient_checkpointing=True)  # fmt: skip
    counting = _During(LiveBytes(sites=False))
    trainer = trainer_class(model=build_model_dir(cfg), reward_funcs=vowel_reward, args=args,
                            train_dataset=build_dataset(cfg), processing_class=build_tokenizer(),
                            callbacks=[counting])  # fmt: skip
    model = trainer.accelerator.unwrap_model(trainer.model)
    layers = model.model.layers
    shapes = {tuple(p.shape) for layer in layers for p in layer.parameters() if p.dim() == 2}
    per_layer = sum(1 for p in layers[-1].parameters() if p.dim() == 2)
    seen = {True: [], False: []}  # by grad mode
    layers[-1].register_forward_hook(lambda *_: seen[torch.is_grad_enabled()].append(
        _casts_alive(counting.counter, shapes)))  # fmt: skip
    trainer.train()
    assert seen[True] and seen[False]  # training and no-grad forwards ran with the count on
    for counts in seen.values():
        if trainer_class is trl.RLOOTrainer:
            assert min(counts) == len(layers) * per_layer  # every layer's copy, to the end of the forward
        else:
            assert max(counts) <= per_layer and trainer.shared_prefill_tokens > 0


class _Waiting(LiveBytes):
    """Live tensor bytes, and after every operator the bytes of float32 tensors shaped like a trainable parameter that
    are not a parameter's `.grad`: gradients produced and not yet accumulated (hooks on the parameters would change
    what is measured: a parameter with hooks is not read through an alias)."""

    def __init__(self, params):
        super().__init__(sites=False)
        self.params, self.shapes, self.most = params, {tuple(p.shape) for p in params}, 0
        self.counting = True  # (off from the optimizer step on: its states are shaped like the parameters)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not self.counting:
            return out
        grads = {id(p.grad.untyped_storage()) for p in self.params if p.grad is not None}
        waiting = sum(t["bytes"] for t in self.live_tensors()
                      if tuple(t["shape"]) in self.shapes and t["dtype"] == "float32" and t["storage"] not in grads)
        self.most = max(self.most, waiting)
        return out


def test_layers_that_share_a_weight_keep_autocasts_cache():
    """Zamba 2's hybrid layers share one attention block: stock's forward casts its weights to bf16 once for both and
    sums their gradient on that cast. Autocast's cache is the thread's, so that any layer's release between the two
    uses (a Mamba layer's, not only the sharing layers') would cast them again: no layer releases, and the gradients
    are stock's bits."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    from rloo_efficient.core.layers.casts import release_casts_per_layer

    config = Zamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                          num_key_value_heads=2, mamba_d_state=8, mamba_headdim=8, mamba_ngroups=1, n_mamba_heads=8,
                          intermediate_size=64, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                          hybrid_layer_ids=[1, 3], num_mem_blocks=1, use_mem_rope=False, attention_hidden_size=64,
                          attention_head_dim=32)  # fmt: skip
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))

    def gradients(release: bool) -> dict:
        torch.manual_seed(0)
        model = Zamba2ForCausalLM(config)
        if release:
            assert release_casts_per_layer(model) == 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    ours, stock = gradients(True), gradients(False)
    assert ours.keys() == stock.keys() and any("shared_transformer" in name for name in ours)
    for name in stock:
        assert torch.equal(ours[name], stock[name]), name


def test_a_held_prompts_backward_leaves_no_gradient_waiting(model_cache, tmp_path):
    """
    One row per micro-batch: each prompt forwarded once, held, and backpropagated in the last micro-batch's backward
    beside that row's. Every parameter gradient is accumulated as it arrives: none waits for the prompt's part
    (autograd would hold each, in full, until the prompt's backward reaches the parameter: a whole set of gradients at
    once). Counted after every operator of the step; stock's gradients alike.
    """
    cfg = tiny_workload(model_cache, arch="qwen3", model_dtype="float32", num_hidden_layers=4, hidden_size=64,
                        intermediate_size=128, prompt_length=96, prompt_length_min=None)  # fmt: skip
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    settings = dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, steps_per_generation=4, max_steps=1)
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "stock", config_class=trl.RLOOConfig, **settings),
                dataset)  # fmt: skip
    trainer = RLOOTrainer(model=path, reward_funcs=vowel_reward, args=training_args(tmp_path / "ours", **settings),
                          train_dataset=dataset, processing_class=build_tokenizer())  # fmt: skip
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    waiting = _Waiting(params)
    counting = _During(waiting)
    counting.on_pre_optimizer_step = lambda *args, **kwargs: setattr(waiting, "counting", False)
    trainer.add_callback(counting)
    trainer.train()
    assert trainer.held_forward_tokens > 0
    largest = max(p.numel() * p.element_size() for p in params)
    assert 0 < waiting.most <= largest  # at most the one being accumulated (the embedding's, the largest)
    norms = [[e["grad_norm"] for e in t.state.log_history if "grad_norm" in e] for t in (stock, trainer)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)  # the gradients are stock's


class _AttentionInputs(TorchDispatchMode):
    """Every tensor an attention kernel is handed (the SDPA family's operators), as it was handed."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func._overloadpacket.__name__:
            self.calls.append([x.clone() for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)])
        return func(*args, **(kwargs or {}))


def _stored(cache) -> list[torch.Tensor]:
    """The keys and values a decoding cache holds: the prompt's (kept once or fanned out) and the rows' own."""
    found = []
    for layer in cache.layers:
        for name in ("keys", "values", "prefix_keys", "prefix_values"):
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor) and value.numel():
                found.append(value)
    return found


@pytest.mark.parametrize("once, static, tree", [(False, False, True), (True, False, True), (True, True, True),
                                                (False, True, False)])  # fmt: skip
def test_caches_store_keys_in_the_dtype_attention_reads(monkeypatch, once, static, tree):
    """
    Under bf16 autocast (float32 weights, as TRL trains) Qwen3's keys come out of their norm in float32, and every
    attention reads them in bf16. The shared prefill's cache (the prefix tree's, or the padded prefill's), the prompt
    kept once, the static buffers and the decoded rows' keys are all stored in bf16: every attention kernel gets
    bit-identical inputs to the run storing what the model hands over (float32 keys), and the same logits.
    """
    from rloo_efficient.core.generation import prompt_cache

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=8,
                                         max_position_embeddings=512)).eval()  # fmt: skip
    model.config._attn_implementation = "sdpa"
    prompts, mask = left_pad(prompts_for("system_prompt" if tree else "mixed_lengths"))
    config = GenerationConfig(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    kwargs = dict(generation_config=config, output_logits=True, return_dict_in_generate=True)
    runs = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # each kernel's first-use check, not counted
        generate_with_shared_prefill(model, prompts, mask, prompt_cache_once=once, static=static, tree=tree, **kwargs)
    for narrow in (True, False):
        if not narrow:  # what the model hands over, stored as it is
            monkeypatch.setattr(prompt_cache, "stored_as_read", lambda *tensors: tensors)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), _AttentionInputs() as inputs:
            output, shared = generate_with_shared_prefill(model, prompts, mask, prompt_cache_once=once, static=static,
                                                          tree=tree, **kwargs)  # fmt: skip
        assert 0 < shared < (3 * (prompts.shape[1] - 1) if tree else 10**9)  # the tree: the system prompt once
        runs[narrow] = (output, inputs.calls, {t.dtype for t in _stored(output_cache(output))})
    (narrow, narrow_calls, narrow_dtypes), (wide, wide_calls, wide_dtypes) = runs[True], runs[False]
    assert narrow_dtypes == {torch.bfloat16} and torch.float32 in wide_dtypes  # (the keys: wider than read)
    assert len(narrow_calls) == len(wide_calls) > 0
    for a, b in zip(narrow_calls, wide_calls, strict=True):
        assert len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for a, b in zip(narrow.logits, wide.logits, strict=True):
        assert torch.equal(a, b)


_ProfiledStock = profiled(trl.RLOOTrainer)  # stock TRL with the same phase profiler as ours


@pytest.mark.parametrize("rows", [4, 1])
def test_no_phase_holds_more_than_stocks(model_cache, tmp_path, rows):
    """
    TRL's defaults on a GPU: bf16 autocast over float32 weights, gradient checkpointing; a whole group per micro-batch
    and one row per micro-batch (prompts held across micro-batches). Each phase's peak of live tensor bytes (above
    what existed when the step began: the weights and optimizer states) is at most stock's, and with a group per
    micro-batch ours' step is well below stock's. Deterministic byte counts, a device's allocated memory without its
    allocator.
    """
    cfg = tiny_workload(model_cache, arch="qwen3", model_dtype="float32", num_hidden_layers=4, hidden_size=64,
                        intermediate_size=128, prompt_length=256, prompt_length_min=None)  # fmt: skip
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    settings = dict(bf16=True, use_cpu=True, per_device_train_batch_size=rows, gradient_accumulation_steps=4 // rows,
                    steps_per_generation=4 // rows, max_steps=2, gradient_checkpointing=True)  # fmt: skip
    peaks = {}
    for name, trainer_class, config_class in (("stock", _ProfiledStock, trl.RLOOConfig),
                                              ("ours", RLOOTrainer, rloo_efficient.RLOOConfig)):  # fmt: skip
        trainer = trainer_class(model=path, reward_funcs=vowel_reward, train_dataset=dataset,
                                args=training_args(tmp_path / name, config_class=config_class, **settings),
                                processing_class=build_tokenizer())  # fmt: skip
        peaks_of_step_two = PhasePeaks(trainer.memory_profiling.profiler)
        trainer.add_callback(_During(peaks_of_step_two, step=2))
        trainer.train()
        peaks[name] = {phase: record["peak_bytes"] for phase, record in peaks_of_step_two.phases.items()
                       if phase != "outside"}  # (between phases: the Trainer's own bookkeeping)
    stock, ours = peaks["stock"], peaks["ours"]
    assert {"generation", "train"} <= set(stock) and set(ours) == set(stock)
    # (ours' batch carries its group table, `rloo_rows`: a host tensor on a GPU, a few KiB here)
    above = {phase: (stock[phase], ours[phase]) for phase in stock if ours[phase] > stock[phase] + 64 * 1024}
    assert not above, above
    if rows == 4:  # (at one row both are near the tiny model's own bytes)
        assert max(ours.values()) <= 0.5 * max(stock.values()), (stock, ours)


def test_a_parameter_watched_by_hooks_is_not_aliased():
    """A parameter whose gradient hooks watch (PEFT's OSF projects it; a layer-wise optimizer steps on it) keeps
    autograd's own accumulation in a held prompt's forward: its hooks see the whole gradient. The others are read
    through aliases, restored after, and get the same gradients."""
    from rloo_efficient.core.forward.param_alias import aliased_parameters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    seen = []
    model[1].weight.register_hook(lambda grad: seen.append(grad.clone()))
    x = torch.randn(2, 3)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with aliased_parameters(model):
        assert not isinstance(model[0].weight, torch.nn.Parameter)  # read through its alias
        assert isinstance(model[1].weight, torch.nn.Parameter)  # watched: itself
        loss = model(x).square().sum()
    assert all(isinstance(p, torch.nn.Parameter) for p in (model[0].weight, model[0].bias))  # restored
    loss.backward()
    assert len(seen) == 2 and torch.equal(seen[1], model[1].weight.grad)  # the hook saw the whole gradient
    assert all(torch.equal(p.grad, grad) for p, grad in zip(model.parameters(), expected, strict=True))


def test_a_live_bytes_segment_counts_its_peak_from_what_is_alive_when_it_begins():
    """[`LiveBytes.mark`]: a segment's peak is at least what was alive at its start, even where it frees before it
    allocates. Catches `mark` setting the peak to 0."""
    with LiveBytes() as live:
        big = torch.ones(1000)
        live.mark()
        del big
        small = torch.ones(10)
        assert live.peak == 4000 and live.current == small.untyped_storage().nbytes()


def test_phase_peaks_are_each_phases_own():
    """[`PhasePeaks`]: a phase after a larger one reports its own peak (each phase's segment starts a new mark).
    Catches `_close` without `self.live.mark()` (every later phase gets the running maximum)."""
    profiler = PhaseProfiler(torch.device("cpu"))
    with PhasePeaks(profiler) as peaks:
        with profiler.phase("generation"):
            big = torch.ones(1000)
            del big
        with profiler.phase("train"):
            small = torch.ones(10)
            del small
    assert peaks.phases["generation"]["peak_bytes"] == 4000
    assert peaks.phases["train"]["peak_bytes"] == 40

