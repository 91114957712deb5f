"""The drop-in contract: same constructor, same results as stock TRL with our options off; clear errors."""

import warnings

import pytest
import torch
import trl

import rloo_efficient
from rloo_efficient import GRPOTrainer, RLOOConfig, RLOOTrainer
from rloo_efficient.demo.workload import WorkloadConfig, build_dataset, build_model_dir, build_tokenizer, vowel_reward

from .conftest import assert_metrics_close, per_micro_batch, run, step_metrics, tiny_workload, training_args
from .helpers import TransformersSampling, build_reward_model


def test_all_options_off_is_stock_trl(workload, stock_run, tmp_path):
    cfg, path, dataset = workload
    args = training_args(
        tmp_path, share_prompt_prefix=False, share_generation_prefill=False, share_reward_prefix=False,
        hydra_reward_adapter=False, shuffle_groups=False, empty_cache_policy="none",
    )
    ours = run(RLOOTrainer, path, args, dataset)
    # Same computation in the same order: the numbers are identical, not merely close
    assert step_metrics(ours) == step_metrics(stock_run)
    assert list(ours._logs["completion"]) == list(stock_run._logs["completion"])


@pytest.mark.parametrize("trainer_class, stock_config", [(RLOOTrainer, trl.RLOOConfig), (GRPOTrainer, trl.GRPOConfig)])
def test_accepts_a_stock_config(workload, tmp_path, trainer_class, stock_config):
    """A stock TRL config (the one-import switch) becomes ours: its settings kept, ours at their defaults."""
    cfg, path, dataset = workload
    stock_args = training_args(tmp_path, config_class=stock_config, learning_rate=3e-3)
    trainer = trainer_class(model=path, reward_funcs=vowel_reward, args=stock_args, train_dataset=dataset)
    assert isinstance(trainer.args, trainer_class._config_class) and trainer.args.share_prompt_prefix
    assert trainer.args.to_stock().to_dict() == stock_args.to_dict() and trainer.args.learning_rate == 3e-3


@pytest.mark.parametrize("trainer_class, stock_class", [(RLOOTrainer, trl.RLOOTrainer), (GRPOTrainer, trl.GRPOTrainer)])
def test_no_config_is_stocks_default_config_as_ours(workload, tmp_path, monkeypatch, trainer_class, stock_class):
    """`args=None`: stock builds its default config, named after the model; ours builds its own with the same name and
    settings, our fields at their defaults (bf16 on, as on a GPU: transformers refuses it on a CPU-only host)."""
    import transformers.training_args

    _, path, dataset = workload
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    made = {}
    for name, cls in (("stock", stock_class), ("ours", trainer_class)):
        made[name] = cls(model=path, reward_funcs=vowel_reward, train_dataset=dataset,
                         processing_class=build_tokenizer()).args  # fmt: skip
    stock, ours = made["stock"], made["ours"]
    assert isinstance(ours, trainer_class._config_class) and ours.share_prompt_prefix
    assert ours.to_stock().to_dict() == stock.to_dict() and stock.output_dir.endswith(f"-{type(stock).__name__[:4]}")


