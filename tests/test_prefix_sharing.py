"""The shared-prefix contract: same completions and per-step metrics as stock TRL, same per-token log-probs and
gradients as the unpacked forward, stock path (with one warning) where packing cannot be exact."""

import warnings

import pytest
import torch
import trl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from trl.trainer.utils import add_fused_lm_head

from rloo_efficient import GRPOTrainer, RLOOTrainer
from rloo_efficient.core.forward.packing import pack_rows
from rloo_efficient.core.layers.families import forward_unsupported_reason as unsupported_reason
from rloo_efficient.core.layers.families import position_period
from rloo_efficient.core.layers.install import install
from rloo_efficient.core.layers.rope import rope_length
from rloo_efficient.core.tree.rows import group_ids_for, prompt_images, row_groups, table_of
from rloo_efficient.demo.workload import (
    build_dataset,
    build_model_dir,
    build_processing_class,
    build_tokenizer,
    vowel_reward,
)
from rloo_efficient.trainers.config import ROWS_KEY
from rloo_efficient.trainers.group_shuffle import ordered_for_group_shuffle
from rloo_efficient.trainers.hydra import HydraReward
from rloo_efficient.trainers.hydra_checks import bitsandbytes_repacks_on_cpu

from .conftest import (
    assert_metrics_close,
    emulate_varlen,
    per_micro_batch,
    run,
    step_metrics,
    tiny_workload,
    training_args,
)
from .helpers import ATOL, POLICY_LORA, RTOL, TRAINING_FAMILIES, assert_same_run, grpo_args, load_as_trl
from .trees import random_rows, split_rows, stock_batch


# float64 weights; TRL's fused LM head returns float32 log-probs whatever the model's dtype, so quantities that are
# differences of log-probs (kl, and the loss through exp(logps - old_logps)) carry float32 rounding: ~1e-8 absolute
F64_RTOL, F64_ATOL = 1e-6, 1e-7

LAYOUTS = {
    "default": {},  # gradient checkpointing on (TRL's default), steps_per_generation=2, beta=0.1
    "no_gradient_checkpointing": {"gradient_checkpointing": False},
    "micro_batch_smaller_than_k": {"per_device_train_batch_size": 2},  # a group spans two micro-batches
    "num_iterations_2": {"num_iterations": 2},
    "beta_0": {"beta": 0.0},
    # 48-token completions: some stop at EOS (asserted below); truncated ones are masked to zero completion tokens
    "eos_and_masked_truncation": {"max_completion_length": 48, "mask_truncated_completions": True, "max_steps": 2},
}


def _compare(path, dataset, tmp_path, rtol=F64_RTOL, atol=F64_ATOL, run_kwargs=None, cache_once=True, **overrides):
    run_kwargs = run_kwargs or {}
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "stock", config_class=trl.RLOOConfig, **overrides),
                dataset, **run_kwargs)  # fmt: skip
    ours = run(RLOOTrainer, path, training_args(tmp_path / "ours", **overrides), dataset, **run_kwargs)
    assert ours._switches.prefix and ours.packed_forward_tokens > 0  # the shared path really ran
    assert ours._switches.prefill and ours.shared_prefill_tokens > 0  # and so did the shared generation prefill
    assert ours._switches.prompt_cache_once == cache_once  # with the prompt's cache once per group where the model allows
    assert list(ours._logs["prompt"]) == list(stock._logs["prompt"])
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    assert_metrics_close(step_metrics(stock), step_metrics(ours), rtol, atol, per_micro_batch(ours))
    return stock, ours


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_stock_trl(workload, tmp_path, layout):
    cfg, path, dataset = workload
    stock, ours = _compare(path, dataset, tmp_path, **LAYOUTS[layout])
    if layout == "eos_and_masked_truncation":
        lengths = [e["completions/min_length"] for e in stock.state.log_history if "completions/min_length" in e]
        assert min(lengths) < 48, "no completion stopped at EOS: the case is not exercised"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])  # llama is the shared workload above
def test_matches_stock_trl_across_architectures(model_cache, tmp_path, arch):
    cfg = tiny_workload(model_cache, arch=arch)
    # Mistral's default config has a sliding window (4096), longer than these sequences: the prompt's cache stays once.
    # The prompts open alike across groups of other lengths: that node's positions are one row's columns, shifted by a
    # constant for the others, and the rotary tables (float32) round the shift apart: Qwen 3's q/k norms carry it to
    # 1.1e-6 of the gradient norm (1e-6 with nothing shared across groups)
    _compare(build_model_dir(cfg), build_dataset(cfg), tmp_path, rtol=3e-6)


# TRL's default: the loss on
MOE = ("gpt_oss", "qwen3_moe", "ernie4_5_moe", "minimax_m2", "qwen3_next", "qwen3_5_moe", "mixtral", "qwen2_moe", "olmoe")


# The family test's micro-batches: each prompt's group (prompts of other lengths: left padding), or a prefix tree
# across groups (a system prompt before every task, tasks of one length, completions of very different lengths)
FAMILY_LAYOUTS = {
    "groups": ({}, {}),
    "tree": (dict(system_prompt_length=80, prompt_length=64, prompt_length_min=None),
             # EOS likelier: lengths 1 to 24. Two steps: in float32 (the MoE families) a third step's update moves
             # GPT-OSS's gradient norm by 2e-4 between any two summation orders (ours without sharing too)
             dict(per_device_train_batch_size=8, steps_per_generation=1, max_completion_length=24, max_steps=2,
                  generation_kwargs={"sequence_bias": [[[2], 2.0]]})),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(FAMILY_LAYOUTS))
