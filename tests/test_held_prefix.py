"""
Prefix states held across micro-batches ([`core.tree.holds`], [`core.attention.held`], [`core.forward.scope`]): a scope's
chunks of one or two rows, each prompt forwarded once, against the same chunks each packed on its own (today's
per-micro-batch tree, itself equal to stock's forward: tests/test_prefix_sharing.py). Per-token log-probs and the
gradient accumulated over the chunks' backwards, as a Trainer runs them (one backward per chunk), agree at float64's
resolution; the held state is released when its last chunk is done.
"""

import contextlib
import copy
import functools
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from rloo_efficient.core.forward.packing import pack_rows
from rloo_efficient.core.forward.scope import HeldScope, chunk_tables
from rloo_efficient.core.layers.install import install
from rloo_efficient.core.tree import layout as layouts
from rloo_efficient.core.tree.holds import plan_holds
from rloo_efficient.core.tree.pass_chunks import chunks_encoding

from .conftest import emulate_varlen, tiny_workload
from .helpers import load_as_trl
from .trees import stock_batch


def bare_planner(agree=None, node_bytes: int = 0):
    """A [`HoldPlanner`] outside a trainer: no budget limit, each held token costing 1 byte (and each node
    `node_bytes`: a hybrid's states), every width within the position period; `agree(values)`: what the all-reduce
    says (default: every process agrees). Its warnings go to `.warned`."""
    from types import SimpleNamespace

    from rloo_efficient.core.forward.hold_planner import HoldPlanner

    warned = []
    costs = SimpleNamespace(within_period=lambda width: True, token_bytes=lambda training: 1,
                            node_bytes=lambda training: node_bytes, kv_source=lambda: None)
    planner = HoldPlanner(2**40, costs, agree or (lambda values: True), warned.append)
    planner.warned = warned
    return planner


def bare_held(fsdp: int = 0):
    """A [`HeldPrefixes`] outside a trainer, its planner a [`bare_planner`]."""
    from types import SimpleNamespace

    from rloo_efficient.trainers.held_prefix import HeldPrefixes

    args = SimpleNamespace(gradient_checkpointing=False, gradient_checkpointing_kwargs=None, bf16=False, fp16=False)
    return HeldPrefixes(bare_planner(), lambda: None, args, None, fsdp=fsdp)


@pytest.fixture(scope="module")
def scoring_model(workload):
    cfg, path, dataset = workload
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install(model)
    return model


def rl_rows(seed: int, groups: int = 3, k: int = 4, system: int = 70, task: int = 40, vocab: int = 250):
    """Prompts of `groups` tasks after one system prompt, `k` completions each of varied lengths (some opening alike):
    `(prompts, completions)`, rows of a group consecutive. The tasks are of one length, so that a system prompt held
    once positions every row at its stock columns (a node shared across prompts of other lengths shifts positions by
    a constant, equal within the rotary embedding's float32 rounding: tests/test_prefix_sharing.py)."""
    rng = random.Random(seed)
    head = [rng.randrange(3, vocab) for _ in range(system)]
    prompts, completions = [], []
    for _ in range(groups):
        prompt = head + [rng.randrange(3, vocab) for _ in range(task)]
        opening = [rng.randrange(3, vocab) for _ in range(rng.randint(0, 3))]
        for _ in range(k):
            prompts.append(list(prompt))
            completions.append(opening + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))])
    return prompts, completions


def run_chunks(model, input_ids, width_c, structure, chunks, hold: bool, weights, min_saved: int = 64,
               source_cap: int | None = None):  # fmt: skip
    """Each chunk forwarded and backpropagated on its own, as a Trainer's micro-batches; returns the (B, C) log-probs
    and entropies in row order, the accumulated gradients and the scope (None without holds)."""
    model.zero_grad()
    logps = torch.zeros(input_ids.shape[0], width_c, dtype=torch.float64)
    entropy = torch.zeros_like(logps)
    scope = None
    if hold:
        plan = plan_holds(chunk_tables(structure, chunks), full=False, min_saved=min_saved, source_cap=source_cap)
        assert plan is not None
        scope = HeldScope(plan, training=True)
    prompt_width = input_ids.shape[1] - width_c
    for index, chunk in enumerate(chunks):
        rows = torch.from_numpy(chunk)
        if scope is not None and scope.plan.chunks[index].source is not None:
            scope.forward_source(scope.plan.chunks[index].source, lambda **kw: model(**kw, fused_lm_head=True),
                                 prompt_width, input_ids.device, recurrent=False)  # fmt: skip
        if scope is not None:
            packed = scope.pack(index, input_ids[rows], width_c, structure[rows], recurrent=False)
        else:
            packed = pack_rows(input_ids[rows], width_c, structure[rows], recurrent=False)
        out = model(**packed.model_inputs(), fused_lm_head=True)
        if scope is not None:  # as the trainer does: after the forward, before the Trainer's backward
            scope.release(index)
        chunk_logps, chunk_entropy = packed.unpack(out.log_probs), packed.unpack(out.entropy)
        ((chunk_logps * weights[rows]).sum() + chunk_entropy.sum()).backward()
        logps[rows], entropy[rows] = chunk_logps.detach(), chunk_entropy.detach()
    grads = [p.grad.clone() for p in model.parameters()]
    return logps, entropy, grads, scope


