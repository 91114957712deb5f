"""
The parts binding the core to TRL (`rloo_efficient/trainers/`), from the seventh hand mutation audit: each test
fails on one mutation that the rest of the suite let through: the training window's bookkeeping (a window not aligned
with the generations, `num_iterations`' repeated micro-batches, reentrant checkpointing's refusal), a tool loop's
caches released when generation ends, the counters (summed over calls, one reset leaving the others), and a switch
turned off saying nothing.
"""

import gc
import warnings

import pytest
import torch
import trl

from rloo_efficient import GRPOConfig, GRPOTrainer, RLOOTrainer
from rloo_efficient.core.generation.turn_cache import TurnCaches
from rloo_efficient.demo.workload import build_dataset, build_model_dir, vowel_reward

from .conftest import assert_metrics_close, per_micro_batch, run, step_metrics, tiny_workload, training_args
from .helpers import build_reward_model, count_vowels, grpo_args, scripted_tool_calls, tool_tokenizer


F64_RTOL, F64_ATOL = 1e-6, 1e-7  # as tests/test_prefix_sharing.py: TRL's float32 log-prob head on float64 models
NOT_HELD = "not held across micro-batches"


def _stock_and_ours(path, dataset, tmp_path, **overrides):
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "stock", config_class=trl.RLOOConfig, **overrides),
                dataset)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(RLOOTrainer, path, training_args(tmp_path / "ours", **overrides), dataset)
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    assert_metrics_close(step_metrics(stock), step_metrics(ours), F64_RTOL, F64_ATOL, per_micro_batch(ours))
    return stock, ours, [str(w.message) for w in caught]


# -- the training window (held_prefix.py, mixin.training_step / _prepare_inputs) -------------------------------------
def test_reentrant_checkpointing_trains_without_holding_and_matches_stock(workload, tmp_path):
    """Reentrant checkpointing turns training holds off (one warning): no training scope may be planned then, or a
    held prompt's gradient is lost (grad_norm 0.679 against stock's 0.707 where `prepare` ignored the refusal, and
    the next generation's completions differ)."""
    cfg, path, dataset = workload
    _, ours, messages = _stock_and_ours(path, dataset, tmp_path, per_device_train_batch_size=1,
                                        gradient_accumulation_steps=8, steps_per_generation=8, max_steps=2,
                                        gradient_checkpointing=True,
                                        gradient_checkpointing_kwargs={"use_reentrant": True})  # fmt: skip
    assert len([m for m in messages if NOT_HELD in m]) == 1
    assert not ours._held.training and ours.held_forward_tokens > 0  # the scoring passes still hold


def test_use_reentrant_without_gradient_checkpointing_still_holds(workload, tmp_path):
    """`use_reentrant` matters only where gradient checkpointing is on: kwargs left in a config with checkpointing off
    neither warn nor stop training from holding prompts."""
    cfg, path, dataset = workload
    _, ours, messages = _stock_and_ours(path, dataset, tmp_path, per_device_train_batch_size=1,
                                        gradient_accumulation_steps=8, steps_per_generation=8, max_steps=1,
                                        gradient_checkpointing=False,
                                        gradient_checkpointing_kwargs={"use_reentrant": True})  # fmt: skip
    assert not [m for m in messages if NOT_HELD in m]
    assert ours._held.training


def test_an_optimizer_window_not_aligned_with_generations_matches_stock(workload, tmp_path):
    """Three micro-batches per optimizer step, a generation every two: the second generation's first micro-batch ends
    an optimizer step, so that no prompt may be held from it into the next micro-batch (the next step's). Counted from
    each step's end (`sync_gradients`), the window stops there; a window always counted from 0 spans the optimizer
    step, and the held prompt's gradient lands in the next step (grad_norm 0.5358 against stock's 0.5380, and the
    next generation's completions differ)."""
    cfg, path, dataset = workload
    _, ours, _ = _stock_and_ours(path, dataset, tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3,
                                 steps_per_generation=2, max_steps=2)  # fmt: skip
    assert not ours._switches.keep_groups and ours.held_forward_tokens > 0


def test_num_iterations_hold_each_prompt_across_both_iterations_of_a_window(workload, tmp_path):
    """With `num_iterations=2` and four micro-batches per step, the step's window serves the generation's two
    micro-batches twice (each one whole group): each group's prompt is forwarded once in the window and read again by
    its second iteration. Planned only to the end of the buffered generation (ignoring its iterations), each prompt
    was forwarded twice and nothing held (744 packed tokens against 924)."""
    cfg, path, dataset = workload
    _, ours, _ = _stock_and_ours(path, dataset, tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=4,
                                 steps_per_generation=2, num_iterations=2, beta=0.0, max_steps=2)  # fmt: skip
    assert ours._switches.keep_groups  # one whole group per micro-batch: only the second iteration can read a hold
    assert ours.held_forward_tokens > 0


