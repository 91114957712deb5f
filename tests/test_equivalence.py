"""
Stock TRL vs ours at float64's resolution. Both get the same exact-precision LM head ([`conftest.exact_head`]: TRL's
own computes in float32 even for float64 models), so a single step's per-token log-probs and entropies (every forward:
policy, reference, training), metrics and gradients agree to 1e-9 relative, over the layouts where an off-by-one
would hide: completions that end at their first token, completions all truncated and masked, one group per
micro-batch and several, groups split across micro-batches, micro-batches whose prompts all differ, and generations
reused across steps and iterations. Multi-step runs use SGD, whose update is linear in the gradient, so rounding
differences stay at rounding size instead of being amplified as AdamW's first sign-like steps amplify them.
"""

import random

import pytest
import torch
import trl

import rloo_efficient
from rloo_efficient import RLOOTrainer
from rloo_efficient.core.tree.rows import table_of
from rloo_efficient.demo.workload import build_dataset, build_model_dir, build_tokenizer, vowel_reward
from rloo_efficient.trainers.config import ROWS_KEY

from .conftest import METRICS, step_metrics, tiny_workload, training_args


# Measured: 3e-13 (tensors, relative to their scale) and 2e-16 (metrics) at most, over the layouts below
EXACT_RTOL = 1e-9
EOS = build_tokenizer().eos_token_id
LAYOUTS = {
    # A micro-batch of k = 4 rows: one whole group
    "one_group_per_micro_batch": dict(per_device_train_batch_size=4, steps_per_generation=1),
    # Two whole groups per micro-batch
    "two_groups_per_micro_batch": dict(per_device_train_batch_size=8, steps_per_generation=1),
    # Stock's row shuffle spreads 2 groups over 2 micro-batches of 4: groups split and mixed
    "groups_split_and_mixed": dict(per_device_train_batch_size=4, steps_per_generation=2),
    # Micro-batches of 2 rows from 4 groups of 2: some micro-batches hold two different prompts (asserted below)
    "every_prompt_different": dict(per_device_train_batch_size=2, num_generations=2, steps_per_generation=4),
    # EOS made likely in sampling (the same for both): most completions are the EOS token alone
    "completions_end_at_first_token": dict(per_device_train_batch_size=8, steps_per_generation=1,
                                           generation_kwargs={"sequence_bias": [[[EOS], 9.0]]}),
    # RLOO's own reward and advantage options: rewards clipped (the vowel rewards run 0 to ~0.3), advantages
    # normalized (over a batch with little spread: any difference between the runs is magnified)
    "rewards_clipped_and_advantages_normalized": dict(per_device_train_batch_size=4, steps_per_generation=2,
                                                     reward_clip_range=(0.02, 0.2), normalize_advantages=True),
    # EOS made impossible and truncated completions masked: nothing is scored at all
    "all_truncated_and_masked": dict(per_device_train_batch_size=8, steps_per_generation=1,
                                     mask_truncated_completions=True,
                                     generation_kwargs={"sequence_bias": [[[EOS], -1e9]]}),
}  # fmt: skip