@pytest.mark.parametrize("min_saved", [64, 0])  # 0: the system prompt held apart, each task under it (nested)
@pytest.mark.parametrize("bs", [1, 2, 3])
@pytest.mark.parametrize("order", ["group_major", "shuffled"])
@pytest.mark.parametrize("varlen", [False, True])  # True: as on CUDA (flash's variable-length calls, emulated)
def test_held_prefixes_give_the_per_chunk_trees_log_probs_and_gradients(scoring_model, exact_head, monkeypatch, bs,
                                                                         order, min_saved, varlen):  # fmt: skip
    """Where the variable-length kernel runs, each node's call reads its held ancestors' keys, then its ancestors' in
    the chunk's tree, before its own (one call, no held parts); against each chunk's tree in its padded buckets."""
    calls = emulate_varlen(monkeypatch) if varlen else None
    folded_calls = []
    if varlen:
        from rloo_efficient.core.attention import tree as tree_attention

        held_keys = tree_attention._held_keys
        monkeypatch.setattr(tree_attention, "_held_keys", lambda *args: folded_calls.append(1) or held_keys(*args))
    prompts, completions = rl_rows(seed=bs)
    input_ids, attention_mask, width_c, structure = stock_batch(prompts, completions)
    rows = np.arange(len(prompts))
    if order == "shuffled":
        rows = np.random.default_rng(0).permutation(rows)
    chunks = [rows[i : i + bs] for i in range(0, len(rows), bs)]
    weights = torch.linspace(-1, 1, input_ids.shape[0] * width_c, dtype=torch.float64).view(-1, width_c)
    with pytest.MonkeyPatch.context() as buckets:  # the reference: each chunk's tree in its padded buckets
        buckets.setattr(layouts, "VARLEN_DEVICES", ())
        want_logps, want_entropy, want_grads, _ = run_chunks(scoring_model, input_ids, width_c, structure, chunks,
                                                             False, weights)  # fmt: skip
    logps, entropy, grads, scope = run_chunks(scoring_model, input_ids, width_c, structure, chunks, True, weights,
                                              min_saved, source_cap=bs * input_ids.shape[1])  # fmt: skip
    # (the trainer's cap: one of stock's forwards)
    if min_saved == 0:
        assert (scope.plan.nodes.parent >= 0).any()  # a held node under another
    if bs > 1 and order == "group_major":  # a later group's prompt forwarded in an earlier chunk's source (within
        # one of stock's forwards: two of the three prompts at two rows per chunk, all three at three)
        assert len(scope.plan.source_chunk) < len(np.unique(scope.plan.nodes.first))
    if varlen:
        assert calls and set(calls) == {"math_varlen"} and folded_calls  # the folded call ran (held keys read in it)
    mask = attention_mask[:, -width_c:].bool()
    torch.testing.assert_close(logps[mask], want_logps[mask], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(entropy[mask], want_entropy[mask], rtol=1e-10, atol=1e-12)
    scale = max(g.abs().max().item() for g in want_grads)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10 * scale)
    assert scope.forwarded_tokens > 0 and not scope.sources  # held, and every source released


@pytest.mark.parametrize("layers", [2, 1])
def test_a_source_read_through_a_later_one_is_backpropagated_after_it(scoring_model, exact_head, layers):
    """A prompt P (read in chunks 0 to 3), its continuation C (chunks 2 and 3) in one source with a prompt Q read to
    chunk 5, and R (chunks 4 and 5): C's source's backward runs in chunk 5, and reaches P's keys through C's, so P's
    source must be backpropagated there too, not in its own last reader (chunk 3), and every bank P's earlier readers
    left goes in there. The same log-probs and gradients as each chunk's own tree. Fails with a source's backprop
    chunk not passed up to its ancestors' sources (P's gradient from C's source would arrive after P's backward); with
    a bank added only where a gradient reaches its tensor (P's last-layer keys get none through C's forward, whose last
    layer's output nothing reads); and, in one layer (C's keys then do not depend on P's at all), without the link
    from C's source to the ancestors it read."""
    model = scoring_model
    if layers == 1:
        config = copy.deepcopy(scoring_model.config)
        config.num_hidden_layers = 1
        config.layer_types = config.layer_types[:1] if getattr(config, "layer_types", None) else None
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        install(model)
    rng = random.Random(7)
    tokens = lambda n: [rng.randrange(3, 250) for _ in range(n)]  # noqa: E731
    p, c, q, r = tokens(11), tokens(3), tokens(14), tokens(14)
    # Every prompt 15 tokens (one length: held nodes sit at every row's stock positions), its last token its own
    rows = [p + tokens(4), p + tokens(4), p + c + tokens(1), q + tokens(1), p + c + tokens(1), q + tokens(1),
            q + tokens(1), r + tokens(1), q + tokens(1), r + tokens(1)]  # fmt: skip
    completions = [tokens(rng.randint(1, 6)) for _ in rows]
    input_ids, attention_mask, width_c, structure = stock_batch(rows, completions)
    chunks = [np.array(chunk) for chunk in ([0], [1], [2, 3], [4, 5], [6, 7], [8, 9])]
    weights = torch.linspace(-1, 1, input_ids.shape[0] * width_c, dtype=torch.float64).view(-1, width_c)
    want_logps, _, want_grads, _ = run_chunks(model, input_ids, width_c, structure, chunks, False, weights)
    logps, _, grads, scope = run_chunks(model, input_ids, width_c, structure, chunks, True, weights, min_saved=0)
    plan = scope.plan
    assert plan.source_chunk.tolist() == [0, 2, 4]  # P; C and Q; R
    assert plan.backprop_chunk.tolist() == [5, 5, 5]  # P's after C's (read through it), C and Q's after Q's last reader
    mask = attention_mask[:, -width_c:].bool()
    torch.testing.assert_close(logps[mask], want_logps[mask], rtol=1e-10, atol=1e-12)
    scale = max(g.abs().max().item() for g in want_grads)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10 * scale)
    assert scope.forwarded_tokens > 0 and not scope.sources


