"""The drop-in contract: same constructor, same results as stock TRL with our options off; clear errors."""

import json

import pytest
import trl

import rloo_efficient
from rloo_efficient import RLOOConfig, RLOOTrainer
from rloo_efficient.workload import WorkloadConfig

from .conftest import run, step_metrics, training_args


def test_all_options_off_is_stock_trl(workload, stock_run, tmp_path):
    cfg, path, dataset = workload
    args = training_args(
        tmp_path, share_prompt_prefix=False, share_generation_prefill=False, shuffle_groups=False,
        empty_cache_policy="none",
    )
    ours = run(RLOOTrainer, path, args, dataset)
    # Same computation in the same order: the numbers are identical, not merely close
    assert step_metrics(ours) == step_metrics(stock_run)
    assert list(ours._logs["completion"]) == list(stock_run._logs["completion"])


def test_accepts_a_stock_config(workload, stock_run, tmp_path):
    cfg, path, dataset = workload
    stock_args = training_args(tmp_path, config_class=trl.RLOOConfig)
    trainer = RLOOTrainer(model=path, reward_funcs=stock_run.reward_funcs, args=stock_args, train_dataset=dataset)
    assert isinstance(trainer.args, RLOOConfig)
    assert trainer.args.learning_rate == stock_args.learning_rate and trainer.args.share_prompt_prefix


def test_config_is_a_stock_config_subclass():
    assert issubclass(RLOOConfig, trl.RLOOConfig) and issubclass(RLOOTrainer, trl.RLOOTrainer)
    ours = set(RLOOConfig.__dataclass_fields__) - set(trl.RLOOConfig.__dataclass_fields__)
    assert ours == {
        "share_prompt_prefix", "share_generation_prefill", "share_prompt_kv_cache", "shuffle_groups",
        "empty_cache_policy", "profile_memory",
    }  # fmt: skip
    assert rloo_efficient.RLOOConfig is RLOOConfig


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_generations": 1}, "at least 2 generations"),
        ({"per_device_train_batch_size": 3, "num_generations": 4}, "divisible by num_generations"),
        ({"empty_cache_policy": "sometimes"}, "empty_cache_policy"),
    ],
)
def test_bad_settings_fail_in_the_config(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        training_args(tmp_path, **overrides)


def test_prompt_longer_than_context_fails_before_training(workload, tmp_path):
    cfg, path, dataset = workload
    long_prompt = dataset.select([0]).map(lambda row: {"prompt": row["prompt"] * 20})  # > 512 tokens
    with pytest.raises(ValueError, match="max_position_embeddings"):
        RLOOTrainer(model=path, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                    args=training_args(tmp_path), train_dataset=long_prompt)  # fmt: skip


def test_workload_rejects_a_prompt_that_cannot_fit_before_loading_anything():
    cfg = WorkloadConfig(prompt_length=600, max_position_embeddings=512)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        cfg.check_fits(max_completion_length=16)
    with pytest.raises(ValueError, match="arch"):
        WorkloadConfig(arch="gpt5")