@pytest.mark.parametrize("arch", list(TRAINING_FAMILIES))
def test_every_family_matches_stock_trl(model_cache, tmp_path, exact_head, monkeypatch, arch, layout):
    """Under TRL's default config: for the MoE families, the load-balancing loss on (TRL takes its coefficient from the
    config), packed and weighted ([`core.layers.moe`]), its logged `aux_loss` compared too."""
    _family_matches_stock_trl(model_cache, tmp_path, monkeypatch, arch, layout)


# One family per attention kind beyond plain attention: windows (Gemma 3), sinks and MoE (GPT-OSS), latent attention
# with narrower values (DeepSeek-V3), layers reading another layer's keys and a wider global head (Gemma 4), recurrent
# layers beside attention (Qwen3-Next)
VARLEN_FAMILIES = ("gemma3", "gpt_oss", "deepseek_v3", "gemma4", "qwen3_next")


@pytest.mark.parametrize("arch", VARLEN_FAMILIES)
def test_variable_length_calls_match_stock_trl(model_cache, tmp_path, exact_head, monkeypatch, arch):
    """The packed forwards as they run on CUDA in half precision, where flash's variable-length entry point takes the
    nodes in one causal call and each tree level in one call (here the math reference, sequence by sequence, runs
    them): the tree layout of the family test, against stock TRL."""
    calls = emulate_varlen(monkeypatch)
    _family_matches_stock_trl(model_cache, tmp_path, monkeypatch, arch, "tree")
    assert calls and set(calls) == {"math_varlen"}


@pytest.mark.parametrize("arch", ["deepseek_v3", "kimi_linear"])
def test_latent_attention_holds_latents_across_one_row_micro_batches(model_cache, tmp_path, monkeypatch, arch):
    """One row per micro-batch: each prompt is held across its group's micro-batches as its latents, not the keys and
    values they expand to (each reader expands them, as each of stock's rows does), with stock TRL's numbers."""
    from rloo_efficient.core.attention.held import HeldSource

    held, init = [], HeldSource.__init__
    monkeypatch.setattr(HeldSource, "__init__", lambda self, tensors, tokens: held.append(
        {name[0] for name in tensors}) or init(self, tensors, tokens))  # fmt: skip
    cfg = tiny_workload(model_cache, arch=arch, **TRAINING_FAMILIES[arch])
    overrides = dict(per_device_train_batch_size=1, gradient_accumulation_steps=8, steps_per_generation=8, max_steps=2)
    # float32 (the experts' torch._grouped_mm has no float64): the family test's tolerance
    _, ours = _compare(build_model_dir(cfg), build_dataset(cfg), tmp_path, rtol=1e-4, atol=1e-5, **overrides)
    assert ours.held_forward_tokens > 0 and ours._held.training
    assert held and all({"latent", "rot"} <= names and "key" not in names for names in held)


def _family_matches_stock_trl(model_cache, tmp_path, monkeypatch, arch, layout):
    import rloo_efficient.core.forward.passes as mixin  # the packed pass: its pack_rows

    workload, overrides = FAMILY_LAYOUTS[layout]
    cfg = tiny_workload(model_cache, arch=arch, **{**TRAINING_FAMILIES[arch], **workload})
    run_kwargs = {"processing_class": build_processing_class(cfg)}  # a multimodal family's processor, as TRL loads it
    cache_once = arch != "falcon_h1"
    depths, pack = [], mixin.pack_rows
    monkeypatch.setattr(mixin, "pack_rows", lambda *args, **kwargs: (lambda packed: depths.append(
        int(packed.tree.depth.max())) or packed)(pack(*args, **kwargs)))  # fmt: skip
    pinned, pin = [], mixin.rope_length  # LongRoPE: each packed call chooses as stock's padded chunk (its width)
    monkeypatch.setattr(mixin, "rope_length", lambda model, length: pinned.append(length) or pin(model, length))
    if cfg.model_dtype == "float32":
        # torch._grouped_mm (the experts) has no float64: float32, where packing regroups the tokens of each expert's
        # GEMM and so its summation order (2e-7 relative per product), grown through 2 layers and 3 steps
        stock, ours = _compare(build_model_dir(cfg), build_dataset(cfg), tmp_path, rtol=1e-4, atol=1e-5,
                               run_kwargs=run_kwargs, cache_once=cache_once, **overrides)  # fmt: skip
    else:  # float64 all the way (exact_head): the same numbers to float64's resolution
        stock, ours = _compare(build_model_dir(cfg), build_dataset(cfg), tmp_path, rtol=1e-9, atol=1e-12,
                               run_kwargs=run_kwargs, cache_once=cache_once, **overrides)  # fmt: skip
    if arch in MOE:
        assert any("aux_loss" in entry for entry in stock.state.log_history)  # TRL's default turned the loss on
    # Groups: each prompt a node above its completions; the tree: the system prompt a node above the tasks
    assert max(depths) == (2 if layout == "tree" else 1)
    if arch == "phi4_mini":  # each packed call pinned; the tree's chunks (prompts of 144) past the original length
        assert pinned and (layout == "groups" or min(pinned) > 64)
    if layout == "tree":
        lengths = [e["completions/min_length"] for e in stock.state.log_history if "completions/min_length" in e]
        assert min(lengths) < 24, "every completion ran to the end: lengths do not differ"