# -- generation (generation.py) --------------------------------------------------------------------------------------
def test_a_tool_loops_held_caches_are_released_when_generation_ends(model_cache, tmp_path, monkeypatch):
    """Each turn's KV caches are held for the rows' next turn only while TRL's `_generate` runs: the log-prob and
    training passes run with none alive (a loop's last turn kept its cache, a whole generation's keys and values,
    through the backward where the loop's end did not drop it)."""
    scripted_tool_calls(monkeypatch)
    kept = []
    keep = TurnCaches.keep
    monkeypatch.setattr(TurnCaches, "keep", lambda self, held: kept.append(held is not None) or keep(self, held))
    alive = []

    class Checking(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            alive.append(sum(1 for o in gc.get_objects() if isinstance(o, TurnCaches) and o.held is not None))
            return super()._compute_loss(model, inputs)

    cfg = tiny_workload(model_cache, conversational=True)
    tokenizer = tool_tokenizer()
    args = grpo_args(tmp_path, config_class=GRPOConfig, max_steps=2, max_completion_length=96)
    trainer = Checking(model=build_model_dir(cfg), args=args, train_dataset=build_dataset(cfg),
                       processing_class=tokenizer, reward_funcs=vowel_reward, tools=[count_vowels])  # fmt: skip
    trainer.train()
    assert trainer._switches.turn_budget and any(kept)  # caches were held between turns: the case is exercised
    assert alive and not any(alive)


def test_the_shared_prefill_counter_sums_every_generate_call(workload, tmp_path, monkeypatch):
    """`shared_prefill_tokens` (memory_report.json's `sharing_tokens`) counts the prompt tokens of every call's shared
    prefill over the run, not the last call's."""
    import rloo_efficient.trainers.generation as generation

    calls = []
    shared = generation.generate_with_shared_prefill

    def recorded(*args, **kwargs):
        output, tokens = shared(*args, **kwargs)
        calls.append(tokens)
        return output, tokens

    monkeypatch.setattr(generation, "generate_with_shared_prefill", recorded)
    cfg, path, dataset = workload
    trainer = run(RLOOTrainer, path, training_args(tmp_path, max_steps=4), dataset)
    assert len(calls) == 2 and all(calls)
    assert trainer.shared_prefill_tokens == sum(calls)


# -- counters (counters.py) ------------------------------------------------------------------------------------------
def test_resetting_one_counter_leaves_the_others_and_keeps_counting(workload, tmp_path):
    """A user may reset a counter (`trainer.packed_forward_tokens = 0`): the others keep their values, and the parts
    go on counting into the same counts the trainer reads."""
    cfg, path, dataset = workload
    trainer = run(RLOOTrainer, path, training_args(tmp_path, max_steps=1), dataset)
    prefilled = trainer.shared_prefill_tokens
    assert prefilled > 0 and trainer.packed_forward_tokens > 0
    trainer.packed_forward_tokens = 0
    assert trainer.packed_forward_tokens == 0 and trainer.shared_prefill_tokens == prefilled
    trainer.train()  # (TRL serves the buffered generation's second micro-batch: no generation, a training forward)
    assert trainer.packed_forward_tokens > 0 and trainer.shared_prefill_tokens == prefilled


# -- rewards (rewards.py) --------------------------------------------------------------------------------------------
def test_share_reward_prefix_off_calls_the_reward_model_as_stock_without_a_warning(workload, tmp_path):
    """`share_reward_prefix=False` is the user's choice, not a fallback: the reward model is TRL's own call, with no
    warning that it scores each row on its own."""
    cfg, path, dataset = workload
    reward_model = build_reward_model(tmp_path / "reward", cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = run(RLOOTrainer, path, training_args(tmp_path / "o", max_steps=1, share_reward_prefix=False), dataset,
                      reward=[reward_model])  # fmt: skip
    assert not [w for w in caught if "scores each row on its own" in str(w.message)]
    assert trainer.reward_forward_tokens == 0


# -- the group shuffle (group_shuffle.py), on an accelerator ---------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="TRL's row shuffle draws on CUDA's generator there")
def test_the_group_order_draws_on_the_default_devices_generator():
    """With `torch.set_default_device("cuda")`, TRL's `torch.randperm` draws on CUDA's generator: the group order must
    predict that draw (a CPU draw predicts another permutation, and the groups are split)."""
    from trl.trainer.utils import shuffle_sequence_dict

    from rloo_efficient.trainers.group_shuffle import ordered_for_group_shuffle

    previous = torch.get_default_device()
    torch.set_default_device("cuda")
    try:
        group_ids = torch.arange(4).repeat_interleave(3)
        torch.manual_seed(0)
        shuffled = shuffle_sequence_dict(ordered_for_group_shuffle({"group_ids": group_ids}, group_ids.cpu()))
        runs = shuffled["group_ids"].view(4, 3)
        assert (runs == runs[:, :1]).all()
    finally:
        torch.set_default_device(previous)