def test_config_is_a_stock_config_subclass():
    assert issubclass(RLOOConfig, trl.RLOOConfig) and issubclass(RLOOTrainer, trl.RLOOTrainer)
    ours = set(RLOOConfig.__dataclass_fields__) - set(trl.RLOOConfig.__dataclass_fields__)
    assert ours == {
        "share_prompt_prefix", "share_generation_prefill", "share_prefill_tree", "share_prompt_kv_cache",
        "tool_cache_budget_gib", "held_prefix_budget_gib", "share_reward_prefix", "hydra_reward_adapter",
        "shuffle_groups", "empty_cache_policy", "profile_memory", "static_decoding", "share_under_dropout",
        "graph_scoring_passes",
    }  # fmt: skip
    assert rloo_efficient.RLOOConfig is RLOOConfig


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_generations": 1}, "at least 2 generations"),
        ({"per_device_train_batch_size": 3, "num_generations": 4}, "divisible by num_generations"),
        ({"empty_cache_policy": "sometimes"}, "empty_cache_policy"),
        # The profiler's phase boundaries release the cache: without it nothing would be released
        *(({"empty_cache_policy": policy, "profile_memory": False}, f"empty_cache_policy='{policy}' releases")
          for policy in ("after_generation", "every_phase")),
        # A string is truthy: "false" must not turn the feature on
        *(({name: "false"}, f"{name} must be True or False, got 'false'") for name in (
            "share_prompt_prefix", "share_generation_prefill", "share_prefill_tree", "share_reward_prefix",
            "hydra_reward_adapter", "profile_memory", "graph_scoring_passes")),
        *(({name: "false"}, f"{name} must be True, False or None, got 'false'") for name in (
            "share_prompt_kv_cache", "shuffle_groups", "static_decoding")),
        ({"share_prompt_prefix": 1}, "share_prompt_prefix must be True or False, got 1 "),
        ({"tool_cache_budget_gib": -1}, "tool_cache_budget_gib must be None or a number of GiB >= 0"),
        ({"tool_cache_budget_gib": "4"}, "tool_cache_budget_gib must be None or a number of GiB >= 0"),
        ({"held_prefix_budget_gib": -0.5}, "held_prefix_budget_gib must be None or a number of GiB >= 0"),
        ({"held_prefix_budget_gib": True}, "held_prefix_budget_gib must be None or a number of GiB >= 0"),  # not 1
    ],
)
def test_bad_settings_fail_in_the_config(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        training_args(tmp_path, **overrides)


def test_construction_reads_no_prompt_and_trains_what_stock_trains(workload, tmp_path, monkeypatch):
    """No look at the dataset at construction (a million prompts must not stall start-up), and a prompt longer than
    the model's context is not refused: stock TRL trains on it (rotary positions extrapolate), so do we."""
    cfg, path, dataset = workload
    long_prompt = dataset.select([0, 1]).map(lambda row: {"prompt": row["prompt"] * 12})  # > 512 tokens
    calls = []
    tokenizer = build_tokenizer()
    original = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    args = training_args(tmp_path, max_steps=1, steps_per_generation=1)
    trainer = RLOOTrainer(model=path, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=long_prompt, processing_class=tokenizer)  # fmt: skip
    assert calls == []
    trainer.train()
    assert trainer.packed_forward_tokens > 0


def test_reports_the_same_profiling_timers_as_stock(workload, tmp_path, monkeypatch):
    """TRL times its methods for the trackers (`profiling/Time taken: <class>.<method>`); ours keeps every timer."""
    from trl.extras.profiling import ProfilingContext

    cfg, path, dataset = workload
    timed = []
    monkeypatch.setattr(ProfilingContext, "_log_metrics", lambda self, duration: timed.append(self.name))
    run(trl.RLOOTrainer, path, training_args(tmp_path / "s", config_class=trl.RLOOConfig, max_steps=1), dataset)
    stock, timed[:] = set(timed), []
    run(RLOOTrainer, path, training_args(tmp_path / "o", max_steps=1), dataset)
    assert "RLOOTrainer._prepare_inputs" in stock and stock <= set(timed), stock - set(timed)


def test_dynamic_rope_falls_back_to_stock(model_cache, tmp_path):
    """Dynamic NTK scaling recomputes its frequencies from the longest position of each call, which a packed sequence
    or a shorter prefill changes: such a model runs stock TRL's forward and generate, number for number."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_workload(model_cache)
    model = AutoModelForCausalLM.from_pretrained(build_model_dir(cfg), dtype=torch.float64)
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model.save_pretrained(tmp_path / "dynamic")
    dataset = build_dataset(cfg)
    overrides = dict(max_steps=2)
    stock = run(trl.RLOOTrainer, str(tmp_path / "dynamic"), training_args(tmp_path / "s", config_class=trl.RLOOConfig,
                **overrides), dataset)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(RLOOTrainer, str(tmp_path / "dynamic"), training_args(tmp_path / "o", empty_cache_policy="none",
                   **overrides), dataset)  # fmt: skip
    messages = [str(w.message) for w in caught if "rloo_efficient" in str(w.message)]
    assert any("'dynamic'" in m and "prefix sharing is off" in m for m in messages)
    assert any("'dynamic'" in m and "generation prefill is off" in m for m in messages)
    assert ours.packed_forward_tokens == 0 and ours.shared_prefill_tokens == 0
    assert step_metrics(ours) == step_metrics(stock)


def test_workload_rejects_a_prompt_that_cannot_fit_before_loading_anything():
    cfg = WorkloadConfig(prompt_length=600, max_position_embeddings=512)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        cfg.check_fits(max_completion_length=16)
    with pytest.raises(ValueError, match="arch"):
        WorkloadConfig(arch="gpt5")


def test_with_vllm_generation_the_other_phases_still_share_each_prompt(workload, model_cache, tmp_path, monkeypatch, exact_head):
    """With `use_vllm=True` generation is vLLM's; the log-prob, training and reward phases are still ours. Run on a
    stand-in for TRL's vLLM object (no vLLM here): this shows our side of the contract (same metrics as stock given the
    same completions, and each prompt packed once), not anything about vLLM itself."""
    import trl.trainer.rloo_trainer

    cfg, path, dataset = workload
    monkeypatch.setattr(trl.trainer.rloo_trainer, "VLLMGeneration", TransformersSampling)
    reward = build_reward_model(tmp_path / "reward", cfg)
    # 48-token completions: some stop at EOS, so completions of different lengths are packed
    settings = dict(use_vllm=True, max_steps=2, max_completion_length=48)
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "s", config_class=trl.RLOOConfig, **settings), dataset,
                reward=[reward])  # fmt: skip
    calls = TransformersSampling.calls
    ours = run(RLOOTrainer, path, training_args(tmp_path / "o", **settings), dataset, reward=[reward])
    assert calls > 0 and TransformersSampling.calls == 2 * calls  # generation went through the stand-in both times
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    lengths = [e["completions/min_length"] for e in stock.state.log_history if "completions/min_length" in e]
    assert min(lengths) < 48, "no completion stopped at EOS: the case is not exercised"
    # float64 all the way (exact_head): with TRL's float32 head, 48-token sums of log-probs rounded to float32 differ
    # by ~1e-5 relative in the second step's loss
    assert_metrics_close(step_metrics(stock), step_metrics(ours), 1e-9, 1e-12, per_micro_batch(ours))
    assert ours.shared_prefill_tokens == 0  # generation is not ours
    assert ours.packed_forward_tokens > 0 and ours.reward_forward_tokens > 0


# TRL settings users switch on, each run through ours and stock TRL the same way (float64, exact head): GRPO's head in
# float32 outside autocast (TRL's own fused head, which our packed forward calls too), the reference re-synced from
# the policy every step (its weights copied in place: our attention stays installed on it), the completions table
SETTINGS = {"cast_lm_head_to_fp32": ("grpo", dict(cast_lm_head_to_fp32=True)),
            "sync_ref_model": ("rloo", dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)),
            "log_completions": ("rloo", dict(log_completions=True))}  # fmt: skip


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_trl_settings_users_switch_on_share_and_match_stock(workload, tmp_path, exact_head, setting):
    cfg, path, dataset = workload
    trainer, overrides = SETTINGS[setting]
    stock_class, ours_class = ((trl.GRPOTrainer, rloo_efficient.GRPOTrainer) if trainer == "grpo"
                               else (trl.RLOOTrainer, RLOOTrainer))  # fmt: skip
    stock_config, ours_config = ((trl.GRPOConfig, rloo_efficient.GRPOConfig) if trainer == "grpo"
                                 else (trl.RLOOConfig, RLOOConfig))  # fmt: skip
    common = dict(max_steps=2, beta=0.1, **overrides)
    stock = run(stock_class, path, training_args(tmp_path / "s", config_class=stock_config, **common), dataset)
    ours = run(ours_class, path, training_args(tmp_path / "o", config_class=ours_config, **common), dataset)
    assert ours._switches.prefix and ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    # The float32 head rounds the log-probs to float32 in both: float32's resolution there
    rtol, atol = (1e-6, 1e-7) if setting == "cast_lm_head_to_fp32" else (1e-9, 1e-12)
    assert_metrics_close(step_metrics(stock), step_metrics(ours), rtol, atol, per_micro_batch(ours))


def test_torch_compile_shares_and_matches_stock(workload, tmp_path, exact_head):
    """`torch_compile=True` (dynamo's eager backend: the compiled wrapper and its tracing, without inductor's code
    generation, which on CPU takes minutes), two generations: the model TRL generates with is the compiled wrapper,
    whose `generate` is the inner module's, where ours is set for each call and removed after it (left there, the next
    call's prefill ran inside the last one's decoding). Each prompt prefilled once, every forward packed, stock's run."""
    cfg, path, dataset = workload
    common = dict(max_steps=2, steps_per_generation=1, beta=0.1, torch_compile=True, torch_compile_backend="eager")
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "s", config_class=trl.RLOOConfig, **common), dataset)
    ours = run(RLOOTrainer, path, training_args(tmp_path / "o", **common), dataset)
    assert type(ours.model_wrapped).__name__ == "OptimizedModule"  # the compiled wrapper really ran
    assert "generate" not in vars(ours.accelerator.unwrap_model(ours.model_wrapped, keep_torch_compile=False))
    assert ours._switches.prefix and ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    assert_metrics_close(step_metrics(stock), step_metrics(ours), 1e-9, 1e-12, per_micro_batch(ours))