def record_forwards(trainer) -> list:
    """Every (log-probs, entropies) the trainer's forward returns, in order."""
    calls = []
    forward = trainer._get_per_token_logps_and_entropies
    trainer.stock_scoring_chunks = 0  # the chunks stock's no-grad passes forward (TRL's, by its batch size)

    def recorded(*args, **kwargs):
        if not torch.is_grad_enabled():
            rows = args[1].size(0)
            batch_size = (args[4] if len(args) > 4 else kwargs.get("batch_size")) or rows
            trainer.stock_scoring_chunks += -(-rows // batch_size)
        logps, entropies, aux = forward(*args, **kwargs)
        calls.append((logps.detach().clone(), None if entropies is None else entropies.detach().clone()))
        return logps, entropies, aux

    trainer._get_per_token_logps_and_entropies = recorded
    return calls


def train(trainer_class, path, args, dataset):
    trainer = trainer_class(model=path, reward_funcs=vowel_reward, args=args, train_dataset=dataset,
                            processing_class=build_tokenizer())  # fmt: skip
    before = [p.detach().clone() for p in trainer.model.parameters()]
    calls = record_forwards(trainer)
    trainer.train()
    deltas = [p.detach() - b for p, b in zip(trainer.model.parameters(), before, strict=True)]
    return trainer, calls, deltas


def assert_close(a, b, rtol):
    """`a` and `b` equal to `rtol` relative to the tensor's scale (entries near zero are compared at that scale)."""
    scale = a.abs().max().item() if a.numel() else 0.0
    torch.testing.assert_close(b, a, rtol=rtol, atol=rtol * scale + 1e-300)


def compare(path, dataset, tmp_path, rtol=EXACT_RTOL, ours_only=None, **overrides):
    settings = {"max_steps": 1, "optim": "sgd", "learning_rate": 1e-1, **overrides}
    stock, stock_calls, stock_deltas = train(
        trl.RLOOTrainer, path, training_args(tmp_path / "stock", config_class=trl.RLOOConfig, **settings), dataset
    )
    ours, our_calls, our_deltas = train(RLOOTrainer, path, training_args(tmp_path / "ours", **settings,
                                                                          **(ours_only or {})), dataset)  # fmt: skip
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    # Ours' own paths ran: the packed forwards and the shared prefill (a comparison of stock with itself proves nothing)
    assert ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    assert len(our_calls) == len(stock_calls) > 0
    for (a_logps, a_entropy), (b_logps, b_entropy) in zip(stock_calls, our_calls, strict=True):
        assert_close(a_logps, b_logps, rtol)
        if a_entropy is not None:
            assert_close(a_entropy, b_entropy, rtol)
    for a, b in zip(stock_deltas, our_deltas, strict=True):  # SGD: each update is -lr times the gradient
        assert_close(a, b, rtol)
    assert_same_metrics(stock, ours, rtol)
    return stock, ours


def assert_same_metrics(stock, ours, rtol, atol=1e-12):
    """Every logged step's metrics of `ours` those of `stock`."""
    for step, (a, b) in enumerate(zip(step_metrics(stock), step_metrics(ours), strict=True)):
        for key in METRICS:
            if a[key] is not None:
                assert b[key] == pytest.approx(a[key], rel=rtol, abs=atol), f"step {step} {key}: {a[key]} {b[key]}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_step_matches_stock_at_float64_resolution(workload, tmp_path, exact_head, layout):
    cfg, path, dataset = workload
    stock, ours = compare(path, dataset, tmp_path, **LAYOUTS[layout])
    masks = torch.cat([batch["completion_mask"] for batch in ours._buffered_inputs])
    if layout == "completions_end_at_first_token":
        assert (masks.sum(1) == 1).float().mean() > 0.5  # most completions are the EOS token alone
    if layout == "all_truncated_and_masked":
        # Nothing scored: the micro-batch still packs (each prompt once), no stock forward with k copies of them
        prompt_tokens = sum(int(batch["prompt_mask"].sum()) for batch in ours._buffered_inputs)
        # Each pass holds each prompt once (stock's batch: k = 4 times), and at most three passes run
        assert masks.sum() == 0 and 0 < ours.packed_forward_tokens < prompt_tokens
    assert ours.packed_forward_tokens > 0
    if layout == "every_prompt_different":
        groups = [table_of(batch[ROWS_KEY])[:, 0].tolist() for batch in ours._buffered_inputs]
        assert any(len(set(g)) == len(g) for g in groups), groups


# Three SGD steps, reusing generations across steps and iterations. The largest differences measured over these runs
# are 1.2e-13 (tensors, relative to their scale) and 2e-16 (metrics); 1e-9 leaves a margin of 10^4 and is still
# 10^6 below what a wrong position or mask gives (1e-3 and more)
MULTI_STEP_RTOL = 1e-9


@pytest.mark.parametrize(
    "overrides",
    [
        dict(steps_per_generation=2, num_iterations=2),
        dict(per_device_train_batch_size=8, steps_per_generation=1, generation_kwargs={"sequence_bias": [[[EOS], 9.0]]}),
    ],
    ids=["generations_reused_across_steps_and_iterations", "completions_end_at_first_token"],
)
def test_several_sgd_steps_match_stock(workload, tmp_path, exact_head, overrides):
    cfg, path, dataset = workload
    compare(path, dataset, tmp_path, rtol=MULTI_STEP_RTOL, **{"max_steps": 3, **overrides})


# One or two rows per micro-batch, the generation batch (2 groups of 4) filling one optimizer step: each prompt is
# forwarded once per pass and once per step ([`core.tree.holds`]), in TRL's row order (`shuffle_groups=False`: each
# call's rows are stock's) and group-major (the default: each call compared where its rows are stock's, the update
# and metrics always); `num_iterations` and `steps_per_generation` apart from the accumulation: scopes end with each
# optimizer step. Where a step's micro-batches hold rows of both groups, the prompts' shared opening is held once for
# both: its positions are one group's columns, a constant shift for the other's rows (prompts of other lengths),
# which the rotary tables (float32) round apart: 1.3e-7 of the update's scale (as the per-micro-batch tree's node
# shared across groups: tests/test_prefix_sharing.py)
HELD_LAYOUTS = {
    "one_row_stock_order": (dict(per_device_train_batch_size=1, gradient_accumulation_steps=8), dict(shuffle_groups=False),
                            EXACT_RTOL),
    "two_rows_stock_order": (dict(per_device_train_batch_size=2, gradient_accumulation_steps=4), dict(shuffle_groups=False),
                             EXACT_RTOL),
    "two_rows_two_iterations": (dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, num_iterations=2,
                                     max_steps=2), dict(shuffle_groups=False), EXACT_RTOL),
    "one_row_two_steps_per_generation": (dict(per_device_train_batch_size=1, gradient_accumulation_steps=4,
                                              steps_per_generation=8, max_steps=2), dict(shuffle_groups=False), 1e-6),
    # A budget of 0: nothing held, each micro-batch packs its own rows' tokens
    "one_row_nothing_held": (dict(per_device_train_batch_size=1, gradient_accumulation_steps=8),
                             dict(shuffle_groups=False, held_prefix_budget_gib=0), EXACT_RTOL),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(HELD_LAYOUTS))