@pytest.mark.parametrize("arch", list(TRAINING_FAMILIES))
def test_a_node_shared_across_groups_of_other_lengths_shifts_positions_within_rounding(model_cache, exact_head, arch):
    """A system prompt shared by two groups whose tasks are of other lengths: stock's left padding gives the shorter
    group's tokens columns further right; ours gives them the longer group's (one node, one set of positions), a
    constant shift of every position of those rows. Rotary attention (each family's: YaRN, llama3 scaling, partial
    rotary, interleaved, Gemma 4's, Qwen's multimodal sections) reads only the differences: the log-probs agree to the
    rounding of rotary tables computed in float32 (1e-7), where a wrong position is off by 1e-2 and more."""
    cfg = tiny_workload(model_cache, arch=arch, **TRAINING_FAMILIES[arch])
    model = load_as_trl(cfg)
    generator = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(5, 120, (n,), generator=generator).tolist()  # noqa: E731
    system = draw(40)
    prompts = [system + draw(20)] * 3 + [system + draw(9)] * 3  # the second group's prompt 11 tokens shorter
    completions = [draw(n) for n in (6, 3, 1, 5, 6, 2)]
    input_ids, attention_mask, width, rows = stock_batch(prompts, completions)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-width] = -100
    period = position_period(model)
    if period is not None:  # Ministral 3 scales queries by floor(position / 16) here: a shift changes them
        assert "scaled by absolute position" in pack_rows(input_ids, width, rows, min_saved=0, position_period=period)
        return
    with torch.no_grad():
        stock = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        packed = pack_rows(input_ids, width, rows, min_saved=0, position_period=position_period(model))
        ours = packed.unpack(model(**packed.model_inputs(), fused_lm_head=True).log_probs)
    assert packed.tree.depth.max() == 2  # system prompt, then each group's task, then the completions
    # The second group's tokens sit 11 columns further right in stock's rows than their positions here
    columns = packed.source_index % input_ids.shape[1]
    assert set((columns - packed.position_ids[0]).tolist()) == {0, 11}
    scored = labels[:, -width:] != -100
    tolerance = 1e-7 if cfg.model_dtype == "float64" else 1e-4  # float32: the experts' other summation orders
    torch.testing.assert_close(ours[scored], stock.log_probs[:, -width:][scored], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("width", [65, 64])
def test_longrope_chooses_its_factors_as_stocks_padded_forward(model_cache, exact_head, width):
    """LongRoPE (Phi-4-mini) takes its long factors for a whole call when its longest position reaches the original
    length (64 here). Stock's padded batch of width 65 does; our packed rows, which leave out every row's last token,
    reach position 63 only: the call must still choose as stock's (a wrong choice moves the log-probs by 1e-2). Width
    64, the boundary, takes the short factors."""
    import transformers

    cfg = tiny_workload(model_cache, arch="phi4_mini")
    path = build_model_dir(cfg)
    model = transformers.Phi3ForCausalLM.from_pretrained(path, dtype=torch.float64)
    add_fused_lm_head(model, outputs=("log_probs",))
    install(model)
    assert unsupported_reason(model) is None
    generator = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(5, 120, (n,), generator=generator).tolist()  # noqa: E731
    prompts = [draw(width - 20)] * 3 + [draw(30)] * 3
    completions = [draw(n) for n in (20, 7, 3, 12, 20, 1)]
    input_ids, attention_mask, width_c, rows = stock_batch(prompts, completions)
    assert input_ids.shape[1] == width
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-width_c] = -100
    with torch.no_grad():
        stock = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        packed = pack_rows(input_ids, width_c, rows, min_saved=0)
        assert int(packed.position_ids.max()) + 1 == width - 1  # (64: on its own, the call would choose the short ones)
        with rope_length(model, input_ids.shape[1]):
            ours = packed.unpack(model(**packed.model_inputs(), fused_lm_head=True).log_probs)
    scored = labels[:, -width_c:] != -100
    torch.testing.assert_close(ours[scored], stock.log_probs[:, -width_c:][scored], rtol=1e-7, atol=1e-7)


# eager attention is tested in float32 only: transformers' eager path returns NaN logits for float64 models with
# left padding, in stock TRL as in a plain forward (transformers 5.23)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_matches_stock_trl_in_float32(model_cache, tmp_path, attention):
    cfg = tiny_workload(model_cache, model_dtype="float32")
    # float32: packing changes matmul shapes and summation order; the tolerance is float32's
    _compare(build_model_dir(cfg), build_dataset(cfg), tmp_path, rtol=1e-4, atol=1e-5,
             model_init_kwargs={"attn_implementation": attention})  # fmt: skip


def test_matches_stock_trl_with_peft_lora(workload, tmp_path):
    from peft import LoraConfig

    cfg, path, dataset = workload
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    # The reference is the base model with the adapter disabled; the adapter learns fast at this learning rate
    _compare(path, dataset, tmp_path, run_kwargs={"peft_config": lora}, learning_rate=5e-2)