@pytest.mark.parametrize("base", [trl.RLOOTrainer, trl.GRPOTrainer])
def test_the_mixin_names_every_trl_method_it_wraps(base):
    """The mixin is the one place that overrides TRL's methods: its module's docstring lists each (a reader upgrading
    TRL looks there), and each part it delegates to is its own object, none of them a mixin of the trainer."""
    from rloo_efficient.trainers import generation, held_prefix, mixin, packed, parts, ranks, rewards, switches

    wrapped = [name for name in vars(rloo_efficient.GroupSharingMixin) if callable(getattr(base, name, None))]
    assert {"__init__", "training_step", "_prepare_inputs", "_get_per_token_logps_and_entropies"} <= set(wrapped)
    missing = [name for name in wrapped if f"- `{name}`" not in mixin.__doc__]
    assert not missing, missing
    parts = (switches.Switches, ranks.Ranks, generation.SharedGeneration, packed.PackedPasses,
             held_prefix.HeldPrefixes, rewards.RewardScoring, parts.Parts)  # fmt: skip
    assert not any(issubclass(trainer_class, part) for trainer_class in (RLOOTrainer, rloo_efficient.GRPOTrainer)
                   for part in parts)  # fmt: skip


@pytest.mark.parametrize("budget, expected", [(None, "quarter"), (1.5, int(1.5 * 2**30)), (0, 0)])
def test_the_held_prefix_budget_is_a_quarter_of_the_memory_by_default_and_gib_as_given(workload, tmp_path, budget,
                                                                                       expected):  # fmt: skip
    """`held_prefix_budget_gib`: None holds up to a quarter of the device's memory (the host's on CPU), a number that
    many GiB, 0 nothing; the tool loop's budget reads the same way ([`config.default_budget`])."""
    import os

    _, path, dataset = workload
    args = training_args(tmp_path, held_prefix_budget_gib=budget)
    trainer = RLOOTrainer(model=path, reward_funcs=vowel_reward, args=args, train_dataset=dataset)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert trainer._switches.hold_budget == (int(0.25 * host) if expected == "quarter" else expected)


def test_the_default_budget_on_an_accelerator_is_a_quarter_of_its_memory(monkeypatch):
    from types import SimpleNamespace

    from rloo_efficient.trainers.config import default_budget

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    assert default_budget(torch.device("cuda", 0)) == 20 * 2**30
