"""
`use_liger_kernel=True` (TRL 1.16 applies Liger's layer kernels alone: RMSNorm, SwiGLU and rotary embeddings, patched
into the model's instance when training starts; its fused cross-entropy is refused by TRL itself). Liger's kernels run
on a GPU only (Triton), so here they are stood in by torch functions patched in exactly as Liger patches them (each
RMSNorm's and MLP's `forward` bound on the instance, the modeling module's `apply_rotary_pos_emb` replaced): ours
shares with them in every phase and equals stock TRL run the same way. On a GPU, `gpu_session.sh` runs the real ones.
"""

import warnings

import pytest
import torch
import transformers
import trl
from transformers.models.llama import modeling_llama

from rloo_efficient import RLOOTrainer

from .conftest import assert_metrics_close, run, step_metrics, training_args


def _rms_norm(self, hidden_states):  # Liger's "llama" casting: the variance in float32, the weight after the cast
    _rms_norm.calls += 1
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32) if dtype in (torch.float16, torch.bfloat16) else hidden_states
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(dtype)


def _swiglu(self, x):
    _swiglu.calls += 1
    return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    _rotary.calls += 1
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    half = lambda x: torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)  # noqa: E731
    return q * cos + half(q) * sin, k * cos + half(k) * sin


def apply_liger_stand_in(model, kernel_config):
    """What `liger_kernel.transformers._apply_liger_kernel_to_instance` does to a Llama, with torch stand-ins."""
    assert kernel_config.get("fused_linear_cross_entropy") is False  # TRL turns it off
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modeling_llama.apply_rotary_pos_emb = _rotary
    for module in base.modules():
        if isinstance(module, modeling_llama.LlamaRMSNorm):
            module.__dict__["forward"] = _rms_norm.__get__(module)
        elif isinstance(module, modeling_llama.LlamaMLP):
            module.__dict__["forward"] = _swiglu.__get__(module)


# transformers 5.25 kernelizes a model `from_pretrained` loads at every change of train/eval mode: a layer with a Hub
# kernel mapping and no kernel for the device gets its class's forward back, which removes a forward bound on the
# instance, as Liger binds its RMSNorm (TRL's `use_liger_kernel=True` loses it; its MLP and rotary patches stay)
KERNELIZES = tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (5, 25)


@pytest.fixture
def liger_stand_in(monkeypatch):
    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", apply_liger_stand_in)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)  # restored after
    for function in (_rms_norm, _swiglu, _rotary):
        function.calls = 0


def test_liger_kernels_share_in_every_phase_and_equal_stock(workload, tmp_path, liger_stand_in):
    cfg, path, dataset = workload
    settings = dict(use_liger_kernel=True, max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL: use_liger_kernel is deprecated in favour of Hub kernels
        stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "stock", config_class=trl.RLOOConfig,
                                                         **settings), dataset)  # fmt: skip
        stock_calls = (_rms_norm.calls, _swiglu.calls, _rotary.calls)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = run(RLOOTrainer, path, training_args(tmp_path / "ours", **settings), dataset)
    assert stock_calls[1] and stock_calls[2] and _rotary.calls > stock_calls[2]  # ours ran them
    if KERNELIZES:  # Liger's RMSNorm is reverted at training's start, in stock's model and ours alike
        assert stock_calls[0] == _rms_norm.calls == 0
    else:
        assert stock_calls[0] and _rms_norm.calls > stock_calls[0]
    assert not [str(w.message) for w in caught if "rloo_efficient" in str(w.message) and "off" in str(w.message)]
    assert ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    assert_metrics_close(step_metrics(stock), step_metrics(ours), 1e-6, 1e-8)