# LoRA as users vary it: DoRA's magnitude (a weight norm per layer in each forward), and an LM head and embedding
# trained whole beside the adapter (PEFT's `modules_to_save`, as for added tokens; on a tied model PEFT trains a copy
# of each), whose gradients ours adds in place ([`core.forward.in_place_grads`]); two rows per micro-batch, each
# prompt held across its group's micro-batches
LORA_VARIANTS = {
    "dora": ({"use_dora": True}, {}),
    "modules_to_save_tied": ({"modules_to_save": ["lm_head", "embed_tokens"]}, {"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("variant", list(LORA_VARIANTS))
def test_matches_stock_trl_with_lora_variants(model_cache, tmp_path, exact_head, variant):
    from peft import LoraConfig

    lora, model = LORA_VARIANTS[variant]
    cfg = tiny_workload(model_cache, **model)
    overrides = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, steps_per_generation=8,
                     learning_rate=5e-2)  # fmt: skip
    _, ours = _compare(build_model_dir(cfg), build_dataset(cfg), tmp_path, RTOL, ATOL,
                       run_kwargs={"peft_config": LoraConfig(**POLICY_LORA, **lora)}, **overrides)  # fmt: skip
    assert ours.held_forward_tokens > 0
    if variant == "modules_to_save_tied":  # the trained copy's gradient added in place (the head is the test's own)
        assert ours._counts.in_place_embedding_grads > 0


def test_two_epochs_with_a_short_last_window_match_stock_trl(model_cache, tmp_path, exact_head):
    """Two epochs of 4 micro-batches in optimizer windows of 3: each epoch ends with a window of 1, and the second's
    first window starts mid-generation."""
    cfg = tiny_workload(model_cache, num_prompts=5)  # 2 generations of 2 prompts (k=4, 4 rows a micro-batch) an epoch
    overrides = dict(max_steps=-1, num_train_epochs=2, gradient_accumulation_steps=3, steps_per_generation=2)
    stock, ours = _compare(build_model_dir(cfg), build_dataset(cfg), tmp_path, RTOL, ATOL, **overrides)
    assert ours.state.global_step == 4 and ours.held_forward_tokens > 0


# QLoRA as TRL's scripts run it (`--load_in_4bit --use_peft`): the trainer's `quantization_config` argument, or the
# config's `model_init_kwargs` (then stock loads a reward adapter's model quantized too, the case Hydra would share)
QLORA_CASES = {
    "rloo_trainer_argument": (RLOOTrainer, trl.RLOOTrainer, trl.RLOOConfig, False, {}),
    "grpo_trainer_argument": (GRPOTrainer, trl.GRPOTrainer, trl.GRPOConfig, False, {"beta": 0.0}),
    "rloo_init_kwargs_and_reward_adapter": (RLOOTrainer, trl.RLOOTrainer, trl.RLOOConfig, True, {}),
    # GRPO's own config as on a GPU: bf16 weights, compute and autocast (on CPU processes)
    "grpo_bf16": (GRPOTrainer, trl.GRPOTrainer, trl.GRPOConfig, False,
                  {"beta": 0.0, "bf16": True, "use_cpu": True, "dtype": torch.bfloat16}),
    # the memory-bound user's setting: one row per micro-batch, each prompt held across its group's micro-batches
    "grpo_one_row_per_micro_batch": (GRPOTrainer, trl.GRPOTrainer, trl.GRPOConfig, False,
                                     {"beta": 0.0, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8,
                                      "steps_per_generation": 16}),
}


@pytest.mark.parametrize("case", list(QLORA_CASES))
def test_matches_stock_trl_with_qlora(model_cache, tmp_path, case):
    """A 4-bit base (bitsandbytes on CPU) with a LoRA adapter, which TRL casts to bfloat16 for a quantized model: the
    adapter's products round to bfloat16, and packed and padded rows round apart by an ulp of it. Where a reward
    adapter would score on the policy's base, on CPU bitsandbytes would repack that base for inference, for good, and
    the policy would train with no gradient: ours loads the reward model as stock does, with one warning."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    from .helpers import build_reward_adapter

    ours_class, stock_class, stock_config, adapter, layout = QLORA_CASES[case]
    layout = dict(layout)
    dtype = layout.pop("dtype", torch.float32)
    # float32 (bitsandbytes quantizes nothing wider); hidden 64: bitsandbytes' CPU packing reads 64-wide blocks
    cfg = tiny_workload(model_cache, model_dtype="float32", hidden_size=64, intermediate_size=128)
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    run_kwargs = {"peft_config": LoraConfig(**POLICY_LORA)}
    init_kwargs = {"dtype": dtype}
    if adapter:
        init_kwargs["quantization_config"] = quantization
        reward_adapter = build_reward_adapter(tmp_path / "reward_adapter", path)
    else:
        run_kwargs["quantization_config"] = quantization
    rewards = lambda: [vowel_reward, reward_adapter] if adapter else vowel_reward  # noqa: E731 (TRL loads in place)
    overrides = dict(max_steps=2, learning_rate=5e-2, model_init_kwargs=init_kwargs, **layout)
    stock = run(stock_class, path, training_args(tmp_path / "stock", config_class=stock_config, **overrides), dataset,
                reward=rewards(), **run_kwargs)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(ours_class, path, training_args(tmp_path / "ours", config_class=ours_class._config_class,
                                                   **overrides), dataset, reward=rewards(), **run_kwargs)  # fmt: skip
    assert any(type(parameter).__name__ == "Params4bit" for parameter in ours.model.parameters())
    assert ours._switches.prefix and ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    assert (ours.held_forward_tokens > 0) == ("one_row" in case)  # prompts held across micro-batches there
    repacked = [w for w in caught if "bitsandbytes repacks a 4-bit layer" in str(w.message)]
    if adapter:  # Hydra where bitsandbytes does not repack on this CPU, stock's loading (and one warning) where it does
        assert len(repacked) == bitsandbytes_repacks_on_cpu() != isinstance(ours.reward_funcs[1], HydraReward)
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    # A bfloat16 gradient norm an ulp apart (2**-10 at 0.23), and the loss's float32 terms
    assert_metrics_close(step_metrics(stock), step_metrics(ours), 1e-2, 1e-4, per_micro_batch(ours))


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_lora_under_bf16_mixed_precision_prefills_as_stocks_generation(model_cache, tmp_path, monkeypatch, arch):
    """LoRA under accelerate's bf16 autocast on float32 weights (TRL's `bf16=True`): accelerate wraps the PEFT model's
    forward in autocast, which `PeftModel.generate` never calls, so stock's generation runs without autocast. Ours'
    prefills (the tree's, with a system prompt) run as it does: every forward of the generation phase without autocast,
    stock's completions. Fails with the prefill called through the PEFT model's forward (under autocast: Llama's prompt
    keys in bf16 precision; DeepSeek-V3's decoding raised a dtype error expanding bf16 latents in float32)."""
    from peft import LoraConfig

    autocast = {}  # per run: whether each forward of the generation phase ran under autocast

    def recorded(name):
        def generate(self, *args, **kwargs):
            inner = self.accelerator.unwrap_model(self.model).get_base_model()
            hook = inner.register_forward_pre_hook(
                lambda module, args: autocast.setdefault(name, set()).add(torch.is_autocast_enabled("cpu")))
            try:
                return single_turn(self, *args, **kwargs)
            finally:
                hook.remove()
        return generate

    single_turn = trl.RLOOTrainer._generate_single_turn
    cfg = tiny_workload(model_cache, arch=arch, model_dtype="float32", system_prompt_length=40)
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    lora = LoraConfig(**{**POLICY_LORA, "target_modules": ["q_b_proj", "kv_b_proj"]} if arch == "deepseek_v3" else
                      POLICY_LORA)  # fmt: skip
    overrides = dict(max_steps=1, bf16=True, use_cpu=True)
    runs = {}
    for name, trainer_class, config_class in (("stock", trl.RLOOTrainer, trl.RLOOConfig), ("ours", RLOOTrainer, None)):
        monkeypatch.setattr(trl.RLOOTrainer, "_generate_single_turn", recorded(name))
        args = training_args(tmp_path / name, **({"config_class": config_class} if config_class else {}), **overrides)
        runs[name] = run(trainer_class, path, args, dataset, peft_config=lora)
    stock, ours = runs["stock"], runs["ours"]
    assert ours.shared_prefill_tokens > 0 and ours._switches.prefill
    assert autocast == {"stock": {False}, "ours": {False}}
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])


def test_matches_stock_trl_with_a_chat_template(model_cache, tmp_path):
    cfg = tiny_workload(model_cache, conversational=True)
    _compare(build_model_dir(cfg), build_dataset(cfg), tmp_path)


def test_groups_are_tokenized_once(workload, tmp_path):
    cfg, path, dataset = workload
    trainer = RLOOTrainer(model=path, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=training_args(tmp_path), train_dataset=dataset, processing_class=build_tokenizer())  # fmt: skip
    calls = []
    tokenizer_call = type(trainer.processing_class).__call__

    def counting_call(self, *args, **kwargs):
        calls.append(len(kwargs.get("text") or args[0]))
        return tokenizer_call(self, *args, **kwargs)

    prompts = [dataset[0]["prompt"]] * 4 + [dataset[1]["prompt"]] * 4
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(trainer.processing_class), "__call__", counting_call)
        ids, _, _ = trainer._tokenize_prompts(prompts)
    assert calls == [2]  # two unique strings, one tokenizer call
    assert ids[0] == ids[3] and ids[4] == ids[7] and ids[0] != ids[4]
    assert ids[0] is not ids[3]  # each row owns its list: an in-place edit of one row leaves the others alone


