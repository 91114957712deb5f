"""GRPO: TRL's `GRPOTrainer` and ours run the same way, compared metric by metric, with our sharing engaged."""

import inspect
import warnings

import pytest
import torch
import trl

from rloo_efficient import GroupSharingMixin, GRPOConfig, GRPOTrainer
from rloo_efficient.demo.workload import (
    build_dataset,
    build_model_dir,
    build_processing_class,
    build_tokenizer,
    completion_text,
    vowel_reward,
)

from .conftest import per_micro_batch, run, tiny_workload, training_args
from .helpers import (
    ATOL,
    POLICY_LORA,
    RTOL,
    TransformersSampling,
    assert_same_run,
    build_reward_adapter,
    build_reward_model,
    count_vowels,
    grpo_args,
    scripted_tool_calls,
    tool_tokenizer,
)


def compare(path, dataset, tmp_path, reward=vowel_reward, run_kwargs=None, stock_class=trl.GRPOTrainer,
            ours_class=GRPOTrainer, rtol=RTOL, atol=ATOL, prefill=True, **overrides):  # fmt: skip
    run_kwargs = run_kwargs or {}
    copy = lambda: list(reward) if isinstance(reward, list) else reward  # noqa: E731 (TRL loads paths in place)
    stock = run(stock_class, path, grpo_args(tmp_path / "stock", config_class=trl.GRPOConfig, **overrides), dataset,
                reward=copy(), **run_kwargs)  # fmt: skip
    ours = run(ours_class, path, grpo_args(tmp_path / "ours", **overrides), dataset, reward=copy(), **run_kwargs)
    assert ours._switches.prefix and ours.packed_forward_tokens > 0  # the packed forwards ran
    assert (ours.shared_prefill_tokens > 0) == prefill  # and the shared generation prefill, where generation is ours
    assert_same_run(stock, ours, rtol, atol)
    return stock, ours


def length_reward(completions, **kwargs) -> list[float]:
    return [len(completion_text(completion)) / 20 for completion in completions]


def phases_run(trainer) -> set[str]:
    return {phase for step in trainer.memory_profiling.step_records() for phase in step["phases"]}