# One family per mechanism a held prefix must carry: sliding windows shorter than the prompt (Mistral; Gemma 3's
# alternating layers), sinks and MoE routers (GPT-OSS), latent attention with narrower values (DeepSeek-V3), layers
# reading another's keys (Gemma 4), recurrent states and convolution tails (Gated DeltaNet: Qwen3-Next, also MoE;
# Mamba2: Nemotron-H; a short convolution: LFM2)
HELD_FAMILIES = ("mistral", "gemma3", "gpt_oss", "deepseek_v3", "gemma4", "qwen3_next", "nemotron_h", "lfm2",
                 "kimi_linear", "gemma2")


# As on CUDA (flash's variable-length calls, emulated): a row's node reads its held keys in its own call, under a
# window (Gemma 3), with sinks (GPT-OSS), beside recurrent layers (Qwen3-Next)
VARLEN_HELD_FAMILIES = ("gemma3", "gpt_oss", "qwen3_next")


# MoE in chunks of 1, 3 and 2 rows: a held token's load-balancing weight is the count of the chunk's rows holding it,
# and the middle chunk reads two held prompts, one held by two of its rows and one by one
@pytest.mark.parametrize("arch, varlen, sizes", [(arch, False, (1,) * 6) for arch in HELD_FAMILIES] +
                         [(arch, True, (1,) * 6) for arch in VARLEN_HELD_FAMILIES] +
                         [("gpt_oss", False, (1, 3, 2))])  # fmt: skip
