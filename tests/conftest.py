import dataclasses
import math
import os
import warnings

import pytest
import trl

import rloo_efficient
from rloo_efficient.demo.workload import WorkloadConfig, build_dataset, build_model_dir, build_tokenizer, vowel_reward


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=FutureWarning)

METRICS = ("loss", "reward", "kl", "grad_norm", "entropy", "aux_loss")  # aux_loss: MoE models, TRL's default

# `pytest -m "not slow"`: a quick pass (a few minutes on 2 cores) leaving out the process launches, every family but
# the quick ones below, and the single tests that take ten seconds or more; CI runs everything
SLOW_MODULES = {"test_distributed", "test_launchers", "test_doctor", "test_notebook", "test_cli"}
QUICK_FAMILIES = {"llama", "qwen3", "qwen2_vl"}  # a test parametrized over `arch` keeps these in the quick pass
SLOW_TESTS = {
    "test_the_expected_gradient_is_stocks",  # 400 seeds each
    "test_a_whole_run_dispatches_at_most_a_tenth_more_than_stock",
    "test_continuous_batching_generates_as_stock_and_every_other_phase_shares",
    "test_torch_compile_shares_and_matches_stock",
    "test_tools_share_the_first_turn",
    "test_environments_group_by_prompt_and_environment",
    "test_hydra_however_the_policy_is_passed_matches_stock_and_saves_what_stock_saves",
    "test_a_reward_adapter_hydra_cannot_reproduce_is_loaded_as_stock_loads_it",
    # the quick pass keeps a held image batch and the fallbacks' own tests; these add families and layouts to them
    "test_gemma4_without_vision_attention_keeps_image_tokens_causal",
    "test_image_prompts_held_beside_prompts_forwarded_in_place",
    "test_a_family_without_known_image_placement_runs_stock_with_one_warning",
    "test_image_prompts_held_under_trls_row_shuffle",
    "test_grpo_with_the_load_balancing_loss",  # (the packed loss's own tests in test_moe.py stay quick)
    "test_completions_of_different_lengths",
    "test_prompts_with_two_images",
    "test_masked_truncated_completions",
    "test_an_unsupported_reward_model_is_called_as_stock_calls_it",
    "test_a_family_we_have_not_read_runs_stocks_path_and_says_why",
}
# Cases of a quick test that repeat what another case of it covers: one loss of each kind, one layout of each
SLOW_CASES = {
    *(f"test_grpo_matches_stock[loss_{loss}]" for loss in ("bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")),
    "test_small_micro_batches_hold_prompts_and_match_stock[hybrid_one_row]",
    "test_small_micro_batches_hold_prompts_and_match_stock[moe_load_balancing_two_rows]",
    "test_generation_prefills_each_prompt_and_image_once[qwen2_vl-True-False]",
    "test_generation_prefills_each_prompt_and_image_once[qwen2_vl-False-False]",
    "test_same_logits_and_samples_as_generate[qwen2_vl-True-interleaved]",
    "test_same_logits_and_samples_as_generate[qwen2_vl-True-system_prompt]",
    "test_image_prompts_held_across_micro_batches[qwen2_vl-rloo]",
    "test_every_family_matches_stock_trl[qwen2_vl-groups]",
    "test_matches_stock_trl[no_gradient_checkpointing]",
    "test_small_micro_batches_hold_each_prompt_once_and_match_stock[two_rows_stock_order]",
    "test_no_phase_holds_more_than_stocks[1]",  # (the one-row gradients: test_a_held_prompts_backward_leaves_...)
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: launches, families beyond the quick ones, the longest single tests")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        arch = getattr(item, "callspec", None) and item.callspec.params.get("arch")
        if module in SLOW_MODULES or item.originalname in SLOW_TESTS or item.name in SLOW_CASES or (
                isinstance(arch, str) and arch not in QUICK_FAMILIES):  # fmt: skip
            item.add_marker(pytest.mark.slow)


def tiny_workload(tmp_cache, **overrides) -> WorkloadConfig:
    settings = dict(
        prompt_length=64,
        prompt_length_min=40,  # prompts of different lengths in one batch exercise left padding
        num_prompts=16,
        hidden_size=32,  # tiny: the tests compare numbers, not quality
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, as in the real models
        intermediate_size=64,
        max_position_embeddings=512,
        model_dtype="float64",  # equivalence is checked at 1e-6 relative in float64
        model_cache_dir=str(tmp_cache),
    )
    settings.update(overrides)
    return WorkloadConfig(**settings)


def training_args(output_dir, config_class=rloo_efficient.RLOOConfig, **overrides):
    settings = dict(
        output_dir=str(output_dir),
        bf16=False,  # CPU
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,  # short completions keep each run to a second or two
        max_steps=3,
        logging_steps=1,  # every step's metrics are compared
        learning_rate=1e-2,  # large enough that a wrong gradient moves later steps visibly
        beta=0.1,
        steps_per_generation=2,  # the second step reuses buffered generations: old_logps != logps, loss != 0
        report_to=[],
        save_strategy="no",
        seed=1,
        model_init_kwargs={"dtype": "auto"},  # load the saved float64 weights as float64 (TRL defaults to float32)
        disable_tqdm=True,
    )
    if "share_prompt_kv_cache" in {field.name for field in dataclasses.fields(config_class)}:
        # Ours: the prompt's cache kept once whenever it can be (the default chooses by a cost model, and on these
        # tiny models would fan it out: the tests of the kept-once path would run the fanned-out one)
        settings["share_prompt_kv_cache"] = True
    settings.update(overrides)
    return config_class(**settings)


def step_metrics(trainer) -> list[dict]:
    return [{key: entry.get(key) for key in METRICS} for entry in trainer.state.log_history if "loss" in entry]


# Metrics TRL averages over micro-batches: where ours keeps each group in one micro-batch (`shuffle_groups`' default,
# where that only reorders a sum) and a generation spans several micro-batches, they average other micro-batches than
# stock's row shuffle makes. RLOO's kl is the generation batch's
PER_MICRO_BATCH = {"RLOOTrainer": ("entropy",),
                   "GRPOTrainer": ("entropy", "kl", "clip_ratio/region_mean", "clip_ratio/low_mean",
                                   "clip_ratio/high_mean", "cispo_clip_ratio", "vespo/phi_seq_mean")}  # fmt: skip


def per_micro_batch(trainer) -> tuple[str, ...]:
    """The metrics that legitimately differ from stock's for `trainer` (ours): none unless it regrouped rows."""
    switches = getattr(trainer, "_switches", None)
    if not (switches is not None and switches.keep_groups and trainer.args.steps_per_generation > 1):
        return ()
    base = next(cls.__name__ for cls in type(trainer).__mro__ if cls.__module__.startswith("trl."))
    return PER_MICRO_BATCH[base]


def assert_metrics_close(stock: list[dict], ours: list[dict], rtol: float, atol: float, skip=()) -> None:
    assert len(stock) == len(ours) and stock
    for step, (a, b) in enumerate(zip(stock, ours, strict=True)):
        for key in (key for key in METRICS if key not in skip):
            if a[key] is None or (isinstance(a[key], float) and math.isnan(a[key])):
                assert b[key] is None or math.isnan(b[key]), (step, key, a[key], b[key])
                continue
            assert b[key] == pytest.approx(a[key], rel=rtol, abs=atol), f"step {step} {key}: stock {a[key]} ours {b[key]}"


def run(trainer_class, model_path, args, dataset, reward=vowel_reward, processing_class=None, **kwargs):
    trainer = trainer_class(
        model=model_path, reward_funcs=reward, args=args, train_dataset=dataset,
        processing_class=processing_class or build_tokenizer(), **kwargs,
    )  # fmt: skip
    trainer.train()
    return trainer


def emulate_varlen(patch: pytest.MonkeyPatch) -> list[str]:
    """The packed forward's variable-length path on CPU (flash's on CUDA): layouts carry its calls, and the math
    reference, sequence by sequence, runs them. Returns the kernel of each call the tree attention makes, as it makes
    it (not the first-use checks' calls)."""
    from rloo_efficient.core.attention import checks as kernel_checks
    from rloo_efficient.core.tree import layout as layouts

    calls: list[str] = []
    forward = kernel_checks.varlen_forward
    patch.setattr(layouts, "VARLEN_DEVICES", ("cpu",))
    patch.setattr(kernel_checks, "varlen_kernel", lambda query: "math_varlen")
    def recorded(*args):
        if len(args) > 11 and args[11]:  # a call with its configuration: the tree attention's
            calls.append(args[0])
        return forward(*args)

    patch.setattr(kernel_checks, "varlen_forward", recorded)
    return calls


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def workload(model_cache):
    cfg = tiny_workload(model_cache)
    return cfg, build_model_dir(cfg), build_dataset(cfg)


@pytest.fixture(scope="session")
def stock_run(workload, tmp_path_factory):
    """One stock TRL run on the shared workload, compared against by several tests."""
    cfg, path, dataset = workload
    args = training_args(tmp_path_factory.mktemp("stock"), config_class=trl.RLOOConfig)
    return run(trl.RLOOTrainer, path, args, dataset)


class _ExactLogProbs:
    """
    Stand-in for TRL's fused log-prob head (`trl.trainer.utils._ChunkedLogProbFunction`) computing in the model's
    dtype: TRL's computes in float32 even for a float64 model, which caps any float64 comparison at ~1e-7. Patched
    identically into stock TRL and ours, so that both are compared at float64's resolution.
    """

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        import torch

        logits = hidden @ weight.T + (0 if bias is None else bias)
        logits = logits * logit_scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        log_p = torch.log_softmax(logits / temperature, dim=-1)
        log_probs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
        return log_probs, entropy, None, None, None


def _exact_rms_norm(self, hidden_states):
    """RMSNorm in the input's dtype: transformers' upcasts to float32 even for float64 models, rounding a gradient to
    float32 once per row in stock TRL and once per group in ours."""
    import torch

    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _exact_gemma_rms_norm(self, x):
    """Gemma's RMSNorm (a weight of 1 + w), in the input's dtype."""
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _exact_gemma4_rms_norm(self, x):
    """Gemma 4's RMSNorm (a weight of w, or none), in the input's dtype."""
    import torch

    eps = self.eps if hasattr(self, "eps") else self.variance_epsilon  # (renamed in transformers 5.25)
    normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return normed * self.weight if self.with_scale else normed


def _exact_layer_norm(self, x):
    """Cohere's LayerNorm (no bias), in the input's dtype."""
    import torch

    centered = x - x.mean(-1, keepdim=True)
    return self.weight * (centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _exact_vision_rotary(q, k, cos, sin):
    """Qwen3-VL's vision rotary in the queries' dtype."""
    import torch

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# Every family's norm: (module, class, exact forward)
RMS_NORMS = [
    *((family, name, _exact_rms_norm) for family, name in (
        ("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("qwen3", "Qwen3RMSNorm"),
        ("phi3", "Phi3RMSNorm"), ("olmo2", "Olmo2RMSNorm"), ("smollm3", "SmolLM3RMSNorm"),
        ("granite", "GraniteRMSNorm"), ("qwen3_moe", "Qwen3MoeRMSNorm"), ("gpt_oss", "GptOssRMSNorm"),
        ("olmo3", "Olmo3RMSNorm"), ("seed_oss", "SeedOssRMSNorm"), ("qwen2_vl", "Qwen2VLRMSNorm"),
        ("qwen2_5_vl", "Qwen2_5_VLRMSNorm"), ("glm4_moe", "Glm4MoeRMSNorm"), ("deepseek_v3", "DeepseekV3RMSNorm"),
        ("lfm2", "Lfm2RMSNorm"), ("exaone4", "Exaone4RMSNorm"), ("ministral", "MinistralRMSNorm"),
        ("ministral3", "Ministral3RMSNorm"), ("qwen3_vl", "Qwen3VLTextRMSNorm"),
        ("glm4v", "Glm4vRMSNorm"))),
    ("gemma3", "Gemma3RMSNorm", _exact_gemma_rms_norm),  # a weight of 1 + w
    ("gemma2", "Gemma2RMSNorm", _exact_gemma_rms_norm),
    ("gemma4", "Gemma4RMSNorm", _exact_gemma4_rms_norm),
    ("cohere2", "Cohere2LayerNorm", _exact_layer_norm),
]


@pytest.fixture
def exact_head(monkeypatch):
    """float64 all the way, for stock TRL and ours alike: TRL's fused head and transformers' RMSNorm otherwise round
    to float32 (patched here, identically for both)."""
    import importlib

    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", _ExactLogProbs)
    for family, name, exact in RMS_NORMS:
        norm = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
        monkeypatch.setattr(norm, "forward", exact)
    # Qwen3-VL's vision tower applies its rotary in float32: stock's k copies of an image round their gradients there
    # one by one, ours the group's sum once (1e-9 apart after a step)
    for family in ("qwen3_vl", "qwen3_vl_moe"):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        monkeypatch.setattr(module, "apply_rotary_pos_emb_vision", _exact_vision_rotary)