# Each GRPO feature on its own; beta 0 and aligned steps mean no scoring pass at all, only the training forward
FEATURES = {
    "defaults_no_scoring_pass": dict(gradient_accumulation_steps=2),  # dapo, beta 0, generation aligned with steps
    "reference_pass_only": dict(gradient_accumulation_steps=2, beta=0.1),
    "old_and_reference_passes": dict(beta=0.1),
    **{f"loss_{loss}": dict(loss_type=loss, beta=0.1) for loss in ("grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo",
                                                                    "vespo")},
    "num_iterations_2": dict(num_iterations=2, beta=0.1),
    "sequence_importance_delta_epsilon_high": dict(importance_sampling_level="sequence", delta=1.5,
                                                   epsilon_high=0.28, loss_type="grpo"),
    "top_entropy_quantile": dict(top_entropy_quantile=0.5),
    # 48-token completions: some stop at EOS, the truncated ones are masked to nothing
    "mask_truncated_completions": dict(mask_truncated_completions=True, max_completion_length=48, max_steps=2),
    "off_policy_mask": dict(off_policy_mask_threshold=0.01, num_iterations=2),
    "scale_rewards_batch": dict(scale_rewards="batch"),
    # generation reading every earlier token of a row (the prompt's kept once while decoding), the completions padded
    # to a multiple, another KL estimator, and an entropy bonus whose coefficient follows the entropy
    "repetition_penalty": dict(repetition_penalty=1.5),
    "pad_to_multiple_of": dict(pad_to_multiple_of=8),
    "bias_correction_kl": dict(use_bias_correction_kl=True, beta=0.1),
    "adaptive_entropy": dict(use_adaptive_entropy=True, entropy_coef=0.01),
    "scale_rewards_none_per_micro_batch_of_2": dict(scale_rewards="none", per_device_train_batch_size=2,
                                                    steps_per_generation=4),
    # sampling's filters, read by our decoding as by generate's; two reward functions weighted
    "sampling_filters": dict(temperature=0.7, top_k=12, top_p=0.9, min_p=0.05),
    "reward_weights": dict(reward=[vowel_reward, length_reward], reward_weights=[0.3, 1.0], beta=0.1),
    # a generation batch of 4 groups named by its size, the prompts in the dataset's order. SGD: AdamW divides each
    # gradient entry by its size plus 1e-8, which magnifies float64 rounding (the kl's gradient, 0 in stock's first
    # step, is ~1e-14 in ours', whose reference pass packs rows unlike its training pass) to 2e-9 in the next kl
    "generation_batch_size_unshuffled": dict(generation_batch_size=16, steps_per_generation=None,
                                             shuffle_dataset=False, beta=0.1, optim="sgd"),
    # micro-batches that are neither a group nor a divisor of one: 3 groups of 4 over micro-batches of 3 and of 6 rows,
    # every one of them holding part of a group whose other rows another micro-batch holds (SGD: as above)
    "three_rows_per_micro_batch": dict(per_device_train_batch_size=3, steps_per_generation=4,
                                       gradient_accumulation_steps=2, beta=0.1, optim="sgd"),
    "six_rows_per_micro_batch": dict(per_device_train_batch_size=6, steps_per_generation=2, optim="sgd"),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_grpo_matches_stock(workload, tmp_path, exact_head, feature):
    cfg, path, dataset = workload
    stock, ours = compare(path, dataset, tmp_path, **FEATURES[feature])
    if feature == "mask_truncated_completions":
        lengths = [e["completions/min_length"] for e in stock.state.log_history if "completions/min_length" in e]
        assert min(lengths) < 48, "no completion stopped at EOS: the case is not exercised"
    # The profiler names each scoring pass by the model it runs: GRPO runs the policy's only when generation and
    # optimizer steps are out of step, and the reference's only with beta > 0
    expected = {"defaults_no_scoring_pass": set(), "reference_pass_only": {"reference_logps"}}.get(
        feature, {"policy_logps", "reference_logps"} if FEATURES[feature].get("beta") else {"policy_logps"})
    assert phases_run(ours) & {"policy_logps", "reference_logps"} == expected


def test_evaluation_with_its_own_group_size_matches_stock(workload, tmp_path, exact_head):
    """`num_generations_eval` (2) other than training's (4): each evaluation's groups are its own, shared as such."""
    cfg, path, dataset = workload
    runs = {}
    for name, trainer_class, config_class in (("stock", trl.GRPOTrainer, trl.GRPOConfig),
                                              ("ours", GRPOTrainer, GRPOConfig)):  # fmt: skip
        args = grpo_args(tmp_path / name, config_class=config_class, num_generations_eval=2, eval_strategy="steps",
                         eval_steps=1, per_device_eval_batch_size=4, max_steps=2)  # fmt: skip
        runs[name] = trainer = trainer_class(model=path, reward_funcs=vowel_reward, args=args, train_dataset=dataset,
                                             eval_dataset=dataset.select(range(4)),
                                             processing_class=build_tokenizer())  # fmt: skip
        trainer.train()
        prefilled = getattr(trainer, "shared_prefill_tokens", 0)
        trainer.evaluate()  # (before the other run: both draw from the global generator)
        trainer.evaluation_prefilled = getattr(trainer, "shared_prefill_tokens", 0) - prefilled
    stock, ours = runs["stock"], runs["ours"]
    assert ours.evaluation_prefilled > 0  # the evaluation's generation shared its prompts
    assert_same_run(stock, ours)
    logged = [[{key: value for key, value in entry.items() if key.startswith("eval_") and "time" not in key
                and "runtime" not in key and "per_second" not in key and "memory" not in key}
               for entry in trainer.state.log_history if "eval_reward" in entry] for trainer in (stock, ours)]  # fmt: skip
    assert len(logged[0]) == 3 and logged[0][0]  # two evaluations during training, one after
    for a, b in zip(*logged, strict=True):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12)


def test_a_completion_cut_on_the_pad_token_is_scored_as_stocks(workload, tmp_path, exact_head, monkeypatch):
    """TRL's masked truncation keeps a completion whose last token is an end or the padding token: one cut at the
    length limit on the pad token (where pad is not EOS, as Qwen's) is scored, a truncated one is masked to nothing."""
    cfg, path, dataset = workload
    pad, cut = build_processing_class(cfg).pad_token_id, []
    generate = trl.GRPOTrainer._generate_single_turn

    def on_pad(self, *args, **kwargs):  # every other truncated completion ends on the pad token instead
        completion_ids, logprobs = generate(self, *args, **kwargs)
        assert pad not in self.eos_token_ids
        truncated = [ids for ids in completion_ids if ids[-1] not in self.eos_token_ids]
        for ids in truncated[::2]:
            ids[-1] = pad
        cut.append(len(truncated[::2]))
        return completion_ids, logprobs

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", on_pad)
    compare(path, dataset, tmp_path, mask_truncated_completions=True, max_completion_length=48, max_steps=2)
    assert len(cut) == 2 and min(cut) > 0  # (stock's generation and ours')


# -- one or two rows per micro-batch: each prompt held across micro-batches ([`core.tree.holds`]) -----------------------
# The generation batch (2 groups of 4) fills one optimizer step. GRPO's defaults (beta 0, dapo, gradient
# checkpointing); the scoring passes too; bnpo keeps TRL's row shuffle (a step's micro-batches hold rows of both
# groups, in stock's order); a hybrid (recurrent states held, float32) and a MoE model (the load-balancing loss over the
# held router logits, float32)
HELD = {
    "defaults_one_row": ("llama", dict(per_device_train_batch_size=1, gradient_accumulation_steps=8)),
    "scoring_passes_two_rows": ("llama", dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, beta=0.1,
                                              num_iterations=2)),
    "bnpo_row_shuffle_one_row": ("llama", dict(per_device_train_batch_size=1, gradient_accumulation_steps=8,
                                               loss_type="bnpo")),
    "hybrid_one_row": ("qwen3_next", dict(per_device_train_batch_size=1, gradient_accumulation_steps=8)),
    "moe_load_balancing_two_rows": ("qwen3_moe", dict(per_device_train_batch_size=2, gradient_accumulation_steps=4)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HELD))