# -- packed forward == unpacked forward, over random prefix trees -----------------------------------------------------
@pytest.fixture(scope="module")
def scoring_model(workload):
    cfg, path, dataset = workload
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install(model)  # the packed layout is read by our attention function (the stock call passes none)
    return model


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), min_saved=st.sampled_from([0, 64]), unscored=st.booleans())
def test_packed_forward_equals_unpacked(scoring_model, seed, min_saved, unscored):
    """Random trees of prompts and completions (shared openings, one-token runs, rows ending inside another's tokens,
    completions of very different lengths), some rows unscored: the same per-token log-probs, entropies and gradients
    as stock's padded forward, and the packed sequence holds no padding."""
    rows = random_rows(seed, vocab=250)
    prompts, completions = split_rows(rows, seed)
    scored = [0 if unscored and i % 3 == 0 else len(c) for i, c in enumerate(completions)]
    input_ids, attention_mask, width_c, structure = stock_batch(prompts, completions, scored)
    model = scoring_model

    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-width_c] = -100
    model.zero_grad()
    stock = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    stock_logps, stock_entropy = stock.log_probs[:, -width_c:], stock.entropy[:, -width_c:]
    weights = torch.linspace(-1, 1, stock_logps.numel()).view_as(stock_logps)
    ((stock_logps * weights).sum() + stock_entropy.sum()).backward()
    stock_grads = [p.grad.clone() for p in model.parameters()]

    packed = pack_rows(input_ids, width_c, structure, min_saved=min_saved)
    # No padding: every packed token is a real input of a row (a row's last token predicts nothing)
    inputs = sum(len(p) + n - 1 for p, n in zip(prompts, scored, strict=True) if n) if any(scored) else None
    if inputs is not None:
        assert packed.num_tokens <= inputs and packed.tree.real_tokens <= packed.num_tokens + len(prompts)
    model.zero_grad()
    out = model(**packed.model_inputs(), fused_lm_head=True)
    logps, entropy = packed.unpack(out.log_probs), packed.unpack(out.entropy)
    ((logps * weights).sum() + entropy.sum()).backward()

    torch.testing.assert_close(logps, stock_logps, rtol=0, atol=1e-6)  # float32 outputs of a float64 model
    scored_mask = labels[:, -width_c:] != -100
    torch.testing.assert_close(entropy[scored_mask], stock_entropy[scored_mask], rtol=0, atol=1e-6)
    # TRL's fused head computes in float32: gradients carry float32 rounding relative to the gradient's scale
    scale = max(g.abs().max().item() for g in stock_grads)
    for p, expected in zip(model.parameters(), stock_grads, strict=True):
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-6 * scale + 1e-12)