def test_every_mechanism_is_held_as_the_per_chunk_trees_compute_it(model_cache, exact_head, monkeypatch, arch, varlen,
                                                                     sizes):  # fmt: skip
    """Chunks of `sizes` rows, each prompt held: the same log-probs, load-balancing loss (MoE) and gradients as each
    chunk packed on its own."""
    from rloo_efficient.core.layers.moe import aux_loss_reason, recording_router_logits, weighted_aux_loss
    from rloo_efficient.core.layers.recurrent import has_recurrent_layers, recurrent_layers

    from .helpers import TRAINING_FAMILIES

    calls = emulate_varlen(monkeypatch) if varlen else None
    cfg = tiny_workload(model_cache, arch=arch, **TRAINING_FAMILIES[arch])
    model = load_as_trl(cfg)
    recurrent, moe = has_recurrent_layers(model), aux_loss_reason(model) is None
    torch.manual_seed(0)
    with torch.no_grad():  # parameters off their init (tests/test_recurrent.py), decays slow: the state carries the prompt
        for module, _ in recurrent_layers(model):
            for parameter in module.parameters():
                parameter.add_(0.1 * torch.randn_like(parameter))
            if hasattr(module, "A_log"):
                module.A_log.fill_(-3.0)
    text_config = model.config.get_text_config()
    prompts, completions = rl_rows(seed=7, groups=2, k=3, system=20, task=30, vocab=120)
    input_ids, attention_mask, width_c, structure = stock_batch(prompts, completions)
    chunks = np.split(np.arange(len(prompts)), np.cumsum(sizes)[:-1])
    weights = torch.linspace(-1, 1, input_ids.shape[0] * width_c, dtype=torch.float64).view(-1, width_c)

    held_counts = []  # per chunk, each slot's most rows holding one of its tokens

    def run(hold: bool):
        model.zero_grad()
        scope = HeldScope(plan_holds(chunk_tables(structure, chunks), full=moe), training=True) if hold else None
        logps, aux_losses = torch.zeros(len(prompts), width_c, dtype=torch.float64), []
        held_counts.clear()
        call = lambda **kw: model(**kw, fused_lm_head=True)  # noqa: E731
        for index, chunk in enumerate(chunks):
            rows = torch.from_numpy(chunk)
            pack = dict(token_weights=moe, recurrent=recurrent)
            if hold and scope.plan.chunks[index].source is not None:
                routers = functools.partial(recording_router_logits, model) if moe else None
                scope.forward_source(scope.plan.chunks[index].source, call, input_ids.shape[1] - width_c,
                                     input_ids.device, recurrent, routers)
            packed = (scope.pack(index, input_ids[rows], width_c, structure[rows], **pack) if hold
                      else pack_rows(input_ids[rows], width_c, structure[rows], **pack))  # fmt: skip
            with recording_router_logits(model) if moe else contextlib.nullcontext() as routers:
                out = call(**packed.model_inputs())
            if hold:
                scope.release(index)
            chunk_logps = packed.unpack(out.log_probs)
            loss = (chunk_logps.double() * weights[rows]).sum()
            if moe:
                held = packed.layout.held.routers() if packed.layout.held is not None else []
                aux = weighted_aux_loss(routers, packed.token_weights, text_config, held, list(packed.held_weights))
                aux_losses.append(aux.detach())
                held_counts.append(tuple(int(w.max()) for w in packed.held_weights))
                loss = loss + aux
            loss.backward()
            logps[rows] = chunk_logps.detach().double()
        return logps, aux_losses, [p.grad.clone() for p in model.parameters() if p.grad is not None], scope

    want_logps, want_aux, want_grads, _ = run(False)
    logps, aux, grads, scope = run(True)
    if varlen:
        assert calls and set(calls) == {"math_varlen"}
    assert scope.forwarded_tokens > 0 and not scope.sources
    tolerance = 1e-10 if cfg.model_dtype == "float64" else 1e-5  # float32: the experts' and scans' other orders
    mask = attention_mask[:, -width_c:].bool()
    torch.testing.assert_close(logps[mask], want_logps[mask], rtol=tolerance, atol=tolerance)
    if moe:
        torch.testing.assert_close(torch.stack(aux), torch.stack(want_aux), rtol=tolerance, atol=tolerance)
        assert (2, 1) in held_counts if sizes == (1, 3, 2) else set(held_counts) <= {(), (1,)}
    scale = max(g.abs().max().item() for g in want_grads)
    assert len(grads) == len(want_grads)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance * 10, atol=tolerance * 10 * scale)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "qwen3_next", "kimi_linear", "nemotron_h", "falcon_h1",
                                  "lfm2"])  # fmt: skip
def test_a_source_holds_the_bytes_its_plan_was_charged(model_cache, arch):
    """What the hold budget charges a source forward ([`HoldCosts`]: each token's keys and values as attention reads
    them or its latents, each node's recurrent states) is what it holds, in float32 and under bf16 autocast (Mamba2's
    torch scan hands its states over in bf16 there, charged as float32: at most the states' half over). Latent attention
    holds its latents, in float32 under autocast (a norm's and the rotary embedding's outputs): charging the keys and
    values they expand to, or the latents at autocast's size, fails for DeepSeek-V3 and Kimi-Linear."""
    from rloo_efficient.core.forward.hold_planner import HoldCosts
    from rloo_efficient.core.layers.recurrent import has_recurrent_layers, held_state_values

    from .helpers import TRAINING_FAMILIES

    model = load_as_trl(tiny_workload(model_cache, arch=arch, **{**TRAINING_FAMILIES.get(arch, {}),
                                                                  "model_dtype": "float32"}))  # fmt: skip
    prompts, completions = rl_rows(seed=7, groups=2, k=3, system=20, task=30, vocab=120)
    input_ids, _, width_c, structure = stock_batch(prompts, completions)
    plan = plan_holds(chunk_tables(structure, np.split(np.arange(len(prompts)), len(prompts))), full=False,
                      training=False)  # fmt: skip
    wide, text_config = held_state_values(model)[0], model.config.get_text_config()
    for autocast in (False, True):
        costs = HoldCosts(lambda: model, 2 if autocast else None, checkpointing=False)
        scope = HeldScope(plan, training=False)
        for source in range(len(plan.source_chunk)):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                scope.forward_source(source, lambda **inputs: model(**inputs, fused_lm_head=True),
                                     input_ids.shape[1] - width_c, "cpu", has_recurrent_layers(model))  # fmt: skip
            nodes, held = len(plan.source_nodes(source)), scope.sources.pop(source).nbytes
            charged = plan.source_tokens(source) * costs.token_bytes(False) + nodes * costs.node_bytes(False)
            if autocast and arch in ("nemotron_h", "falcon_h1"):  # (wide: the states and Falcon-H1's tails)
                assert charged - nodes * wide * 2 <= held < charged
            elif autocast and arch == "kimi_linear":  # its latents' rope part (no rotary: bf16) charged as float32
                layers = sum(layer == "full_attention" for layer in text_config.layer_types)
                assert held == charged - plan.source_tokens(source) * layers * text_config.qk_rope_head_dim * 2
            else:
                assert held == charged, (arch, autocast)