def test_small_micro_batches_hold_each_prompt_once_and_match_stock(workload, tmp_path, exact_head, layout):
    cfg, path, dataset = workload
    overrides, ours_only, rtol = HELD_LAYOUTS[layout]
    overrides = {"steps_per_generation": overrides["gradient_accumulation_steps"], **overrides}
    stock, ours = compare(path, dataset, tmp_path, rtol=rtol, ours_only=ours_only, **overrides)
    if ours_only.get("held_prefix_budget_gib") == 0:
        assert ours._held is None and ours.held_forward_tokens == 0 and ours.packed_forward_tokens > 0
        return
    assert ours.held_forward_tokens > 0  # prompts were held, not forwarded by each micro-batch
    # The no-grad passes' chunks merged within stock's forward size: per pass each group's prompt forwarded alone
    # (held) and its rows in about one forward beside the other group's (k = 4 here: 5 forwards for stock's 8 at one
    # row per chunk, held forwards counted)
    assert 0 < ours.scoring_forward_calls * (8 if "one_row" in layout else 1) <= stock.stock_scoring_chunks * (
        5 if "one_row" in layout else 1)  # fmt: skip
    scope = ours._held.planner.train_scope
    assert not scope or not scope.held or not scope.held.sources  # all released


@pytest.mark.parametrize("layout", ["whole_batch", "one_row_stock_order"])
def test_one_prompt_drawn_for_both_groups_of_a_batch_is_shared_by_all_their_rows(workload, tmp_path, exact_head,
                                                                               layout):  # fmt: skip
    """A dataset that repeats its prompt (as a small one does, drawn into several groups of a generation batch): the
    batch's 2 groups of 4 are 8 rows of one prompt, prefilled once and forwarded once per pass, as stock's numbers."""
    from datasets import Dataset

    cfg, path, dataset = workload
    repeated = Dataset.from_dict({"prompt": dataset["prompt"][:1] * 16})
    overrides, ours_only, rtol = HELD_LAYOUTS.get(layout, (dict(per_device_train_batch_size=8), {}, EXACT_RTOL))
    overrides = {"steps_per_generation": overrides.get("gradient_accumulation_steps", 1), **overrides}
    stock, ours = compare(path, repeated, tmp_path, rtol=rtol, ours_only=ours_only, **overrides)
    prompt = len(build_tokenizer()(repeated["prompt"][0])["input_ids"])
    assert ours.shared_prefill_tokens == prompt - 1  # one prefill for both groups (it stops one token short)
    assert (ours.held_forward_tokens > 0) == (layout != "whole_batch")


class Interrupted(Exception):
    """What a user's ^C (or an error in their code) raises inside a step."""