# -- group structure and shuffling -------------------------------------------------------------------------------------
def test_group_ids_follow_prompt_strings():
    chat = [{"role": "user", "content": "hi"}]
    assert group_ids_for(["a", "b", "a", "c"]).tolist() == [0, 1, 0, 2]
    assert group_ids_for([chat, chat, [{"role": "user", "content": "yo"}]]).tolist() == [0, 0, 1]


def test_image_prompts_group_by_pixels_not_by_object():
    """Two image objects with the same pixels are one prompt; two images of one size with other pixels are two (an
    image's default text holds its memory address: every row would be a group of its own)."""
    import numpy as np
    from PIL import Image

    def chat(image):
        return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "what?"}]}]

    same, copy = Image.new("RGB", (8, 8), (1, 2, 3)), Image.new("RGB", (8, 8), (1, 2, 3))
    other = Image.new("RGB", (8, 8), (1, 2, 4))  # one value of one channel differs
    pixels = np.zeros((4, 4, 3), dtype=np.uint8)
    assert group_ids_for([chat(same), chat(copy), chat(other), chat(same)]).tolist() == [0, 0, 1, 0]
    assert group_ids_for([chat(pixels), chat(pixels.copy()), chat(pixels + 1)]).tolist() == [0, 0, 1]
    # The packed forward's groups: an image's placeholder tokens are the same whatever its pixels
    prompts = [chat(same), chat(copy), chat(other), chat(other)]
    assert row_groups([[5, 6, 7]] * 4, [1] * 4, prompt_images(prompts))[:, 0].tolist() == [0, 0, 1, 1]
    assert prompt_images([[{"role": "user", "content": "text"}]]) is None


def test_an_image_groups_prompt_is_packed_once_whatever_it_saves():
    """A text batch leaves a prompt that saves fewer than `min_saved` tokens in each of its rows; an image batch packs
    each group's prompt once whatever it saves, so that its images are encoded once per group (token 9: the
    placeholder)."""
    prompts = [[5, 9, 9, 7]] * 2 + [[6, 9, 9, 8]] * 2
    input_ids, _, width_c, structure = stock_batch(prompts, [[11, 12], [13], [14, 15], [16, 17]])
    text, image = pack_rows(input_ids, width_c, structure), pack_rows(input_ids, width_c, structure, image_tokens={9})
    assert int((text.input_ids == 9).sum()) == 8 and int((image.input_ids == 9).sum()) == 4
    assert image.first_rows.tolist() == [0, 2]


def test_an_empty_prompt_is_not_packed():
    """A row with an empty prompt has no position to predict its first completion token from (stock's reads a padding
    column): the batch is not packed, and says why (the stock forward runs), whatever the other rows."""
    prompts = [[5, 6, 7], [5, 6, 7], [], []]
    input_ids, _, width_c, structure = stock_batch(prompts, [[11, 12], [13], [14, 15], [16, 17]])
    for rows in (slice(None), slice(2, None)):
        assert "empty prompt" in pack_rows(input_ids[rows], width_c, structure[rows])


def test_shuffle_groups_keeps_groups_together_and_draws_like_the_row_shuffle():
    """The batch is ordered before TRL shuffles it, so that TRL's own row shuffle (drawn next) keeps each group's rows
    together; the generator is drawn exactly as for stock's shuffle."""
    from trl.trainer.utils import shuffle_sequence_dict

    group_ids = torch.arange(4).repeat_interleave(3)
    batch = {"group_ids": group_ids, "x": torch.arange(12) * 10, "names": [f"r{i}" for i in range(12)], "n": None,
             "pairs": tuple((i, i) for i in range(12)), "count": torch.tensor(5)}  # a scalar passes through, as in TRL
    torch.manual_seed(0)
    shuffled = shuffle_sequence_dict(ordered_for_group_shuffle(batch, group_ids))
    after_groups = torch.rand(1)
    torch.manual_seed(0)
    row_permutation = torch.randperm(12)
    assert torch.equal(torch.rand(1), after_groups)  # the generator advanced exactly as for a row shuffle
    order = shuffled["x"] // 10
    assert torch.equal(shuffled["group_ids"], group_ids[order]) and shuffled["names"] == [f"r{i}" for i in order.tolist()]
    assert shuffled["pairs"] == [(i, i) for i in order.tolist()] and shuffled["n"] is None
    assert shuffled["count"].item() == 5
    runs = shuffled["group_ids"].view(4, 3)
    assert (runs == runs[:, :1]).all()  # each group contiguous
    first_seen = list(dict.fromkeys(group_ids[row_permutation].tolist()))
    assert runs[:, 0].tolist() == first_seen
    rank = {row: place for place, row in enumerate(row_permutation.tolist())}
    for run_rows in order.view(4, 3).tolist():  # within a group, rows in their row-shuffle order
        assert [rank[row] for row in run_rows] == sorted(rank[row] for row in run_rows)


