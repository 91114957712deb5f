"""The MoE load-balancing loss of a packed batch: stock TRL's, its value and its gradient, with TRL's defaults."""

import pytest
import torch
import trl
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from trl.trainer.utils import add_fused_lm_head

from rloo_efficient import GRPOConfig, GRPOTrainer
from rloo_efficient.core import prefix_attention
from rloo_efficient.core.families import forward_unsupported_reason
from rloo_efficient.core.moe import aux_loss_reason, recording_router_logits, weighted_aux_loss
from rloo_efficient.core.packing import pack_groups, row_groups
from rloo_efficient.workload import build_dataset, build_model_dir

from .conftest import METRICS, run, step_metrics, tiny_workload, training_args

# float32: the experts' grouped GEMM has no float64; the packed and padded forwards sum in other orders
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def moe_model(model_cache):
    cfg = tiny_workload(model_cache, arch="qwen3_moe", model_dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(build_model_dir(cfg), dtype=torch.float32)
    add_fused_lm_head(model, outputs=("log_probs",))
    prefix_attention.install(model)
    return model


def test_the_packed_loss_is_stocks_with_unscored_rows_and_groups(moe_model):
    """Three groups: one fully scored, one with a masked (unscored) row, one with every row unscored (its prompt still
    counts in stock's mask). The weighted loss over the packed tokens and its gradient equal stock's on the padded
    rows, whose attention mask drops the unscored rows' completions."""
    model, config = moe_model, moe_model.config
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in (6, 4, 5)]
    completions = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in (4, 2, 3, 5, 2, 3)]
    group_of_row, scored = [0, 0, 1, 1, 2, 2], [4, 2, 3, 0, 0, 0]
    prompt_width, completion_width = 6, 5
    input_ids = torch.zeros(6, prompt_width + completion_width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (group, completion) in enumerate(zip(group_of_row, completions, strict=True)):
        prompt = prompts[group]
        input_ids[row, prompt_width - len(prompt) : prompt_width] = torch.tensor(prompt)
        input_ids[row, prompt_width : prompt_width + len(completion)] = torch.tensor(completion)
        attention_mask[row, prompt_width - len(prompt) : prompt_width] = 1
        attention_mask[row, prompt_width : prompt_width + scored[row]] = 1  # TRL's completion mask

    model.zero_grad()
    stock = model.model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
    expected = load_balancing_loss_func(stock.router_logits, config.num_experts, config.num_experts_per_tok,
                                        attention_mask)  # fmt: skip
    expected.backward()
    expected_grads = [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]

    model.zero_grad()
    rows = row_groups([prompts[g] for g in group_of_row], scored)
    packed = pack_groups(input_ids, completion_width, rows, torch.float32, token_weights=True)
    with recording_router_logits(model) as logits:
        model(**packed.model_inputs(), fused_lm_head=True, output_router_logits=False)
    assert len(logits) == config.num_hidden_layers
    ours = weighted_aux_loss(logits, packed.token_weights, config)
    ours.backward()
    torch.testing.assert_close(ours, expected, rtol=RTOL, atol=ATOL)
    for layer, grad in zip(model.model.layers, expected_grads, strict=True):
        torch.testing.assert_close(layer.mlp.gate.weight.grad, grad, rtol=1e-4, atol=1e-7)
    # Each group's prompt once: 5 + 3 + 4 body tokens, and segments of 1 + n tokens (one for the unscored group)
    assert int((packed.token_weights > 0).sum()) == (5 + 3 + 4) + (5 + 3 + 4) + 1
    assert int(packed.token_weights.sum()) == int(attention_mask.sum())


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
