"""
`share_under_dropout=True`: prompts shared while dropout is active, a token forwarded once drawing one dropout mask
for every row holding it. Not stock's samples, but each row's masks distributed as stock's: the expected gradient is
stock's, which a test over many seeds checks within a tolerance from the gradients' variance (and a mask scheme
that is not stock's in distribution fails it). Through the trainer: with LoRA's dropout (TRL's `--use_peft` default,
0.05) every phase shares; with the dropout rate 0 it is stock's run.
"""

import warnings

import pytest
import torch
import trl
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import add_fused_lm_head

from rloo_efficient import RLOOTrainer
from rloo_efficient.core.forward.packing import pack_rows
from rloo_efficient.core.layers.install import install
from rloo_efficient.demo.workload import build_dataset, build_model_dir

from . import trees
from .conftest import assert_metrics_close, run, step_metrics, tiny_workload, training_args


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])


@pytest.mark.parametrize("opt_in", [False, True])
def test_lora_dropout_shares_every_phase_by_choice(model_cache, tmp_path, opt_in):
    """A `--use_peft` run (LoRA dropout 0.05, TRL's `disable_dropout=False`): without the opt-in, one warning naming
    both ways to share and nothing shared; with it, no warning, and the shared prefill, the packed log-prob and
    training forwards and the prompts held across micro-batches all engage."""
    cfg = tiny_workload(model_cache)
    args = training_args(tmp_path, share_under_dropout=opt_in, max_steps=2, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, steps_per_generation=2)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = run(RLOOTrainer, build_model_dir(cfg), args, build_dataset(cfg),
                      peft_config=LoraConfig(**LORA, lora_dropout=0.05))  # fmt: skip
    messages = [str(w.message) for w in caught if "dropout is active" in str(w.message)]
    if opt_in:
        assert not messages
        assert trainer.shared_prefill_tokens > 0 and trainer.packed_forward_tokens > 0
        assert trainer.held_forward_tokens > 0
    else:
        assert messages and all("disable_dropout=True" in m and "share_under_dropout=True" in m for m in messages)
        assert trainer.shared_prefill_tokens == trainer.packed_forward_tokens == 0


def test_the_opt_in_with_no_dropout_is_stocks_run(workload, tmp_path):
    """LoRA with `lora_dropout=0` and the opt-in: stock TRL's completions and metrics, sharing engaged."""
    cfg, path, dataset = workload
    lora = LoraConfig(**LORA, lora_dropout=0.0)
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "s", config_class=trl.RLOOConfig, max_steps=2),
                dataset, peft_config=lora)  # fmt: skip
    ours = run(RLOOTrainer, path, training_args(tmp_path / "o", share_under_dropout=True, max_steps=2), dataset,
               peft_config=lora)  # fmt: skip
    assert ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    assert_metrics_close(step_metrics(stock), step_metrics(ours), 1e-6, 1e-8)


SEEDS = 400
P = 0.5  # a large rate: the masks' effect well above the seeds' noise
# Each gradient component's difference in standard errors (from both sides' variances over the seeds) stays below this
# bound: for 1,536 components, two-sided P(|Z| > 5) = 5.7e-7 each, under 1e-3 for the largest of them
BOUND = 5.0


def _lora_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    model = LlamaForCausalLM(config).double()
    model.config._attn_implementation = "sdpa"
    add_fused_lm_head(model, outputs=("log_probs",))
    model = get_peft_model(model, LoraConfig(**LORA, lora_dropout=P, init_lora_weights=False))
    install(model)
    return model.train()


def _gradients(model, forward, mutation=None) -> torch.Tensor:
    """`(SEEDS, parameters)`: each seed's gradient of `forward()`'s loss over the trainable parameters. `mutation`: a
    context replacing dropout while `forward` runs."""
    import contextlib

    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for seed in range(SEEDS):
        torch.manual_seed(seed)
        model.zero_grad()
        with mutation() if mutation is not None else contextlib.nullcontext():
            forward().backward()
        out.append(torch.cat([p.grad.flatten() for p in params]))
    return torch.stack(out)


def _unscaled():
    """Dropout that zeroes without scaling the kept values by 1 / (1 - p)."""
    import contextlib

    dropout = torch.nn.functional.dropout

    @contextlib.contextmanager
    def patched():
        torch.nn.functional.dropout = lambda x, p=0.5, training=True, inplace=False: (
            dropout(x, p, training) * (1 - p) if training else x)  # fmt: skip
        try:
            yield
        finally:
            torch.nn.functional.dropout = dropout

    return patched


def _one_mask():
    """Dropout that draws one mask per call shape and reuses it in every later layer."""
    import contextlib

    dropout = torch.nn.functional.dropout

    @contextlib.contextmanager
    def patched():
        masks = {}

        def reused(x, p=0.5, training=True, inplace=False):
            if not training:
                return x
            if x.shape not in masks:
                masks[x.shape] = dropout(torch.ones_like(x), p, True)
            return x * masks[x.shape]

        torch.nn.functional.dropout = reused
        try:
            yield
        finally:
            torch.nn.functional.dropout = dropout

    return patched


@pytest.mark.parametrize("mutation", [None, "unscaled", "one_mask"])
def test_the_expected_gradient_is_stocks(mutation):
    """Four completions of one prompt (and a second prompt's two), LoRA dropout p = 0.5 on the queries, values and MLP:
    stock's padded forward (every row its own masks) against ours' packed forward (a prompt token's mask shared by its
    rows), the gradient of a fixed weighted sum of log-probs, its mean over 400 seeds each. Every component's
    difference is within `BOUND` standard errors (from both sides' variances); a packed forward whose dropout leaves
    out the 1 / (1 - p) scale, or reuses one mask across layers, is not (run as mutations of ours' forward: with
    either, the largest difference is over the bound)."""
    model = _lora_model()
    prompts = [[5, 9, 12, 7, 30, 31, 2, 8]] * 4 + [[5, 9, 40, 41, 3]] * 2
    completions = [[11, 12, 13], [11, 14], [20, 21, 22], [23], [24, 25], [26, 27, 28]]
    ids, mask, width_c, rows = trees.stock_batch(prompts, completions)
    weights = torch.randn(len(prompts), width_c, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights = weights * mask[:, -width_c:]
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, : ids.shape[1] - width_c] = -100

    def stock():
        logps = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -width_c:]
        return (logps * weights).sum()

    def ours():
        packed = pack_rows(ids, width_c, rows)
        assert packed.num_tokens < int(mask.sum())  # the prompts forwarded once
        return (packed.unpack(model(**packed.model_inputs(), fused_lm_head=True).log_probs) * weights).sum()

    mutated = {None: None, "unscaled": _unscaled(), "one_mask": _one_mask()}[mutation]
    a, b = _gradients(model, stock), _gradients(model, ours, mutated)
    scores = (b.mean(0) - a.mean(0)).abs() / (a.var(0) / SEEDS + b.var(0) / SEEDS).sqrt()
    assert scores.numel() == 1536
    if mutation is None:
        assert scores.max() < BOUND, scores.max()
    else:
        assert scores.max() > BOUND, scores.max()