@pytest.mark.parametrize("case", ["reentrant_checkpointing", "fsdp1"])
def test_where_training_cannot_hold_prompts_it_says_so_once_and_scoring_still_holds(workload, tmp_path, case):
    """Reentrant checkpointing keeps no graph of a layer's keys, and FSDP1 gathers a layer's parameters only for a
    gradient reaching its output: training micro-batches forward their prompts (one warning naming why); the no-grad
    passes still hold them. (FSDP2 holds them: `tests/test_distributed.py`.)"""
    import warnings

    from rloo_efficient import RLOOTrainer
    from rloo_efficient.demo.workload import build_tokenizer, vowel_reward

    from .conftest import training_args

    cfg, path, dataset = workload
    overrides = dict(per_device_train_batch_size=1, gradient_accumulation_steps=8, steps_per_generation=8, max_steps=1)
    if case == "reentrant_checkpointing":
        overrides.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    fsdp = pytest.MonkeyPatch.context()
    with warnings.catch_warnings(record=True) as caught, fsdp as patch:
        warnings.simplefilter("always")
        if case == "fsdp1":  # what the Trainer sets from accelerate's FSDP plugin (CPU processes run no FSDP), as our
            # construction reads it (set only there: the rest of the Trainer would look for the plugin); accelerate's
            # state, without a plugin, is not FSDP2
            from rloo_efficient.trainers.held_prefix import HeldPrefixes

            init_holds = HeldPrefixes.__init__

            def with_fsdp(self, *args, **kwargs):
                init_holds(self, *args, **{**kwargs, "fsdp": 1})

            patch.setattr(HeldPrefixes, "__init__", with_fsdp)
        trainer = RLOOTrainer(model=path, reward_funcs=vowel_reward, args=training_args(tmp_path, **overrides),
                              train_dataset=dataset, processing_class=build_tokenizer())  # fmt: skip
        trainer.train()
    messages = [str(w.message) for w in caught if "not held across micro-batches" in str(w.message)]
    named = "use_reentrant=True" if case == "reentrant_checkpointing" else "FSDP1"
    assert len(messages) == 1 and named in messages[0]
    assert not trainer._held.training and trainer._held.planner.train_scope is None
    assert trainer.held_forward_tokens > 0  # the scoring passes (old policy, reference) held the prompts


def test_zero3_gradient_partitions_are_zeroed_at_a_window_start_or_training_does_not_hold(monkeypatch):
    """ZeRO-3 copies a parameter's gradient partition in a window's first micro-batch and adds the later ones: a held
    prompt's vision tower, whose gradient first comes later, would add to the last step's (the launch test's image case
    fails without this). Where the optimizer has no such buffer, the window's first micro-batch turns training holds
    off, with one warning, before its scope is planned."""
    import warnings
    from types import SimpleNamespace

    import transformers.integrations

    from rloo_efficient.trainers.held_prefix import zero_stale_gradients

    stale = torch.ones(6)
    engine = SimpleNamespace(optimizer=SimpleNamespace(grad_partitions_flat_buffer=stale))
    assert zero_stale_gradients(engine) and stale.tolist() == [1.0] * 6  # not ZeRO-3: left alone
    monkeypatch.setattr(transformers.integrations, "is_deepspeed_zero3_enabled", lambda: True)
    assert zero_stale_gradients(engine) and stale.tolist() == [0.0] * 6
    assert not zero_stale_gradients(SimpleNamespace(optimizer=SimpleNamespace()))

    held = bare_held()
    held.step_ends(sync_gradients=False)  # inside a window: nothing checked
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held.step_begins(SimpleNamespace(optimizer=None))
        assert held.training and not caught
        held.step_ends(sync_gradients=True)
        held.step_begins(SimpleNamespace(optimizer=None))  # a window's first micro-batch
    assert not held.training and any("ZeRO-3 optimizer keeps no gradient" in str(w.message) for w in caught)


def test_fsdp2_holds_prompts_in_training_and_fsdp1_does_not():
    """Under FSDP2 a held tensor's backward first gathers the sharded module it was computed in
    ([`core.forward.sharded`]); FSDP1's flat parameters have no such hook: there, training forwards its prompts."""
    from types import SimpleNamespace

    from rloo_efficient.trainers.held_prefix import hold_reason

    args = SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    for version, held in ((2, True), (1, False)):
        assert (hold_reason(args, version) is None) == held
    # A unit nested inside another (known once the model is sharded): the first training window says so, holds nothing
    import warnings

    from rloo_efficient.trainers import held_prefix

    for nested in (True, False):
        held = bare_held(fsdp=2)
        with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            patch.setattr(held_prefix, "nested_units", lambda model, nested=nested: nested)
            held.prepare({}, lambda position: None)  # (no buffered batches: nothing to plan)
        said = [str(w.message) for w in caught if "inside another sharded one" in str(w.message)]
        assert held.planner.active_scope is None and held.training == (not nested) and len(said) == nested