def test_small_micro_batches_hold_prompts_and_match_stock(model_cache, tmp_path, exact_head, case):
    arch, overrides = HELD[case]
    float32 = arch in ("qwen3_next", "qwen3_moe")
    cfg = tiny_workload(model_cache, arch=arch, **(dict(model_dtype="float32") if float32 else {}))
    overrides = {"steps_per_generation": overrides["gradient_accumulation_steps"], "max_steps": 2, **overrides}
    tolerance = dict(rtol=1e-4, atol=1e-5) if float32 else {}
    stock, ours = compare(build_model_dir(cfg), build_dataset(cfg), tmp_path,
                          run_kwargs={"processing_class": build_processing_class(cfg)}, **tolerance, **overrides)  # fmt: skip
    assert ours.held_forward_tokens > 0
    if arch == "qwen3_moe":
        assert any("aux_loss" in entry for entry in stock.state.log_history)


# -- GRPO's own defaults: the first forward through our code is the checkpointed training forward ----------------------
# Every recurrent family (Gated DeltaNet, Mamba2, short convolutions), float32 as in the families test (their kernels
# compute in float32)
HYBRIDS = {"qwen3_5": {}, "qwen3_5_moe": {}, "qwen3_next": {}, "olmo_hybrid": {}, "nemotron_h": dict(num_hidden_layers=3),
           "granitemoehybrid": {}, "falcon_h1": {}, "lfm2": {}}  # fmt: skip


def first_use_again(monkeypatch):
    """Every kernel's first-use check runs again in this test (their verdicts are kept per process)."""
    from rloo_efficient.core.attention import checks as kernel_checks
    from rloo_efficient.core.layers import recurrent_checks

    monkeypatch.setattr(kernel_checks, "_status", {})
    monkeypatch.setattr(recurrent_checks, "_trusted", {})


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("arch", list(HYBRIDS))
def test_grpo_defaults_with_gradient_checkpointing(model_cache, tmp_path, monkeypatch, arch, reentrant):
    """
    GRPOConfig's defaults: beta 0 and generation in step with optimizer steps (no scoring pass), gradient checkpointing
    on. The first forward through the recurrent forks is the checkpointed training forward, where each kernel's
    first-use check runs: it must not change what the forward saves (the recomputation would save less and fail).
    """
    first_use_again(monkeypatch)
    cfg = tiny_workload(model_cache, arch=arch, model_dtype="float32", **HYBRIDS[arch])
    stock, ours = compare(build_model_dir(cfg), build_dataset(cfg), tmp_path, rtol=1e-4, atol=1e-5, max_steps=2,
                          gradient_accumulation_steps=2, gradient_checkpointing=True,
                          gradient_checkpointing_kwargs={"use_reentrant": reentrant},
                          run_kwargs={"processing_class": build_processing_class(cfg)})  # fmt: skip
    assert phases_run(ours) & {"policy_logps", "reference_logps"} == set()  # training came first


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
def test_grpo_defaults_under_bf16_autocast(model_cache, tmp_path, monkeypatch, arch):
    """TRL's default precision, bf16 autocast (here on the CPU), with GRPO's defaults: ours trains, shares, and gives
    stock's first step (the samples can part later: bf16 rounds the packed forward's sums differently)."""
    first_use_again(monkeypatch)
    cfg = tiny_workload(model_cache, arch=arch, model_dtype="float32", **HYBRIDS[arch])
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    settings = dict(max_steps=2, gradient_accumulation_steps=2, bf16=True, use_cpu=True)
    kwargs = {"processing_class": build_processing_class(cfg)}
    stock = run(trl.GRPOTrainer, path, grpo_args(tmp_path / "stock", config_class=trl.GRPOConfig, **settings), dataset,
                **kwargs)  # fmt: skip
    ours = run(GRPOTrainer, path, grpo_args(tmp_path / "ours", **settings), dataset, **kwargs)
    assert ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    first = [next(e for e in trainer.state.log_history if "loss" in e) for trainer in (stock, ours)]
    for key in ("reward", "entropy", "grad_norm"):
        assert first[1][key] == pytest.approx(first[0][key], rel=5e-2, abs=1e-2), key