@pytest.mark.parametrize("where", ["training_micro_batch", "generation"])
def test_a_run_interrupted_mid_window_then_trained_again_is_stocks(workload, tmp_path, exact_head, where):
    """A notebook's run stopped inside a step, then `train()` again on the same trainer: in the third micro-batch of a
    window whose prompts are held (one row per micro-batch), or in the second generation. Nothing of the stopped
    window (its held prompts, their pending backward, the model's generate) reaches the next run: stock's numbers."""
    cfg, path, dataset = workload
    settings = dict(per_device_train_batch_size=1, gradient_accumulation_steps=8, steps_per_generation=8, max_steps=2)
    runs = {}
    for name, trainer_class, config_class in (("stock", trl.RLOOTrainer, trl.RLOOConfig),
                                              ("ours", RLOOTrainer, rloo_efficient.RLOOConfig)):  # fmt: skip
        trainer = trainer_class(model=path, reward_funcs=vowel_reward, args=training_args(
            tmp_path / name, config_class=config_class, **settings), train_dataset=dataset,
            processing_class=build_tokenizer())  # fmt: skip
        method = "_compute_loss" if where == "training_micro_batch" else "_generate_single_turn"
        stop_at, calls, original = 3 if where == "training_micro_batch" else 2, [], getattr(trainer, method)

        def stopping(*args, original=original, calls=calls, stop_at=stop_at, **kwargs):
            calls.append(1)
            if len(calls) == stop_at:
                raise Interrupted
            return original(*args, **kwargs)

        setattr(trainer, method, stopping)
        with pytest.raises(Interrupted):
            trainer.train()
        assert "generate" not in vars(trainer.model)  # the class's generate again
        trainer.train()
        runs[name] = trainer
    stock, ours = runs["stock"], runs["ours"]
    assert ours.held_forward_tokens > 0
    assert_same_metrics(stock, ours, rtol=1e-6, atol=1e-9)


@pytest.fixture(scope="module")
def tied_workload(model_cache):
    """The workload's model with its LM head tied to its input embedding, as Qwen3 up to 4B, Llama 3.2 and Gemma."""
    cfg = tiny_workload(model_cache, tie_word_embeddings=True)
    return cfg, build_model_dir(cfg), build_dataset(cfg)


@pytest.mark.parametrize("layout", ["one_row_stock_order", "two_rows_two_iterations"])
def test_a_tied_embedding_matches_stock(tied_workload, tmp_path, exact_head, layout):
    """One weight read by the input embedding and the LM head, with prompts held across micro-batches (their forward
    reads the weight through one alias for both, [`param_alias`]): the same log-probs, update and metrics as stock's."""
    cfg, path, dataset = tied_workload
    overrides, ours_only, rtol = HELD_LAYOUTS[layout]
    overrides = {"steps_per_generation": overrides["gradient_accumulation_steps"], **overrides}
    stock, ours = compare(path, dataset, tmp_path, rtol=rtol, ours_only=ours_only, **overrides)
    for trainer in (stock, ours):
        assert trainer.model.get_output_embeddings().weight is trainer.model.get_input_embeddings().weight
    assert ours.held_forward_tokens > 0


def test_a_system_prompt_read_only_through_a_later_prompts_source_matches_stock(workload, tmp_path, exact_head,
                                                                                 monkeypatch):
    """Three prompts sharing a system prompt (250 tokens, then 150 of their own) and one without it (150), two rows
    each, one row per micro-batch in TRL's shuffled order (seed 12): the system prompt is held apart, each task under
    it, and a task's source also forwards the plain prompt (hoisted: within one of stock's forwards), read after every
    row of the system prompt. The system prompt's source is then backpropagated in a micro-batch none of whose rows
    reads it, through the later source, which must bring in every gradient the system prompt's readers banked.
    Failed so (until 2026-12-07: the banks of its last layer's keys and values, which no gradient reaches through that
    source's forward, were dropped): parameter updates up to 1e3 relative off stock's."""
    from datasets import Dataset

    from rloo_efficient.core.forward import scope as scopes

    _, path, _ = workload
    rng = random.Random(3)
    text = lambda n: "".join(rng.choice("abcdefghijklmnop ") for _ in range(n))  # noqa: E731 (a token a character)
    system = text(250)
    dataset = Dataset.from_dict({"prompt": [system + text(150) for _ in range(3)] + [text(150)]})
    plans = []  # the training scopes' plans
    init = scopes.HeldScope.__init__

    def recorded(self, plan, training, *args, **kwargs):
        if training:
            plans.append(plan)
        init(self, plan, training, *args, **kwargs)

    monkeypatch.setattr(scopes.HeldScope, "__init__", recorded)
    _, ours = compare(path, dataset, tmp_path, ours_only=dict(shuffle_groups=False), per_device_train_batch_size=1,
                      num_generations=2, gradient_accumulation_steps=8, steps_per_generation=8, seed=12)
    assert ours.held_forward_tokens > 0
    # A source backpropagated after its own prompts' last reader (through a later source reading their descendant)
    assert any(plan.backprop_chunk[source] > plan.nodes.last[plan.nodes.source == source].max()
               for plan in plans for source in range(len(plan.source_chunk)))  # fmt: skip