def test_image_placeholders_count_against_the_budget_by_group():
    """An image batch's plan keeps each group's prompt apart (their placeholders agree where the images differ) and
    charges each held placeholder token the vision tower's cost too: a budget that holds a group's text holds none
    once its images are counted."""
    image = 7
    system = list(range(100, 180))
    prompts = [system + [image] * 16 + list(range(200 + 40 * g, 240 + 40 * g)) for g in range(2) for _ in range(2)]
    _, _, _, structure = stock_batch(prompts, [[3, 4, 5]] * 4)
    chunks = [np.array([0, 2]), np.array([1, 3])]  # each group's rows in both chunks
    plan = plan_holds(chunk_tables(structure, chunks), full=False, min_saved=0, by_group=True)
    assert len(plan.nodes.length) == 2 and (plan.nodes.parent < 0).all()  # one node per group: no shared system node
    assert list(plan.nodes.first_row) == [0, 1]  # each group's row in its first chunk
    assert len(plan_holds(chunk_tables(structure, chunks), full=False, min_saved=0).nodes.length) == 3  # text: shared
    held = int(plan.nodes.length.sum())
    assert plan_holds(chunk_tables(structure, chunks), full=False, min_saved=0, by_group=True, token_bytes=1,
                      budget=held) is not None  # fmt: skip
    assert plan_holds(chunk_tables(structure, chunks), full=False, min_saved=0, by_group=True, token_bytes=1,
                      budget=held, image_cost=({image}, 100)) is None  # fmt: skip


def test_a_training_micro_batch_cannot_skip_prompts_held_for_it():
    """Stock's forward for a training micro-batch while held prompts wait for their backward would lose their
    gradient: refused, naming the way out."""
    from types import SimpleNamespace

    waiting = bare_planner()
    waiting.active_scope = SimpleNamespace(held=SimpleNamespace(sources={0: object()}))
    with torch.enable_grad(), pytest.raises(RuntimeError, match="held_prefix_budget_gib=0"):
        waiting.check_nothing_held()
    with torch.no_grad():  # a scoring pass: nothing to lose
        waiting.check_nothing_held()
    waiting.active_scope.held.sources = {}
    with torch.enable_grad():
        waiting.check_nothing_held()


def test_a_scoring_pass_forwards_as_many_rows_as_one_of_stocks_forwards_holds():
    """At one row per chunk, a no-grad pass's rows are merged into chunks no larger than one of stock's forwards (a
    row of the batch's width), each group's prompt forwarded once and held: a group's eight rows take about two
    forwards and its prompt's, and each packed forward (the prompt's too) is within stock's. Where the prompts are not
    held, the merge is refused."""
    from rloo_efficient.core.tree.pass_chunks import prompts_held, scoring_chunks
    from rloo_efficient.core.tree.rows import row_tokens

    prompts, completions = rl_rows(seed=3, groups=2, k=8, system=70, task=40)
    input_ids, _, width_c, structure = stock_batch(prompts, completions)
    group, plen, scored, _ = row_tokens(structure)
    budget = input_ids.shape[1]  # one row of stock's batch
    chunks = scoring_chunks(group, plen, scored, budget)
    assert len(chunks) <= 4  # stock: 16 (each group's prompt held: its rows count their own tokens only)
    assert [start for start, _ in chunks[1:]] == [end for _, end in chunks[:-1]] and chunks[-1][1] == len(prompts)
    plan = plan_holds(chunk_tables(structure, [np.arange(*chunk) for chunk in chunks]), full=False)
    assert prompts_held(plan, chunks, group, plen, scored)
    scope = HeldScope(plan, training=False)
    with torch.no_grad():
        for index, (start, end) in enumerate(chunks):
            source = plan.chunks[index].source
            if source is not None:
                forwarded = scope.forward_source(source, lambda **inputs: None, input_ids.shape[1] - width_c, "cpu",
                                                 recurrent=False)  # fmt: skip
                assert forwarded <= budget
            packed = scope.pack(index, input_ids[start:end], width_c, structure[start:end], recurrent=False)
            assert packed.num_tokens <= budget  # within one of stock's forwards
    assert not prompts_held(None, chunks, group, plen, scored)  # nothing held: a later chunk would forward its prompt


def test_a_chunks_own_forward_encodes_images_where_a_member_reads_no_held_prompt():
    """What processes whose every forward is a collective compare beside the held sources: which chunks' own forwards
    call the vision tower (a vision tower called on one process alone would wait for the others' parameter gathers).
    Two groups over three chunks, each prompt held: only the sources encode; nothing held: every chunk with images."""
    group = np.array([0, 0, 0, 1, 1, 1])
    prompts = {0: list(range(1, 71)), 1: list(range(101, 171))}
    tokens = [np.array(prompts[g] + [200 + row, 300 + row]) for row, g in enumerate(group)]
    plen, scored = np.full(6, 70), np.full(6, 2)
    chunks = [(0, 2), (2, 4), (4, 6)]
    plan = plan_holds([(group[a:b], plen[a:b], scored[a:b], tokens[a:b]) for a, b in chunks], full=False, by_group=True)
    assert plan is not None and plan.forward_pattern(3, training=False)[0].tolist() == [1, 1, 0]
    with_images = np.ones(6, dtype=bool)
    assert chunks_encoding(plan, chunks, scored, with_images, False).tolist() == [0, 0, 0]
    assert chunks_encoding(None, chunks, scored, with_images, False).tolist() == [1, 1, 1]
    with_images[4:] = False  # the last chunk's rows without images
    assert chunks_encoding(None, chunks, scored, with_images, False).tolist() == [1, 1, 0]