def test_the_rows_ride_trls_shuffle_and_split_without_a_tensor_copy():
    """The batch carries the rows as a host array per row: TRL's shuffle and split take them in the order they take
    every field, make no tensor of them (a tensor field is copied by the shuffle: in the CPU proxy's count of live
    bytes) and read no tensor's item (a list's shuffle would read each entry of the permutation)."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    from rloo_efficient.core.tree.rows import carried
    from rloo_efficient.profiling.live_bytes import LiveBytes
    from rloo_efficient.profiling.op_count import OpCounter

    prompts = [[1, 2, 3]] * 3 + [[4, 5]] * 3
    rows = row_groups(prompts, [2, 1, 0, 2, 2, 1], completion_ids=[[7, 8]] * 6)
    batch = {"prompt_ids": torch.arange(6 * 3).view(6, 3), "x": torch.arange(6) * 10}

    def shuffled_and_split(fields: dict) -> tuple[list[dict], int, int]:
        torch.manual_seed(0)
        with LiveBytes(sites=False) as live, OpCounter() as ops:
            chunks = split_tensor_dict(shuffle_sequence_dict(fields), 2)
        return chunks, live.peak, ops.host_syncs

    stock, stock_bytes, stock_syncs = shuffled_and_split(batch)
    ours, ours_bytes, ours_syncs = shuffled_and_split({**batch, ROWS_KEY: carried(rows)})
    assert ours_bytes == stock_bytes and ours_syncs == stock_syncs == 0  # no byte, and no read, more than stock's
    for stock_chunk, ours_chunk in zip(stock, ours, strict=True):
        order = stock_chunk["x"] // 10
        assert torch.equal(table_of(ours_chunk[ROWS_KEY]), rows[order])  # each row's own, in the batch's order


def test_micro_batches_keep_groups_by_default_where_that_only_reorders_a_sum(workload, tmp_path):
    """TRL's default (generation in step with the optimizer) with gradient accumulation: ours keeps each group in one
    micro-batch (its prompt packed once there), and the run is stock's up to the order of its sums; with
    `shuffle_groups=False`, stock's row order (each prompt held across the micro-batches holding its rows), every
    metric stock's (the per-micro-batch entropy average too)."""
    cfg, path, dataset = workload
    common = dict(gradient_accumulation_steps=2, steps_per_generation=2, max_steps=2)
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "s", config_class=trl.RLOOConfig, **common), dataset)
    ours = run(RLOOTrainer, path, training_args(tmp_path / "o", **common), dataset)
    rows = run(RLOOTrainer, path, training_args(tmp_path / "r", shuffle_groups=False, **common), dataset)
    assert ours._switches.keep_groups and not rows._switches.keep_groups
    for batch in ours._buffered_inputs:
        groups = table_of(batch[ROWS_KEY])[:, 0]
        assert (groups == groups[0]).all()  # one whole group per micro-batch
    # stock's order: split
    assert any(len(set(table_of(batch[ROWS_KEY])[:, 0].tolist())) > 1 for batch in rows._buffered_inputs)
    # Stock's row order splits each group over both micro-batches: its prompt is held across them, and no more tokens
    # are forwarded than with each group in one micro-batch
    assert ours.packed_forward_tokens == rows.packed_forward_tokens and rows.held_forward_tokens > 0
    assert list(ours._logs["completion"]) == list(stock._logs["completion"]) == list(rows._logs["completion"])
    assert per_micro_batch(ours) == ("entropy",) and per_micro_batch(rows) == ()
    assert_metrics_close(step_metrics(stock), step_metrics(ours), F64_RTOL, F64_ATOL, skip=("entropy",))
    assert_metrics_close(step_metrics(stock), step_metrics(rows), F64_RTOL, F64_ATOL)


# -- fallbacks -------------------------------------------------------------------------------------------------------
def test_absolute_positions_fall_back_with_one_warning(model_cache, tmp_path):
    cfg = tiny_workload(model_cache)
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=512,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))  # fmt: skip
    gpt2.save_pretrained(tmp_path / "gpt2")
    dataset = build_dataset(cfg)
    overrides = dict(max_steps=2, disable_dropout=True, model_init_kwargs=None)
    stock = run(trl.RLOOTrainer, str(tmp_path / "gpt2"), training_args(tmp_path / "s", config_class=trl.RLOOConfig,
                **overrides), dataset)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(RLOOTrainer, str(tmp_path / "gpt2"), training_args(tmp_path / "o", **overrides), dataset)
    messages = [str(w.message) for w in caught if "prompt-prefix sharing is off" in str(w.message)]
    assert len(messages) == 1 and "only verified for" in messages[0]  # absolute positions: not a listed family
    assert ours.packed_forward_tokens == 0
    assert step_metrics(ours) == step_metrics(stock)


# Models whose stock run packing cannot reproduce, each a family's checkpoint with one config field changed: (arch,
# workload settings, the field, the reason warned about)
UNREPRODUCIBLE = {
    # Stock zeroes its left padding before a recurrent layer's input projection: with a bias there, each pad enters
    # the convolution as the bias and reaches the row's first tokens
    "mamba2_projection_bias": ("nemotron_h", dict(model_dtype="float32", num_hidden_layers=3), dict(use_bias=True),
                               "input projection has a bias"),
    "short_conv_projection_bias": ("lfm2", {}, dict(conv_bias=True), "input projection has a bias"),
    # Fresh noise per token in training, in generation and in the training forward; with the load-balancing loss off
    "router_jitter": ("minimax_m2", dict(model_dtype="float32"),
                      dict(router_jitter_noise=0.1, router_aux_loss_coef=0.0), "router adds random jitter"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(UNREPRODUCIBLE))
def test_what_packing_cannot_reproduce_runs_stock_with_one_warning(model_cache, tmp_path, case):
    from transformers import AutoTokenizer

    arch, settings, field, reason = UNREPRODUCIBLE[case]
    cfg = tiny_workload(model_cache, arch=arch, **settings)
    saved = build_model_dir(cfg)
    model = AutoModelForCausalLM.from_pretrained(saved, dtype="auto", **field)
    with torch.no_grad():  # the biases the checkpoint lacks, drawn (transformers would start them at zero)
        for name, parameter in model.named_parameters():
            if name.endswith("in_proj.bias"):
                parameter.normal_(generator=torch.Generator().manual_seed(0))
    path = str(tmp_path / "model")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(saved).save_pretrained(path)
    dataset = build_dataset(cfg)
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "s", config_class=trl.RLOOConfig, max_steps=2), dataset)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(RLOOTrainer, path, training_args(tmp_path / "o", max_steps=2), dataset)
    # The packed forwards and the shared prefill, each off with one warning naming the reason
    for phase in ("prompt-prefix sharing is off", "shared generation prefill is off"):
        assert len([w for w in caught if phase in str(w.message) and reason in str(w.message)]) == 1, phase
    assert ours.packed_forward_tokens == 0 and ours.shared_prefill_tokens == 0
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    assert step_metrics(ours) == step_metrics(stock)