def test_vllm_generation_under_grpo_defaults(workload, tmp_path, monkeypatch, exact_head):
    """An attention family with generation left to TRL (vLLM, stood in for) under GRPO's defaults and gradient
    checkpointing."""
    import trl.trainer.grpo_trainer

    first_use_again(monkeypatch)
    cfg, path, dataset = workload
    monkeypatch.setattr(trl.trainer.grpo_trainer, "VLLMGeneration", VLLMStandIn)
    compare(path, dataset, tmp_path, use_vllm=True, max_steps=2, gradient_accumulation_steps=2, prefill=False,
            gradient_checkpointing=True)  # fmt: skip


def test_rloo_with_beta_zero(model_cache, tmp_path, monkeypatch):
    """RLOO without its reference pass, gradient checkpointing on, a hybrid family."""
    from rloo_efficient import RLOOTrainer

    from .conftest import assert_metrics_close, step_metrics
    first_use_again(monkeypatch)
    cfg = tiny_workload(model_cache, arch="qwen3_5", model_dtype="float32")
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    settings = dict(beta=0.0, max_steps=2, gradient_accumulation_steps=2, gradient_checkpointing=True)
    kwargs = {"processing_class": build_processing_class(cfg)}
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "stock", config_class=trl.RLOOConfig, **settings),
                dataset, **kwargs)  # fmt: skip
    ours = run(RLOOTrainer, path, training_args(tmp_path / "ours", **settings), dataset, **kwargs)
    assert ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    assert_metrics_close(step_metrics(stock), step_metrics(ours), 1e-4, 1e-5, per_micro_batch(ours))