@pytest.mark.parametrize("empty", [False, True])
def test_a_scope_with_an_empty_prompt_holds_and_merges_nothing(empty):
    """A row with an empty prompt runs stock's forward ([`pack_rows`]: nothing to condition its completion on). Its
    scope holds nothing (a training micro-batch on stock's forward while prompts wait for their backward would lose
    their gradient), and a no-grad pass keeps stock's chunks (stock's forward would split a merged chunk by its batch
    size: more forwards on one process than on the others, each a collective under ZeRO-3)."""
    from rloo_efficient.core.tree.rows import row_tokens

    def batch(system: int, task: int):
        prompts, completions = rl_rows(seed=5, groups=2, k=4, system=system, task=task)
        if empty:
            prompts[4:] = [[]] * 4  # the second group's prompt
        input_ids, _, _, structure = stock_batch(prompts, completions)
        return input_ids.shape[1], structure

    width, structure = batch(system=70, task=40)  # long prompts, one row per chunk: worth holding
    chunks = [(row, row + 1) for row in range(8)]
    assert (plan_holds([row_tokens(structure[a:b]) for a, b in chunks], full=False) is None) == empty
    held = bare_planner()
    # Short prompts, four rows per chunk: both groups merged whole into one chunk, nothing held
    width, structure = batch(system=6, task=4)
    chunks = [(0, 4), (4, 8)]
    merged = held._merged_chunks(structure, chunks, None, width)
    assert (merged is None) == empty
    if not empty:
        assert merged.scope is None and len(merged.chunks) < len(chunks)


@pytest.mark.parametrize("training", [False, True])
def test_a_hybrids_held_node_counts_its_recurrent_states_against_the_budget(training):
    """The planner charges each held node its recurrent states ([`HoldCosts.node_bytes`]) in a no-grad pass and in
    training alike: prompts worth holding one row per chunk are held, and not where a node's states pass the budget."""
    from rloo_efficient.core.forward.scope import chunk_tables

    prompts, completions = rl_rows(seed=3, groups=2, k=8, system=70, task=40)
    input_ids, _, _, structure = stock_batch(prompts, completions)
    chunks = [(row, row + 1) for row in range(len(prompts))]
    for node_bytes, held in ((0, True), (2**41, False)):
        planner = bare_planner(node_bytes=node_bytes)
        if training:
            tables = chunk_tables(structure, [np.arange(*chunk) for chunk in chunks])
            assert (planner.plan_training(list(range(len(chunks))), tables, input_ids.shape[1], None).held
                    is not None) == held  # fmt: skip
        else:
            with torch.no_grad():
                plan = planner.pass_plan(structure, chunks, False, None, input_ids.shape[1])
            assert (plan.scope is not None or len(plan.chunks) < len(chunks)) == held  # held, or merged around holds


def test_a_prompt_sharing_a_source_with_a_longer_lived_one_is_counted_until_its_release():
    """A system prompt read by every chunk and group A's task, first read in chunk 0, are one source, released whole
    after the last chunk: A's task is held to the end, so that a budget of the system prompt and one task leaves group
    B's task (chunks 2 and 3) to its own chunks."""
    from rloo_efficient.core.tree.hold_budget import held_peak

    system = list(range(100, 140))
    tasks = {g: list(range(10 + 30 * g, 30 + 30 * g)) for g in range(2)}
    chunk_groups = [[0], [0], [1], [1]]
    chunks = [(np.array(groups), np.full(len(groups), 60), np.full(len(groups), 2),
               [np.array(system + tasks[g] + [1, 2]) for g in groups]) for groups in chunk_groups]  # fmt: skip
    plan = plan_holds(chunks, full=False, min_saved=0, token_bytes=1)
    assert plan.nodes.length.tolist() == [39, 20, 20]  # the system prompt, each task under it
    plan = plan_holds(chunks, full=False, min_saved=0, token_bytes=1, budget=59)
    assert plan.nodes.length.tolist() == [39, 20]  # B's task not held: A's is, to the end, beside the system prompt
    assert held_peak(plan.source_chunk[plan.nodes.source], plan.nodes.last, plan.nodes.parent, plan.nodes.length,
                     4) == 59  # fmt: skip