def test_active_dropout_falls_back(model_cache, tmp_path):
    cfg = tiny_workload(model_cache)
    path = build_model_dir(cfg)
    args = training_args(tmp_path, model_init_kwargs={"dtype": "auto", "attention_dropout": 0.1})
    with pytest.warns(UserWarning, match="dropout is active"):
        trainer = RLOOTrainer(model=path, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                              train_dataset=build_dataset(cfg), processing_class=build_tokenizer())  # fmt: skip
    assert not trainer._switches.prefix


@pytest.mark.parametrize("disable_dropout", [False, True])
def test_lora_dropout_says_what_to_set_and_disable_dropout_shares(model_cache, tmp_path, disable_dropout):
    """TRL's `ModelConfig.lora_dropout` defaults to 0.05, so `--use_peft` trains with dropout unless told otherwise:
    the one warning names the two settings that share; with TRL's `disable_dropout=True` every path shares."""
    from peft import LoraConfig

    cfg = tiny_workload(model_cache)
    args = training_args(tmp_path, disable_dropout=disable_dropout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = RLOOTrainer(model=build_model_dir(cfg), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=build_dataset(cfg), processing_class=build_tokenizer(),
                              peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05,
                                                     target_modules=["q_proj", "v_proj"]))  # fmt: skip
    messages = [str(w.message) for w in caught if "dropout is active" in str(w.message)]
    if disable_dropout:
        assert not messages and trainer._switches.prefix and trainer._switches.prefill
    else:
        named = ("LoRA's dropout", "lora_dropout=0", "disable_dropout=True", "share_under_dropout=True",
                 "--lora_dropout 0", "--disable_dropout true", "--share_under_dropout true")  # (the flags: the CLI's)
        assert messages and all(all(part in m for part in named) for m in messages) and not trainer._switches.prefix


def test_functional_residual_dropout_counts_as_dropout(model_cache):
    """Seed-OSS applies residual dropout as a function call with a rate its modules copied from the config when built
    (no nn.Dropout, and TRL's disable_dropout leaves it on): it is active dropout, named."""
    from transformers import SeedOssConfig, SeedOssForCausalLM

    config = SeedOssConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_dropout=0.0,
                           residual_dropout=0.1)  # fmt: skip
    model = SeedOssForCausalLM(config)
    config.residual_dropout = 0.0  # the modules keep the rate they were built with
    assert "residual_dropout=0.1" in unsupported_reason(model)
    assert unsupported_reason(SeedOssForCausalLM(config)) is None


def test_a_model_that_attends_bidirectionally_is_not_packed(model_cache):
    """Gemma 3 can be configured to attend bidirectionally (its embedding variants): packing assumes causal
    attention, so it names the reason; and so does a family it does not know."""
    cfg = tiny_workload(model_cache, arch="gemma3")
    model = AutoModelForCausalLM.from_pretrained(build_model_dir(cfg))
    assert unsupported_reason(model) is None
    model.config.use_bidirectional_attention = True
    assert "bidirectional" in unsupported_reason(model)
    # Gemma 4's "vision" makes image tokens attend both ways, text stays causal; "all" is bidirectional everywhere
    gemma4 = AutoModelForCausalLM.from_pretrained(build_model_dir(tiny_workload(model_cache, arch="gemma4")))
    assert gemma4.config.get_text_config().use_bidirectional_attention == "vision" and unsupported_reason(gemma4) is None
    gemma4.config.get_text_config().use_bidirectional_attention = "all"
    assert "bidirectional" in unsupported_reason(gemma4)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16))
    assert "only verified for" in unsupported_reason(gpt2)


@pytest.mark.parametrize("arch", ["gemma3_vlm", "qwen2_vl", "gemma4"])
def test_a_multimodal_checkpoint_with_chat_prompts_and_no_image_shares(model_cache, tmp_path, exact_head, arch):
    """GRPO with a multimodal checkpoint and its processor, chat prompts without images: TRL renders them through the
    processor, which returns all-zero token types beside the tokens; they reach generate as stock passes them. Every
    phase shares, and the run is stock's."""
    from rloo_efficient import GRPOConfig, GRPOTrainer

    cfg = tiny_workload(model_cache, arch=arch, conversational=True, sliding_window=16)
    path, dataset = build_model_dir(cfg), build_dataset(cfg)

    def token_reward(completion_ids, **kwargs):  # varies within every group (the byte-vowel reward can be all 0 here)
        return [float(sum(ids) % 17) for ids in completion_ids]

    fields = []

    class Recording(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
            fields.append(sorted(multimodal_fields))
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)

    settings = dict(beta=0.1, max_steps=2)
    stock = run(trl.GRPOTrainer, path, grpo_args(tmp_path / "s", config_class=trl.GRPOConfig, **settings), dataset,
                reward=token_reward, processing_class=build_processing_class(cfg))  # fmt: skip
    ours = run(Recording, path, grpo_args(tmp_path / "o", config_class=GRPOConfig, **settings), dataset,
               reward=token_reward, processing_class=build_processing_class(cfg))  # fmt: skip
    token_types = "token_type_ids" if arch == "gemma3_vlm" else "mm_token_type_ids"
    assert fields and all(names == [token_types] for names in fields)  # the processor's zero token types came along
    assert ours._is_vlm and ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    assert_same_run(stock, ours)
