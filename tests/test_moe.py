"""The MoE load-balancing loss of a packed batch: stock TRL's, its value and its gradient, with TRL's defaults."""

import numpy as np
import pytest
import torch
import trl
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from trl.trainer.utils import add_fused_lm_head

from rloo_efficient import GRPOConfig, GRPOTrainer
from rloo_efficient.core.forward.packing import pack_rows
from rloo_efficient.core.layers.families import forward_unsupported_reason
from rloo_efficient.core.layers.install import install
from rloo_efficient.core.layers.moe import aux_loss_reason, recording_router_logits, weighted_aux_loss
from rloo_efficient.demo.workload import build_dataset, build_model_dir

from .conftest import METRICS, run, step_metrics, tiny_workload, training_args
from .trees import random_rows, split_rows, stock_batch


# float32: the experts' grouped GEMM has no float64; the packed and padded forwards sum in other orders
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def moe_model(model_cache):
    cfg = tiny_workload(model_cache, arch="qwen3_moe", model_dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(build_model_dir(cfg), dtype=torch.float32)
    add_fused_lm_head(model, outputs=("log_probs",))
    install(model)
    return model


def stock_and_packed_loss(model, seed: int, min_saved: int = 0):
    """The load-balancing loss and its router gradients on stock's padded rows of a random tree (a third of its rows
    unscored: their completions out of stock's mask, their prompts in it), and over the packed tree, each token
    weighted by the rows holding it. Returns `(stock's, ours, the packed batch, stock's attention mask)`."""
    config = model.config
    rows = random_rows(seed, vocab=200)
    prompts, completions = split_rows(rows, seed)
    scored = [0 if i % 3 == 1 else len(c) for i, c in enumerate(completions)]
    input_ids, attention_mask, width_c, structure = stock_batch(prompts, completions, scored)
    results = []
    model.zero_grad()
    stock = model.model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
    expected = load_balancing_loss_func(stock.router_logits, config.num_experts, config.num_experts_per_tok,
                                        attention_mask)  # fmt: skip
    expected.backward()
    results.append((expected.detach(), [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]))
    model.zero_grad()
    packed = pack_rows(input_ids, width_c, structure, token_weights=True, min_saved=min_saved)
    with recording_router_logits(model) as logits:
        model(**packed.model_inputs(), fused_lm_head=True, output_router_logits=False)
    assert len(logits) == config.num_hidden_layers
    ours = weighted_aux_loss(logits, packed.token_weights, config)
    ours.backward()
    results.append((ours.detach(), [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]))
    return results[0], results[1], packed, attention_mask


@pytest.mark.parametrize("seed", [0, 5, 16])  # trees of 8 to 11 rows, 3 or 4 deep
def test_the_packed_loss_is_stocks_over_a_tree_with_unscored_rows(moe_model, seed):
    """Random trees (shared openings, completions that open alike, rows ending inside another's tokens), a third of
    the rows unscored (their prompts still count in stock's mask): the weighted loss over the packed tokens and its
    gradient equal stock's on the padded rows."""
    (expected, expected_grads), (ours, grads), packed, attention_mask = stock_and_packed_loss(moe_model, seed)
    torch.testing.assert_close(ours, expected, rtol=RTOL, atol=ATOL)
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-7)
    # Every token stock's mask holds, each counted once per row holding it; shared ones packed once
    assert int(packed.token_weights.sum()) == int(attention_mask.sum())
    assert packed.num_tokens < int(attention_mask.sum())


def test_a_token_weighted_once_instead_of_once_per_row_fails(moe_model, monkeypatch):
    from rloo_efficient.core.tree.radix import Tree

    monkeypatch.setattr(Tree, "token_weight", property(lambda self: np.ones(self.num_tokens, dtype=np.int64)))
    (expected, _), (ours, _), _, _ = stock_and_packed_loss(moe_model, 0)
    assert not torch.allclose(ours, expected, rtol=RTOL, atol=ATOL)


def test_router_jitter_refuses_the_packed_forward(moe_model):
    """Jitter draws noise per token in training: a shared token would draw once where stock's rows draw k times, with
    the load-balancing loss on or off (a trainer's run: test_prefix_sharing's test of what packing cannot reproduce)."""
    assert aux_loss_reason(moe_model) is None and forward_unsupported_reason(moe_model) is None
    moe_model.config.router_jitter_noise = 0.1
    try:
        assert "jitter" in forward_unsupported_reason(moe_model)
    finally:
        moe_model.config.router_jitter_noise = 0.0


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_grpo_with_the_load_balancing_loss(model_cache, tmp_path, mask_truncated):
    """GRPO under TRL's defaults for a MoE model (the loss on, scaled by gradient accumulation): the packed training
    forward, each micro-batch's `aux_loss` as stock's; with masked truncation, groups whose rows are all unscored."""
    cfg = tiny_workload(model_cache, arch="qwen3_moe", model_dtype="float32")
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    settings = dict(beta=0.0, gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=2)
    if mask_truncated:
        settings.update(mask_truncated_completions=True, max_completion_length=48)
    stock = run(trl.GRPOTrainer, path, training_args(tmp_path / "s", config_class=trl.GRPOConfig, **settings), dataset)
    ours = run(GRPOTrainer, path, training_args(tmp_path / "o", config_class=GRPOConfig, **settings), dataset)
    assert ours.packed_forward_tokens > 0
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    assert any("aux_loss" in entry for entry in stock.state.log_history)
    for a, b in zip(step_metrics(stock), step_metrics(ours), strict=True):
        for key in METRICS:
            if a[key] is not None:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