# -- micro-batches that keep groups together, where the math allows -----------------------------------------------------
# What keeps TRL's row shuffle under the default (`shuffle_groups=None`): a per-micro-batch term, or micro-batches of one
# generation feeding several optimizer steps
KEEPS_ROW_SHUFFLE = {
    "bnpo": (dict(loss_type="bnpo"), "bnpo loss is normalized by each micro-batch"),
    "top_entropy_quantile": (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
    "entropy_bonus": (dict(entropy_coef=0.01), "entropy bonus"),
    "several_optimizer_steps": (dict(steps_per_generation=4), "feed several optimizer steps"),
}


@pytest.mark.parametrize("case", list(KEEPS_ROW_SHUFFLE))
def test_where_keeping_groups_would_change_the_math_the_row_shuffle_stays(workload, tmp_path, case):
    cfg, path, dataset = workload
    overrides, reason = KEEPS_ROW_SHUFFLE[case]
    args = grpo_args(tmp_path, gradient_accumulation_steps=2, max_steps=1, **overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = GRPOTrainer(model=path, reward_funcs=vowel_reward, args=args, train_dataset=dataset,
                              processing_class=build_tokenizer())  # fmt: skip
    messages = [str(w.message) for w in caught if "row shuffle" in str(w.message)]
    assert not trainer._switches.keep_groups and len(messages) == 1 and reason in messages[0]
    args = grpo_args(tmp_path, gradient_accumulation_steps=2, max_steps=1, shuffle_groups=True, **overrides)
    assert GRPOTrainer(model=path, reward_funcs=vowel_reward, args=args, train_dataset=dataset,
                       processing_class=build_tokenizer())._switches.keep_groups  # asked for: kept anyway  # fmt: skip


@pytest.mark.parametrize("method", ["_compute_loss", "compute_loss"])
def test_a_subclass_with_its_own_loss_keeps_the_row_shuffle(workload, tmp_path, method):
    """TRL's GMPOTrainer replaces GRPO's loss (`_compute_loss`), a user's subclass may wrap `compute_loss` (a term per
    micro-batch): what either normalizes over is not known here, so stock's order stays."""
    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    class SharedGMPO(GroupSharingMixin, GMPOTrainer):
        pass

    class Mine(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    cfg, path, dataset = workload
    trainer_class, config_class, owner = {"_compute_loss": (SharedGMPO, GMPOConfig, "GMPOTrainer"),
                                          "compute_loss": (Mine, GRPOConfig, "Mine")}[method]  # fmt: skip
    args = grpo_args(tmp_path, config_class=config_class, gradient_accumulation_steps=2, max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = trainer_class(model=path, reward_funcs=vowel_reward, train_dataset=dataset, args=args,
                                processing_class=build_tokenizer())  # fmt: skip
    assert not trainer._switches.keep_groups
    message = f"{trainer_class.__name__} computes its own loss ({owner}.{method})"
    assert any(message in str(w.message) for w in caught)


# -- users' own ways into the trainer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("trainer_class", [trl.GRPOTrainer, GRPOTrainer], ids=["stock", "ours"])
def test_a_trainer_made_without_init_runs_trls_methods(trainer_class):
    """A unit test of a subclass may make the trainer with `object.__new__` and set only what TRL's method reads: each
    of our wrappers is then TRL's method (no state of ours is read), and the same set-up serves stock and ours."""
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    trainer = object.__new__(trainer_class)
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True, gather=lambda t: t)
    trainer.args = SimpleNamespace(report_to=[])
    trainer.model = SimpleNamespace(training=True)
    trainer.state = SimpleNamespace(global_step=2, num_input_tokens_seen=0)
    trainer._last_loaded_step, trainer.use_vllm, trainer.use_transformers_continuous_batching = 1, False, False
    trainer.processing_class = SimpleNamespace(batch_decode=MagicMock(return_value=["decoded"]))
    trainer._tokenizer, trainer.tools = SimpleNamespace(eos_token_id=2, pad_token_id=0), None
    trainer.eos_token_ids = [2]
    names = ("num_tokens", *(f"completions/{stat}" for stat in ("mean_length", "min_length", "max_length",
             "clipped_ratio", "mean_terminated_length", "min_terminated_length", "max_terminated_length")))  # fmt: skip
    trainer._metrics = {"train": {name: [] for name in names}}
    trainer.rollout_func = MagicMock(return_value={"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[0.0]]})
    result = trainer._generate(["prompt"])
    assert result[0] == [[1]] and result[1] == [[2]]
    trainer.rollout_func.assert_called_once_with(["prompt"], trainer)


@pytest.mark.parametrize("kind", ["patch", "wrapper"])
def test_a_generate_set_on_the_model_is_called_as_stock_calls_it_and_left_in_place(workload, tmp_path, kind):
    """A `generate` set on the model object (a test's `patch.object`, a tracing wrapper) is called with stock's
    arguments, and is what the model holds after training (ours was set and deleted around each call, and deleted a
    user's patch with it)."""
    from unittest.mock import patch

    cfg, path, dataset = workload
    trainer = GRPOTrainer(model=path, reward_funcs=vowel_reward, args=grpo_args(tmp_path, max_steps=1),
                          train_dataset=dataset, processing_class=build_tokenizer())  # fmt: skip
    model, calls = trainer.model, []
    stock_generate = model.generate

    def traced(*args, **kwargs):
        calls.append(sorted(kwargs))
        return stock_generate(*args, **kwargs)

    if kind == "patch":
        with patch.object(model, "generate", side_effect=traced):
            trainer.train()
        assert "generate" not in vars(model)  # the patch is undone, as it found the model
    else:
        model.generate = traced
        trainer.train()
        assert vars(model)["generate"] is traced
    assert calls and all("cache" not in call and "past_key_values" not in call for call in calls)
    assert trainer.packed_forward_tokens > 0


def test_normalize_then_sum_with_two_rewards_and_a_reward_model(workload, tmp_path, exact_head):
    """Several reward sources, normalized per function before the sum; one of them a reward model scored from packed
    rows."""
    cfg, path, dataset = workload
    reward = build_reward_model(tmp_path / "reward", cfg)
    stock, ours = compare(path, dataset, tmp_path, reward=[vowel_reward, reward],
                          multi_objective_aggregation="normalize_then_sum", beta=0.1, rtol=1e-6, atol=1e-7)  # fmt: skip
    assert ours.reward_forward_tokens > 0
    for a, b in zip(stock.state.log_history, ours.state.log_history, strict=True):
        for name in stock.reward_func_names:
            key = f"rewards/{name}/mean"
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7)


def test_hydra_reward_adapter(workload, tmp_path, exact_head):
    """A LoRA policy and a reward adapter on its base: stock loads the adapter as a second model, ours runs it on the
    policy's base, and the run is the same."""
    from peft import LoraConfig

    cfg, path, dataset = workload
    adapter = build_reward_adapter(tmp_path / "adapter", path)
    stock, ours = compare(path, dataset, tmp_path, reward=[adapter], beta=0.1, max_steps=2, rtol=1e-6, atol=1e-7,
                          run_kwargs={"peft_config": LoraConfig(**POLICY_LORA)})  # fmt: skip
    assert type(ours.reward_funcs[0]).__name__ == "HydraReward" and ours.reward_forward_tokens > 0
    # TRL computes the reference with the PEFT policy's adapter off: the profiler names that pass so
    assert {"policy_logps", "reference_logps"} <= phases_run(ours)


class VLLMStandIn(TransformersSampling):
    """The RLOO test's stand-in for TRL's vLLM generation object, returning what GRPO also reads: each sampled token's
    log-probability, for TRL's importance-sampling correction."""

    logprobs = True


def test_vllm_generation(workload, tmp_path, monkeypatch, exact_head):
    """With `use_vllm=True` (vLLM stood in for) generation is vLLM's, every other phase ours; TRL then always scores
    the old log-probs, for its importance-sampling correction."""
    import trl.trainer.grpo_trainer

    cfg, path, dataset = workload
    monkeypatch.setattr(trl.trainer.grpo_trainer, "VLLMGeneration", VLLMStandIn)
    stock, ours = compare(path, dataset, tmp_path, use_vllm=True, max_steps=2, beta=0.1, prefill=False)
    assert any("sampling/importance_sampling_ratio/mean" in entry for entry in ours.state.log_history)


# -- tools, rollout functions, environments ---------------------------------------------------------------------------


def recorded_continuations(monkeypatch) -> list:
    """Per call of ours that continued held caches (a tool loop's later turn): `(rows, rows reusing held tokens)`."""
    import rloo_efficient.core.generation.generate as shared_generation

    continued = []
    continue_prefill = shared_generation.continue_prefill

    def recording(model, held, plan, prompt_ids, width):
        continued.append((len(prompt_ids), int((plan.reused > 0).sum())))
        return continue_prefill(model, held, plan, prompt_ids, width)

    monkeypatch.setattr(shared_generation, "continue_prefill", recording)
    return continued


def recorded_turns(monkeypatch) -> dict:
    """Per run (ours: True), the rows of each `_generate_single_turn` call in order, a tool loop's later turn's (one
    generation per row, each its own history) as negative."""
    turns = {}
    single_turn = trl.GRPOTrainer._generate_single_turn

    def counting(self, *args, **kwargs):
        call = inspect.signature(single_turn).bind(self, *args, **kwargs).arguments
        rows = len(call["prompt_ids"]) * (-1 if call["num_generations"] == 1 else 1)
        turns.setdefault(isinstance(self, GroupSharingMixin), []).append(rows)
        return single_turn(self, *args, **kwargs)

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", counting)
    return turns


def run_with(trainer_class, path, args, dataset, tokenizer, **kwargs):
    trainer = trainer_class(model=path, args=args, train_dataset=dataset, processing_class=tokenizer, **kwargs)
    trainer.train()
    return trainer


# budget 1e-9 GiB: one byte, less than any turn's cache
@pytest.mark.parametrize("system, budget, arch", [(0, None, "llama"), (100, None, "llama"), (100, 0, "llama"),
                                                  (100, 1e-9, "llama"), (100, None, "mistral"),
                                                  (100, None, "deepseek_v3")])  # fmt: skip
def test_tools_share_the_first_turn(model_cache, tmp_path, monkeypatch, exact_head, system, budget, arch):
    """The first turn generates from the dataset's prompts (shared); a row that calls a tool continues from its own
    history (prompt, completion, the tool's answer). By default each such row continues its first turn's KV cache:
    only the tokens added since are prefilled (Mistral with a window of 16, shorter than the histories: its window
    layers keep their whole histories in the tool loop; DeepSeek-V3 continues its latents, float32 for its experts).
    With no budget for that (`tool_cache_budget_gib=0`, or a budget the caches exceed: one warning) and a system
    prompt before every task (100 tokens), the later turn's rows, no two alike, still share it: that turn is
    prefilled as its prefix tree. The training forward packs each prompt once, the tool's tokens part of its
    completion (masked out of the loss, as stock masks them)."""
    import rloo_efficient.trainers.generation as mixin  # the generation glue: its generate_with_shared_prefill

    scripted_tool_calls(monkeypatch)
    continued = recorded_continuations(monkeypatch)
    shared_calls = []  # per generate call of ours: (rows alike, rows, prompt tokens its shared prefill forwarded)
    shared = mixin.generate_with_shared_prefill

    def recorded(model, input_ids, attention_mask, prompt_ids=None, **kwargs):
        output, tokens = shared(model, input_ids, attention_mask, prompt_ids=prompt_ids, **kwargs)
        shared_calls.append((len({tuple(ids) for ids in prompt_ids}) < len(prompt_ids), len(prompt_ids), tokens))
        return output, tokens

    monkeypatch.setattr(mixin, "generate_with_shared_prefill", recorded)
    # TRL continues a row only where its completion and the tool's answer fit in max_completion_length: the row must
    # have ended early; the later turns' calls are counted
    turns = recorded_turns(monkeypatch)
    family = {"mistral": dict(arch="mistral", sliding_window=16),
              "deepseek_v3": dict(arch="deepseek_v3", model_dtype="float32")}.get(arch, {})  # (experts: float32)
    cfg = tiny_workload(model_cache, conversational=True, system_prompt_length=system, **family)
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    # Mistral's case under GRPO's own beta (0: the first forward through ours may be the checkpointed training one)
    settings = dict(max_steps=4, max_completion_length=96, beta=0.0 if arch == "mistral" else 0.1)
    runs = {}
    for name, trainer_class, config_class in (("stock", trl.GRPOTrainer, trl.GRPOConfig),
                                              ("ours", GRPOTrainer, GRPOConfig)):  # fmt: skip
        ours_only = dict(tool_cache_budget_gib=budget) if name == "ours" else {}
        args = grpo_args(tmp_path / name, config_class=config_class, **settings, **ours_only)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs[name] = run_with(trainer_class, path, args, dataset, tool_tokenizer(), reward_funcs=vowel_reward,
                                  tools=[count_vowels])  # fmt: skip
    stock, ours = runs["stock"], runs["ours"]
    later_turns = {run: [-rows for rows in calls if rows < 0] for run, calls in turns.items()}
    over_budget = [w for w in caught if "were not held across the tool call" in str(w.message)]
    assert len(over_budget) == (budget == 1e-9)  # ours' run: one warning, not one per call
    calls = [e["tools/call_frequency"] for e in stock.state.log_history if "tools/call_frequency" in e]
    assert calls and 0 < max(calls), "no tool was called: the case is not exercised"
    assert later_turns.get(False), "no row continued after its tool's answer: the later turns are not exercised"
    assert later_turns.get(True) == later_turns[False]  # ours continued the same rows, in the same calls
    assert ours.shared_prefill_tokens > 0 and ours.packed_forward_tokens > 0
    # The tool turns' calls of several rows, every row its own history: with the system prompt, each shares it
    later = [tokens for alike, rows, tokens in shared_calls if not alike and rows > 1]
    assert later and (not system or all(tokens > 0 for tokens in later))
    if budget in (0, 1e-9):
        assert not continued
    else:  # every later turn's row continued its own cache (each turn's rows extend the previous turn's)
        assert [rows for rows, _ in continued] == later_turns[True]
        assert all(reusing == rows for rows, reusing in continued)
    # A system prompt is a node shared by prompts of other lengths in the packed forwards: positions shift by a
    # constant, which float32 rotary tables round at ~1e-7 relative (README, Limits)
    assert_same_run(stock, ours, **(dict(rtol=1e-4, atol=1e-5) if arch == "deepseek_v3" else
                                    dict(rtol=3e-6, atol=1e-9) if system else {}))  # fmt: skip


def test_a_tool_loop_of_several_turns_continues_each_turns_cache(model_cache, tmp_path, monkeypatch, exact_head):
    """A row that keeps calling its tool: each later turn continues the cache the turn before it left (its own
    history's, not the first turn's), up to `max_tool_calling_iterations` (2, where the rows would call 3 times)."""
    scripted_tool_calls(monkeypatch, turns=3)
    continued = recorded_continuations(monkeypatch)
    calls = recorded_turns(monkeypatch)
    cfg = tiny_workload(model_cache, conversational=True, system_prompt_length=100)
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    eos = tool_tokenizer().eos_token_id
    # EOS made likelier (the same for both): TRL continues a row only where its turn ended before the length limit
    settings = dict(max_steps=4, max_completion_length=160, beta=0.1, max_tool_calling_iterations=2,
                    generation_kwargs={"sequence_bias": [[[eos], 4.0]]})  # fmt: skip
    runs = {}
    for name, trainer_class, config_class in (("stock", trl.GRPOTrainer, trl.GRPOConfig),
                                              ("ours", GRPOTrainer, GRPOConfig)):  # fmt: skip
        args = grpo_args(tmp_path / name, config_class=config_class, **settings)
        runs[name] = run_with(trainer_class, path, args, dataset, tool_tokenizer(), reward_funcs=vowel_reward,
                              tools=[count_vowels])  # fmt: skip
    stock, ours = runs["stock"], runs["ours"]
    assert calls[True] == calls[False]  # the same turns, of the same rows
    generations = []  # per generation: its later turns' rows
    for rows in calls[True]:
        if rows > 0:
            generations.append([])
        else:
            generations[-1].append(-rows)
    # Rows called twice (the second later turn is exercised), and never a third time (the limit holds)
    assert max(len(turns) for turns in generations) == 2
    later = [rows for turns in generations for rows in turns]
    # Every later turn's rows continued their caches, the second from the first later turn's
    assert [rows for rows, _ in continued] == later and all(reusing == rows for rows, reusing in continued)
    assert ours.shared_prefill_tokens > 0 and ours.packed_forward_tokens > 0
    assert_same_run(stock, ours, rtol=3e-6, atol=1e-9)  # the system prompt's shifted positions (above)


def test_rollout_func(workload, tmp_path, exact_head):
    """A user's rollout function generates; every other phase is ours, grouped by the token lists it returns."""
    cfg, path, dataset = workload

    def rollout(prompts, trainer):
        tokenizer = trainer.processing_class
        prompt_ids = tokenizer(text=prompts)["input_ids"]
        completion_ids, _ = trainer._generate_single_turn(prompt_ids, None, {}, trainer.num_generations)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None,
                "lengths": [len(ids) for ids in completion_ids]}  # fmt: skip

    def length_reward(completions, lengths, **kwargs):  # reads the rollout's extra field
        return [n / 10 for n in lengths]

    compare(path, dataset, tmp_path, reward=[vowel_reward, length_reward], run_kwargs={"rollout_func": rollout},
            beta=0.1, max_steps=2)  # fmt: skip


class Counter:
    """An environment whose observation names its instance: rows of one prompt see different prompts."""

    made = 0

    def __init__(self):
        type(self).made += 1
        self.name = f"instance {type(self).made}"

    def reset(self, **kwargs):
        return f" ({self.name})"

    def count(self, text: str) -> int:
        """
        Counts the characters of a text.

        Args:
            text: The text.

        Returns:
            Its length.
        """
        return len(text)


class Shouting:
    """An environment that adds nothing to the prompt, with a tool of its own."""

    def reset(self, **kwargs):
        return None

    def shout(self, text: str) -> str:
        """
        Repeats a text in capitals.

        Args:
            text: The text.

        Returns:
            The text.
        """
        return text.upper()


class Whispering(Shouting):
    """The same prompt as [`Shouting`]'s, another tool: rendered differently."""

    shout = None

    def whisper(self, text: str) -> str:
        """
        Repeats a text in small letters.

        Args:
            text: The text.

        Returns:
            The text.
        """
        return text.lower()


def test_environments_group_by_prompt_and_environment(model_cache, tmp_path, monkeypatch, exact_head):
    """
    One prompt under three environments, all in every generation batch. Each renders its own tools into the prompt, so
    prompts are tokenized per (prompt, environment): two environments add nothing to the prompt's text, and a key
    without the environment would give both the first one's tokens. The third's observation differs per rollout, so
    its group's prompts differ: each of its rows is a group of its own (exact, nothing shared there). A row that calls
    its environment's tool continues its KV cache into its next turn.
    """
    from datasets import Dataset

    scripted_tool_calls(monkeypatch)
    continued = recorded_continuations(monkeypatch)
    cfg = tiny_workload(model_cache, conversational=True, num_prompts=1)
    path = build_model_dir(cfg)
    prompt = build_dataset(cfg)["prompt"][0]
    dataset = Dataset.from_dict({"prompt": [prompt] * 3, "environment": ["counter", "shouting", "whispering"]})
    factories = {"counter": Counter, "shouting": Shouting, "whispering": Whispering}
    runs = {}
    for name, trainer_class, config_class in (("stock", trl.GRPOTrainer, trl.GRPOConfig),
                                              ("ours", GRPOTrainer, GRPOConfig)):  # fmt: skip
        Counter.made = 0  # instance names as stock saw them
        # 3 steps of 4 rows per generation: the 3 environments' groups in every generation batch; completions long
        # enough for a tool's answer to fit after a row's first turn (TRL continues a row only then)
        args = grpo_args(tmp_path / name, config_class=config_class, max_steps=6, steps_per_generation=3,
                         max_completion_length=96, beta=0.1)  # fmt: skip
        runs[name] = run_with(trainer_class, path, args, dataset, tool_tokenizer(), reward_funcs=vowel_reward,
                              environment_factory=factories)  # fmt: skip
    stock, ours = runs["stock"], runs["ours"]
    assert_same_run(stock, ours)
    assert ours.shared_prefill_tokens > 0 and ours.packed_forward_tokens > 0
    logged = [str(p) for p in stock._logs["prompt"]]
    assert sum("instance" in p for p in logged) == len(logged) // 3  # the counter's rows, each prompt its own
    # A row that called its environment's tool continued its cache into its next turn
    assert continued and all(reusing == rows for rows, reusing in continued)


def test_a_subclass_of_grpo_gets_the_mixin(workload, tmp_path, exact_head):
    """TRL's own GMPOTrainer subclasses GRPOTrainer and replaces `_compute_loss`: the mixin serves it unchanged."""
    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    class SharedGMPOTrainer(GroupSharingMixin, GMPOTrainer):
        pass

    cfg, path, dataset = workload
    settings = dict(beta=0.1)
    stock = run(GMPOTrainer, path, grpo_args(tmp_path / "s", config_class=GMPOConfig, **settings), dataset)
    ours = run(SharedGMPOTrainer, path, grpo_args(tmp_path / "o", config_class=GMPOConfig, **settings), dataset)
    assert ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    assert_same_run(stock, ours)


def test_a_forward_given_a_batch_its_group_structure_does_not_fit_runs_stocks(workload, tmp_path, exact_head):
    """
    A user's `_compute_loss` that trims the last completion column before TRL's: the group structure, carried with
    the batch, no longer fits the batch the training forward is given. That forward is stock's, with one warning for
    the whole run, whatever shapes the batches have; the scoring passes stay packed, and the run is stock's.
    """

    def trimming(base):
        class Trimming(base):
            def _compute_loss(self, model, inputs):
                width = inputs["completion_ids"].shape[1] - 1
                per_token = lambda key: key.startswith("completion_") or key.endswith("per_token_logps")  # noqa: E731
                return super()._compute_loss(model, {key: value[:, :width] if per_token(key) and value is not None
                                                     else value for key, value in inputs.items()})  # fmt: skip

        return Trimming

    cfg, path, dataset = workload
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compare(path, dataset, tmp_path, stock_class=trimming(trl.GRPOTrainer), ours_class=trimming(GRPOTrainer),
                beta=0.1, max_steps=4)  # fmt: skip
    mismatches = [w for w in caught if "group structure" in str(w.message)]
    assert len(mismatches) == 1, [str(w.message) for w in mismatches]