def test_processes_whose_hoisted_sources_differ_hold_without_hoisting():
    """Each process hoists by its own prompts' lengths: where every forward is a collective (ZeRO-3, FSDP) and the
    hoisted plans differ, the plans without hoisting are compared next, and held where they agree; where those differ
    too, nothing is held, with one warning."""
    prompts = {g: list(range(10 + 30 * g, 30 + 30 * g)) for g in range(3)}
    chunk_groups = [[0], [0], [1, 2], [1, 2]]
    chunks = [(np.array(groups), np.full(len(groups), 20), np.full(len(groups), 2),
               [np.array(prompts[g] + [1, 2]) for g in groups]) for groups in chunk_groups]  # fmt: skip

    def plan_for(hoist):
        return plan_holds(chunks, full=False, min_saved=0, source_cap=38 if hoist else None)

    def pattern(plan):  # what _plans_agree all-reduces
        rows = np.zeros((3, 4), dtype=np.int64)
        rows[:2] = plan.forward_pattern(4, training=True)
        return np.append(rows.ravel(), 0).tolist()

    assert pattern(plan_for(True)) != pattern(plan_for(False))  # hoisted: B's prompt in chunk 0's source
    for other, hoisted in ((pattern(plan_for(True)), True), (pattern(plan_for(False)), False), (None, None)):
        # (the other process's pattern)
        held = bare_planner(agree=lambda values, other=other: values.tolist() == other)
        plan = held._agreed_plan(plan_for, 4, training=True)
        if hoisted is None:
            assert plan is False and held.warned  # neither agrees: nothing held, one warning
        else:
            assert pattern(plan) == pattern(plan_for(hoisted)) and not held.warned


@pytest.mark.parametrize("merge", [False, True])
def test_a_no_grad_pass_whose_hoisted_plans_differ_holds_the_agreed_unhoisted_plan(merge):
    """Through the trainer's no-grad planning (stock's chunks, or merged ones): where every forward is a collective
    and the processes' hoisted plans differ, the plan held is the unhoisted one they agree on; where neither agrees,
    nothing is held."""
    from rloo_efficient.core.tree.pass_chunks import scoring_chunks
    from rloo_efficient.core.tree.rows import row_tokens

    completion = 60 if merge else 2  # long completions: each group split over merged chunks, its prompt held
    prompts = [list(range(1000 + 200 * g, 1100 + 200 * g)) for g in range(3) for _ in range(4)]
    completions = [[7 + row] * completion for row in range(12)]
    input_ids, _, _, structure = stock_batch(prompts, completions)
    width = input_ids.shape[1]
    stock = [(row, row + 2) for row in range(0, 12, 2)]  # two rows per chunk
    other = []  # the other process's pattern
    trainer = bare_planner(agree=lambda values: values.tolist() == other[-1])
    chunks = stock
    if merge:
        group, plen, scored, _ = row_tokens(structure)
        chunks = scoring_chunks(group, plen, scored, 2 * width)
    plans = {hoist: trainer._scoring_plan(structure, chunks, False, None, width, 2 if hoist else None)
             for hoist in (True, False)}  # fmt: skip
    assert plans[True].source_chunk.tolist() != plans[False].source_chunk.tolist()  # hoisting differs

    def pattern(plan):
        rows = np.zeros((3, len(stock)), dtype=np.int64)
        rows[:2] = plan.forward_pattern(len(stock), training=False)
        return np.append(rows.ravel(), len(chunks) if merge else 0).tolist()

    def plan_held(other_pattern):
        other.append(other_pattern)
        with torch.no_grad():
            if merge:
                merged = trainer._merged_chunks(structure, stock, None, width)
                return None if merged is None else merged.scope and merged.scope.plan
            scope = trainer._held_chunks(structure, stock, False, None, width).scope
            return scope and scope.plan

    for hoist in (True, False):
        held = plan_held(pattern(plans[hoist]))
        assert held.source_chunk.tolist() == plans[hoist].source_chunk.tolist() and not trainer.warned
    assert plan_held(None) is None and trainer.warned  # neither agrees: nothing held, one warning


def test_a_copied_or_pickled_model_records_its_own_latents(monkeypatch):
    """Latent attention's recording `expand_kv` ([`attention.backend.install_attention`]) belongs to its module: a deep
    copy of the model (a reference model made by copying) and a pickled one (`torch.save(model)`) hand over their own
    modules' latents and expand them through their own `kv_b_proj`. Fails with the recording function bound to the
    module as a method: a method is pickled by its function's name, and the loaded model raised AttributeError."""
    import copy
    import io

    from rloo_efficient.core.attention import backend
    from rloo_efficient.core.layers.install import install

    from .helpers import VOCAB, build

    model = build("deepseek_v3")
    install(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    recorded = []
    monkeypatch.setattr(backend, "_record_latents", lambda module, kv_nope, k_rot: recorded.append(module))
    ids = torch.randint(12, VOCAB, (1, 5))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
            recorded.clear()
            assert torch.equal(other(input_ids=ids).logits, want)
            modules = [module for module in other.modules() if hasattr(type(module), "expand_kv")]
            assert recorded == modules
            for module in modules:
                module.kv_b_proj.weight.mul_(2)
            assert not torch.allclose(other(input_ids=ids).logits, want)
