"""
The CUDA branches on this CPU-only build, with fake CUDA tensors (`FakeTensorMode`, device `cuda:0`): every call of
the flash (windowed too) and memory-efficient kernels, forward and backward; the packed forward and two decoding steps
of tiny Llama and Qwen3 through transformers' own model code; and Gemma 3's and GPT-OSS's packed forward under a
sliding window, with GPT-OSS's sinks. Shapes, dtypes, strides, the layouts the kernels assume, and which kernel is
chosen are checked; values are not computed, so these tests catch signatures, shapes and plumbing, not numbers (the
first-use check does that on a GPU; the CPU tests do it for the code the devices share).

What it takes on a CPU-only build: its Python bindings for indexing (reads and writes), `copy_`, `contiguous` and `~`
ask for CUDA's device guard, which it lacks, so the tests route them through the aten operators; autograd cannot
record fake CUDA tensors, so the backward functions are called directly; host values (`.numpy()`) are read outside
the fake mode; and the compute capability transformers' experts ask for is the fake one.
"""

import contextlib
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rloo_efficient.core.attention import backend as prefix_attention
from rloo_efficient.core.attention import checks, kernels
from rloo_efficient.core.attention import varlen as varlen_attention
from rloo_efficient.core.attention.tree import TreeAttention
from rloo_efficient.core.forward.packing import pack_rows
from rloo_efficient.core.generation.generate import prefill_prompts, unique_rows
from rloo_efficient.core.generation.prompt_cache import PrefixCache
from rloo_efficient.core.layers.install import install
from rloo_efficient.core.transformers_compat import CACHE_KWARG
from rloo_efficient.core.tree import layout as layouts
from rloo_efficient.profiling.op_count import HOST_SYNC_OPS

from .helpers import stock_batch


aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
HOPPER = (9, 0)
FUSED = {"cuda_flash", "cuda_flash_varlen", "cuda_efficient"}


def _getitem(x: torch.Tensor, index):
    """`x[index]` through aten operators: integers, slices, None, Ellipsis, and adjacent tensor indices."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        named = sum(1 for i in index if i is not None and i is not Ellipsis)
        index = index[:at] + (slice(None),) * (x.dim() - named) + index[at + 1 :]
    out, dim, advanced = x, 0, []
    for i in index:
        if i is None:
            out, dim = aten.unsqueeze.default(out, dim), dim + 1
        elif isinstance(i, int):
            out = aten.select.int(out, dim, i)
        elif isinstance(i, slice):
            out, dim = aten.slice.Tensor(out, dim, i.start, i.stop, i.step or 1), dim + 1
        elif isinstance(i, (torch.Tensor, list)):
            advanced.append((dim, torch.tensor(i) if isinstance(i, list) else i))
            dim += 1
        else:
            raise NotImplementedError(f"index {i!r}")
    if advanced:
        dims = [d for d, _ in advanced]
        assert dims == list(range(dims[0], dims[0] + len(dims))), "only adjacent tensor indices"
        out = aten.index.Tensor(out, [None] * dims[0] + [t for _, t in advanced])
    return out


def _setitem(x: torch.Tensor, index, value) -> None:
    """`x[index] = value` through aten operators: tensor indices (index_put_), or basic ones (a view written)."""
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, torch.Tensor) for i in index):
        assert all(isinstance(i, torch.Tensor) for i in index), "tensor indices only"
        value = value if isinstance(value, torch.Tensor) else torch.full((), value, dtype=x.dtype).to(x.device)
        aten.index_put_.default(x, list(index), value)
    elif isinstance(value, torch.Tensor):
        aten.copy_.default(_getitem(x, index), value)
    else:
        aten.fill_.Scalar(_getitem(x, index), value)


class _LayoutContracts:
    """`torch.ops.aten`, with the layouts the CUDA kernels assume but do not check asserted: the efficient kernel's
    backward reads `out` with a row stride of H * D (kernel_backward.h `o_strideM`), and flash's log-sum-exp as
    contiguous (B, H, L)."""

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)
        if name == "_scaled_dot_product_efficient_attention_backward":

            def checked(grad_out, query, key, value, bias, out, lse, *args, **kwargs):
                heads, length, dim = out.shape[1:]  # (a single head's stride is no layout: it is never stepped)
                assert out.stride(3) == 1 and (heads == 1 or out.stride(1) == dim)
                assert length == 1 or out.stride(2) == heads * dim
                assert lse.is_contiguous() and lse.shape[-1] % 32 == 0
                return op(grad_out, query, key, value, bias, out, lse, *args, **kwargs)

            return checked
        if name == "_flash_attention_forward":  # the variable-length entry point (the nodes, windowed or not; levels)

            def checked_varlen_forward(query, key, value, cum_q, cum_k, max_q, max_k, *args, **kwargs):
                assert query.dim() == key.dim() == value.dim() == 3 and key.shape[1] == value.shape[1]
                assert query.shape[1] % key.shape[1] == 0 and all(x.stride(-1) == 1 for x in (query, key, value))
                assert cum_q.dtype == cum_k.dtype == torch.int32 and cum_q.shape == cum_k.shape and cum_q.dim() == 1
                assert isinstance(max_q, int) and isinstance(max_k, int) and 0 < max_q <= query.shape[0]
                assert 0 < max_k <= key.shape[0]
                windows = kwargs.get("window_size_left"), kwargs.get("window_size_right")
                assert windows == (None, None) or (isinstance(windows[0], int) and windows[0] >= 0 and windows[1] == 0)
                return op(query, key, value, cum_q, cum_k, max_q, max_k, *args, **kwargs)

            return checked_varlen_forward
        if name == "_flash_attention_backward":  # the windowed (variable-length) entry point

            def checked_varlen(grad_out, query, key, value, out, lse, cum_q, cum_k, *args, **kwargs):
                assert lse.is_contiguous() and lse.shape == (query.shape[1], query.shape[0])  # (H, total)
                assert cum_q.dtype == cum_k.dtype == torch.int32 and all(x.stride(-1) == 1 for x in (grad_out, out))
                return op(grad_out, query, key, value, out, lse, cum_q, cum_k, *args, **kwargs)

            return checked_varlen
        if name == "_scaled_dot_product_flash_attention_backward":

            def checked_flash(grad_out, query, key, value, out, lse, *args, **kwargs):
                assert lse.is_contiguous() and out.stride(3) == 1 and grad_out.stride(3) == 1
                return op(grad_out, query, key, value, out, lse, *args, **kwargs)

            return checked_flash
        return op


@contextlib.contextmanager
def fake_cuda(monkeypatch, capability=HOPPER):
    """
    Fake CUDA tensors (device `cuda:0`, compute `capability`), no gradients, the bindings above routed through aten,
    and the kernels recorded as they are chosen. The first-use check compares values, which fake tensors do not have:
    every configuration counts as checked.
    """
    tensor = torch.Tensor
    numpy = tensor.numpy

    def host_numpy(self, *args, **kwargs):
        with unset_fake_temporarily():
            return numpy(self, *args, **kwargs)

    # The operators (type slots) on the fake tensors' class only: `__getitem__` set on `torch.Tensor` and removed again
    # leaves CPython's sequence slot behind, and every tensor then counts as a sequence (`torch.tensor` of a list of
    # 0-d tensors, as in Qwen-VL's get_rope_index, then fails in every later test)
    for name, function in {"__getitem__": _getitem, "__setitem__": _setitem,
                           "__invert__": lambda self: aten.bitwise_not.default(self)}.items():  # fmt: skip
        monkeypatch.setattr(FakeTensor, name, function)
    for name, function in {
        "copy_": lambda self, src, non_blocking=False: aten.copy_.default(self, src, non_blocking),
        "contiguous": lambda self, memory_format=torch.contiguous_format: (
            self if self.is_contiguous(memory_format=memory_format) else aten.clone.default(self, memory_format=memory_format)),
        "pin_memory": lambda self, *args: self,
        "numpy": host_numpy,
    }.items():  # fmt: skip
        monkeypatch.setattr(tensor, name, function)
    monkeypatch.setattr(checks, "_status", {})
    monkeypatch.setattr(checks, "check_kernel", lambda config: None)
    monkeypatch.setattr(kernels, "device_capability", lambda index: capability)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)  # transformers' MoE asks
    chosen = []
    forward = kernels._kernel_forward
    expand = kernels._expand_heads

    def recording(kernel, query, key, *args):
        chosen.append((kernel, query.shape[1] // key.shape[1]))  # the kernel, and how many query heads per key head
        return forward(kernel, query, key, *args)

    def recorded_expand(x, heads):
        if x.shape[1] != heads:
            chosen.append(("expanded keys", heads))
        return expand(x, heads)

    varlen = checks.varlen_forward

    def recording_varlen(kernel, query, key, *args):
        chosen.append((kernel, query.shape[1] // key.shape[1]))
        return varlen(kernel, query, key, *args)

    monkeypatch.setattr(kernels, "_kernel_forward", recording)
    monkeypatch.setattr(checks, "varlen_forward", recording_varlen)
    monkeypatch.setattr(kernels, "_expand_heads", recorded_expand)
    monkeypatch.setattr(kernels, "aten", _LayoutContracts())
    monkeypatch.setattr(varlen_attention, "aten", _LayoutContracts())
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        yield chosen


def on_cuda(*shape, dtype, transpose=True):
    """A fake CUDA tensor laid out (B, L, h, D) and returned as (B, h, L, D), as transformers hands q, k, v over."""
    x = torch.randn(*shape).to(CUDA, dtype)
    return x.transpose(1, 2) if transpose else x


# -- kernel choice ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "capability, dtype, dim, with_bias, expected",
    [
        ((9, 0), torch.bfloat16, 128, False, "cuda_flash"),
        ((8, 0), torch.float16, 64, False, "cuda_flash"),
        ((12, 1), torch.bfloat16, 256, False, "cuda_flash"),
        ((9, 0), torch.bfloat16, 128, True, "cuda_efficient"),  # a bias: flash takes none
        ((9, 0), torch.float32, 128, False, "cuda_efficient"),  # flash is half precision only
        ((9, 0), torch.bfloat16, 512, False, "cuda_efficient"),  # flash: head_dim up to 256
        ((9, 0), torch.bfloat16, 100, False, "math"),  # neither: head_dim not a multiple of 8 in half precision
        ((9, 0), torch.float32, 100, False, "cuda_efficient"),  # float32: a multiple of 4
        ((8, 6), torch.bfloat16, 200, False, "cuda_efficient"),  # flash's backward fails there on sm86
        ((9, 0), torch.bfloat16, 200, False, "cuda_flash"),
        ((7, 5), torch.float16, 64, False, "cuda_efficient"),  # Turing: no flash
        ((7, 5), torch.bfloat16, 64, False, "math"),  # no bfloat16 kernel before sm80
        ((6, 1), torch.float32, 60, False, "cuda_efficient"),
        ((13, 0), torch.bfloat16, 128, False, "math"),  # beyond both kernels' known range
        ((9, 0), torch.float64, 64, False, "math"),
    ],
)
def test_kernel_choice_follows_pytorchs_constraints(monkeypatch, capability, dtype, dim, with_bias, expected):
    with fake_cuda(monkeypatch, capability):
        query = on_cuda(2, 5, 4, dim, dtype=dtype)
        bias = torch.zeros(2, 1, 1, 5, dtype=dtype).to(CUDA) if with_bias else None
        assert kernels.choose_kernel(query, bias) == expected


# -- every kernel call, forward and backward -------------------------------------------------------------------------
CALLS = {  # use: (query length, key length, causal)
    "causal": (40, 40, True),
    "causal window": (40, 40, True),  # keys in (i - 16, i]: flash's own window (the blocks longer than a window)
    "prefix": (32, 150, False),  # a multiple of 32 queries: the efficient kernel's log-sum-exp needs no padding
    "decode": (1, 150, False),
}


KERNEL_CALLS = [
    (kernel, dtype, use, masked)
    for kernel, dtype in [("cuda_flash", torch.bfloat16), ("cuda_flash", torch.float16), ("cuda_efficient",
                          torch.bfloat16), ("cuda_efficient", torch.float16), ("cuda_efficient", torch.float32)]
    for use in CALLS
    for masked in (None, "by key", "by query")
    if not (masked and use.startswith("causal"))
    # flash takes no bias; causal calls have none; a window's mask by query is for the prefix part (and the banded
    # chunks, shaped alike)
    if masked is None or (kernel == "cuda_efficient" and use != "causal" and (masked == "by key" or use == "prefix"))
    if use != "causal window" or kernel == "cuda_flash"  # elsewhere a window is applied by chunks with a mask
]  # fmt: skip


@pytest.mark.parametrize("kernel, dtype, use, masked", KERNEL_CALLS)
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("dim", [64, 128])
def test_every_kernel_call_has_the_right_signature_shapes_and_strides(monkeypatch, kernel, dtype, heads, kv_heads, dim,
                                                                      use, masked):  # fmt: skip
    query_length, key_length, causal = CALLS[use]
    with fake_cuda(monkeypatch) as chosen:
        q, g = on_cuda(2, query_length, heads, dim, dtype=dtype), on_cuda(2, query_length, heads, dim, dtype=dtype)
        k, v = on_cuda(2, key_length, kv_heads, dim, dtype=dtype), on_cuda(2, key_length, kv_heads, dim, dtype=dtype)
        bias = None
        if masked:  # the prefix part's padding bias (B, 1, 1, Lk), or a window's (B, 1, Lq, Lk)
            bias = torch.zeros(2, 1, 1 if masked == "by key" else query_length, key_length, dtype=dtype).to(CUDA)
        window = 16 if use == "causal window" else None
        out, lse, state = kernels.forward(kernel, q, k, v, bias, causal, dim**-0.5, window=window)
        assert state.window == window and (window is None or state.kernel == "cuda_flash")
        assert (out.shape, out.dtype, out.device) == (q.shape, dtype, CUDA) and out.stride(-1) == 1
        assert (lse.shape, lse.dtype) == ((2, heads, query_length), torch.float32)
        # The efficient kernel has no grouped heads: folded into the query length when non-causal and masked by key
        # at most, never a copy of the keys and values per query head there
        folds = kernel == "cuda_efficient" and not causal and heads != kv_heads and masked != "by query"
        assert state.folded == folds
        expanded = [entry for entry in chosen if entry[0] == "expanded keys"]
        assert not expanded if kernel == "cuda_flash" or heads == kv_heads or folds else expanded
        assert chosen[0] == (kernel, kv_heads // kv_heads if folds else heads // kv_heads)
        token_major = lse.transpose(1, 2).contiguous().transpose(1, 2)  # as the packed forward keeps it
        grads = kernels.backward(state, g, q, k, v, bias, out, token_major, causal, dim**-0.5)
        for grad, like in zip(grads, (q, k, v), strict=True):
            assert (grad.shape, grad.dtype, grad.device) == (like.shape, dtype, CUDA) and grad.stride(-1) == 1


# -- the model: packed forward, packed attention's backward, two decoding steps --------------------------------------
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
# Sliding windows (8 tokens, shorter than the packed prompts and rows) on every other layer; GPT-OSS's sinks
WINDOWED = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(query_pre_attn_scalar=64)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}


def fake_model(arch: str, dtype: torch.dtype):
    import transformers

    extra = {}
    if arch in WINDOWED:
        config_name, model_name, extra = WINDOWED[arch]
        config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
        extra = {**extra, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    else:
        config_class, model_class = ARCHITECTURES[arch]
    # 4 query heads on 2 key/value heads, head_dim 64: the smallest shapes the CUDA kernels take as real models do
    config = config_class(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, pad_token_id=0, **extra)  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(CUDA):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    install(model)
    return model


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# folded: flash's variable-length call, each node's ancestors' keys joined before its own; levels: its calls for the
# nodes and for each level (the fold off); buckets: the padded length buckets (the variable-length call off)
@pytest.mark.parametrize("path", ["folded", "levels", "buckets"])
def test_the_packed_forward_runs_the_fused_kernels_on_cuda(monkeypatch, arch, dtype, path):
    # Two groups, prompts of 20 and 14 tokens (nodes of other lengths: the level's part carries a bias), 3 rows each
    ids, rows = stock_batch([20, 14], [0, 0, 0, 1, 1, 1], [5, 4, 3, 5, 2, 1], 5, seed=0)
    varlen = path != "buckets"
    if not varlen:
        monkeypatch.setattr(layouts, "VARLEN_DEVICES", ())
    if path == "levels":
        monkeypatch.setattr(layouts, "FOLD_COPIES", 0)
    with fake_cuda(monkeypatch) as chosen:
        model = fake_model(arch, dtype)
        packed = pack_rows(ids.to(CUDA), 5, rows, min_saved=0)
        layout = packed.layout
        assert packed.input_ids.device == CUDA and len(layout.parts) == 1 and layout.parts[0].padded_keys
        assert (layout.packed_nodes is not None, len(layout.packed_parts)) == ((True, 1) if varlen else (False, 0))
        assert (layout.held_nodes is not None) == (path == "folded")
        logits = model(**packed.model_inputs()).logits
        assert (logits.shape, logits.dtype, logits.device) == ((1, packed.num_tokens, 64), dtype, CUDA)
        if path == "folded":  # per layer one call: the nodes, each reading its prompt's keys before its own
            assert chosen == [("cuda_flash_varlen", 2)] * 2
        elif varlen:  # per layer: the nodes in one causal call, the level's part in one more: flash's, no padding
            assert chosen == [("cuda_flash_varlen", 2)] * 2 * 2
        else:  # each length bucket of nodes (causal) on flash; the level's part (the rows' queries over their prompt)
            # on the efficient kernel (its keys padded: a bias) with its grouped heads folded; never the math path
            assert chosen == ([("cuda_flash", 2)] * len(layout.buckets) + [("cuda_efficient", 1)]) * 2
        _attention_backward(chosen, packed, layout, dtype)


@pytest.mark.parametrize("arch", [*ARCHITECTURES, "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_is_one_flash_call_per_layer_on_cuda(monkeypatch, arch, dtype):
    """A micro-batch of one row (its tree a path: [`tree.runs.chain_of`]) attends in one causal flash call per layer
    over the row itself, as stock's padded row does: no variable-length call, no gather; its backward the kernel's
    (a window: flash's own), its gradients in the inputs' shapes."""
    ids, rows = stock_batch([20], [0], [5], 5, seed=0)
    with fake_cuda(monkeypatch) as chosen:
        model = fake_model(arch, dtype)
        packed = pack_rows(ids.to(CUDA), 5, rows, min_saved=0)
        assert packed.layout.chain == ()
        model(**packed.model_inputs())
        assert chosen == [("cuda_flash", 2)] * 2
        window = 8 if arch in WINDOWED else None
        _attention_backward(chosen, packed, packed.layout, dtype, window=window, sliding=window is not None)
        assert chosen == [("cuda_flash", 2)]  # the one layer's forward called directly, then its backward


def test_one_row_scoring_chunks_replay_a_captured_forward_on_cuda(monkeypatch):
    """The graphed no-grad pass ([`core.forward.graphed`]) on CUDA, as it is by default: a prompt's rows packed in full
    have one layout on the device; the first runs eagerly, the second is the warm-up and the capture (emulated: the
    forward kept to replay, on fake tensors), the third copies its tokens, positions and labels into the captured
    inputs and replays: one flash call per layer each time, the outputs in the chunk's shapes on CUDA."""
    from rloo_efficient.core.forward import graphed

    ids, rows = stock_batch([20], [0, 0, 0], [5, 3, 1], 5, seed=0)
    full = [graphed.scored_in_full(rows[row : row + 1], 5) for row in range(3)]  # (host tables: before the fake mode)
    replays = []

    class Graph:
        def __init__(self, step, outputs):
            self.step, self.outputs = step, outputs

        def replay(self):
            replays.append(1)
            for buffer, value in zip(self.outputs, self.step(), strict=True):
                if buffer is not None:
                    buffer.copy_(value)

    def capture(step, device):
        assert device == CUDA
        outputs = step()
        return Graph(step, outputs), outputs

    monkeypatch.setattr(graphed, "warm_up", lambda step, device, buffers=(): step())
    monkeypatch.setattr(graphed, "capture", capture)
    with fake_cuda(monkeypatch) as chosen:
        model = fake_model("llama", torch.bfloat16)
        model._rloo_scoring_graph_checked = True  # (the check compares values, which fake tensors do not have)
        assert graphed.GraphedForwards.applies(model, CUDA)
        forwards = graphed.GraphedForwards(model, CUDA, lambda **inputs: SimpleNamespace(
            log_probs=model(**inputs).logits[..., 0], entropy=None), entropy=False)  # fmt: skip
        keys = set()
        for row in range(3):
            packed = pack_rows(ids[row : row + 1].to(CUDA), 5, full[row])
            keys.add(graphed.signature(packed))
            log_probs, _ = forwards.forward(packed)
            assert (log_probs.shape, log_probs.device) == ((1, packed.num_tokens), CUDA)
        assert len(keys) == 1 and len(forwards.graphs) == 1 and replays == [1]
        # per forward one flash call per layer: eager, warm-up, capture, the replay
        assert chosen == [("cuda_flash", 2)] * 2 * 4


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_the_tree_prefill_runs_the_fused_kernels_on_cuda(monkeypatch, arch):
    """Generation's prefill over the prompts' prefix tree (a 70-token system prompt, three tasks): the decoder's packed
    forward on the fused kernels, each layer's keys and values laid out as the padded batch's cache, on the device."""
    from rloo_efficient.core.generation.tree_prefill import plan_tree_prefill, tree_prefill

    system = [5] * 70
    prompts = [system + [6] * 20, system + [7] * 13, system + [8]]
    width = max(len(prompt) for prompt in prompts)
    plan = plan_tree_prefill(prompts, [0, 1, 2], width)
    assert plan is not None and plan.tree.num_tokens == 70 + 19 + 12
    with fake_cuda(monkeypatch) as chosen:
        model = fake_model(arch, torch.bfloat16)
        cache = tree_prefill(model, plan)
        for layer in cache.layers:
            assert (layer.keys.shape, layer.keys.dtype, layer.keys.device) == ((3, 2, width - 1, 64), torch.bfloat16,
                                                                                 CUDA)  # fmt: skip
            assert layer.keys.stride(-1) == 1 and layer.values.shape == layer.keys.shape
        assert chosen and {kernel for kernel, _ in chosen} == {"cuda_flash_varlen"}  # the nodes, the system prompt


@pytest.mark.parametrize("arch", [*ARCHITECTURES, "gemma3", "gpt_oss"])
def test_a_continued_prefill_runs_the_fused_kernels_on_cuda(monkeypatch, arch):
    """A tool turn's rows continuing their held caches (one row the prompt kept once per group, the other its own): the
    held keys copied into the padded batch's cache, the new tokens' packed forward over them on the fused kernels
    (with a window of 8 on every other layer, and sinks: each query's held keys masked to its window)."""
    from rloo_efficient.core.generation.turn_cache import HeldCache, continue_prefill, plan_continuation

    held_tokens = [np.array([5] * 70 + [6] * 20 + [9] * 6), np.array([5] * 70 + [7] * 13 + [3] * 4)]
    prompts = [[*held_tokens[0], *[4] * 31], [*held_tokens[1], *[2] * 9]]  # tool answers of 31 and 9 tokens
    width = max(len(prompt) for prompt in prompts)
    with fake_cuda(monkeypatch) as chosen:
        model = fake_model(arch, torch.bfloat16)
        held_width = 96
        own = [tuple(on_cuda(2, held_width, 2, 64, dtype=torch.bfloat16) for _ in range(2)) for _ in range(2)]
        # Row 0's first 89 tokens in a prompt kept once (one group, 89 columns), the rest in its own from column 0
        prefix = [tuple(on_cuda(1, 89, 2, 64, dtype=torch.bfloat16) for _ in range(2)) for _ in range(2)]
        held = HeldCache(held_tokens, own, prefix, np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64),
                         np.array([89, 0]), np.array([0, held_width - 87]))  # fmt: skip
        plan = plan_continuation(held, prompts)
        assert plan.reused.tolist() == [96, 87]
        cache, forwarded = continue_prefill(model, held, plan, prompts, width)
        assert forwarded == 30 + 8
        for layer in cache.layers:
            assert (layer.keys.shape, layer.keys.dtype, layer.keys.device) == ((2, 2, width - 1, 64), torch.bfloat16,
                                                                                 CUDA)  # fmt: skip
        # Under a window the held part masks per query (not folded: its keys, the last w - 1 columns, copied per
        # query head, as a windowed level's part)
        kernels_run = {kernel for kernel, _ in chosen if kernel != "expanded keys"}
        assert chosen and kernels_run <= FUSED
        assert any(kernel == "expanded keys" for kernel, _ in chosen) == (arch in WINDOWED)
        assert all(reason is None for reason in checks._status.values())  # no kernel fell back to the math path


def _attention_backward(chosen, packed, layout, dtype, dim=64, kv_heads=2, window=None, sinks=None, sliding=False,
                        held=()):  # fmt: skip
    """The tree attention's forward and backward, called directly (autograd cannot record fake CUDA tensors); `held`:
    the held keys and values its held parts read."""
    chosen.clear()
    tokens = packed.num_tokens
    q, grad = on_cuda(1, tokens, 4, dim, dtype=dtype), on_cuda(1, tokens, 4, dim, dtype=dtype)
    k, v = on_cuda(1, tokens, kv_heads, dim, dtype=dtype), on_cuda(1, tokens, kv_heads, dim, dtype=dtype)
    ctx = SimpleNamespace(needs_input_grad=(True, True, True, sinks is not None, *(False,) * 5, *(True,) * len(held)))
    ctx.save_for_backward = lambda *tensors: setattr(ctx, "saved_tensors", tensors)
    out = TreeAttention.forward(ctx, q, k, v, sinks, layout, window, 0.125, sliding, None, *held)
    assert (out.shape, out.dtype) == ((1, tokens, 4, dim), dtype)
    grads = TreeAttention.backward(ctx, grad.transpose(1, 2))
    for got, like in zip(grads[:3], (q, k, v), strict=True):
        assert (got.shape, got.dtype, got.device) == (like.shape, dtype, CUDA)
    assert (grads[3] is None) == (sinks is None) and (sinks is None or grads[3].shape == sinks.shape)
    assert grads[4:9] == (None,) * 5
    for got, like in zip(grads[9:], held, strict=True):  # each held key's and value's gradient, in its own layout
        assert (got.shape, got.dtype, got.device) == (like.shape, dtype, CUDA)
    assert all(reason is None for reason in checks._status.values())  # no kernel fell back to the math path


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_decoding_steps_from_the_prompt_cache_run_the_fused_kernels_on_cuda(monkeypatch, arch, dtype):
    prompts, order, width = [[5] * 12, [6] * 9], [0, 0, 0, 1, 1, 1], 12  # the second prompt left-padded
    ids = torch.tensor([[0] * (width - len(prompts[g])) + prompts[g] for g in order])
    mask = torch.tensor([[0] * (width - len(prompts[g])) + [1] * len(prompts[g]) for g in order])
    first, inverse = unique_rows([prompts[g] for g in order])
    with fake_cuda(monkeypatch) as chosen:
        model = fake_model(arch, dtype)
        ids, mask = ids.to(CUDA), mask.to(CUDA)
        prefilled = prefill_prompts(model, ids, mask, first, padded=True)
        cache = PrefixCache(prefilled, inverse, [len(prompt) - 1 for prompt in prompts], width - 1)
        assert cache.layers[0].prefix_keys.shape == (2, 2, width - 1, 64)  # each prompt once
        step_ids, step_mask = ids[:, -1:], mask
        with prefix_attention.decoding_with(cache):
            for step in (1, 2):
                chosen.clear()
                positions = step_mask.sum(-1, keepdim=True) - 1
                logits = model(input_ids=step_ids, attention_mask=step_mask, position_ids=positions,
                               use_cache=True, **{CACHE_KWARG: cache}).logits  # fmt: skip
                assert (logits.shape, logits.dtype) == ((6, 1, 64), dtype)
                assert cache.layers[0].keys.shape == (6, 2, step, 64)  # each row's own tokens only
                # Per layer: the rows' queries over their padded prompts (efficient, grouped heads folded), then
                # over their own decoded tokens (flash, one query per row)
                assert chosen == [("cuda_efficient", 1), ("cuda_flash", 2)] * 2
                step_ids = torch.randint(3, 64, (6, 1)).to(CUDA)
                step_mask = torch.cat([step_mask, torch.ones(6, 1, dtype=step_mask.dtype).to(CUDA)], 1)
        assert all(reason is None for reason in checks._status.values())  # no kernel fell back to the math path


@pytest.mark.parametrize("arch", list(WINDOWED))
@pytest.mark.parametrize("path", ["folded", "levels", "buckets"])  # as in the test above
def test_windows_and_sinks_run_the_fused_kernels_on_cuda(monkeypatch, arch, path):
    """A sliding window shorter than the packed prompts (20 and 14 tokens) and rows, and GPT-OSS's sinks: windowed
    flash for the nodes longer than the window (one variable-length call, or per length bucket), the efficient kernel
    for the prompts' tails read by their subtrees (or each node reading its prompt's keys in the one windowed call);
    the tree attention's backward too."""
    ids, rows = stock_batch([20, 14], [0, 0, 0, 1, 1, 1], [12, 4, 3, 11, 2, 1], 12, seed=0)
    varlen = path != "buckets"
    if not varlen:
        monkeypatch.setattr(layouts, "VARLEN_DEVICES", ())
    if path == "levels":
        monkeypatch.setattr(layouts, "FOLD_COPIES", 0)
    windows = []
    forward = checks.varlen_forward
    monkeypatch.setattr(checks, "varlen_forward", lambda *args: windows.append(args[10]) or forward(*args))
    with fake_cuda(monkeypatch) as chosen:
        model = fake_model(arch, torch.bfloat16)
        packed = pack_rows(ids.to(CUDA), 12, rows, min_saved=0)
        logits = model(**packed.model_inputs()).logits
        assert logits.shape == (1, packed.num_tokens, 64) and logits.dtype == torch.bfloat16
        # The sliding layer: the buckets on flash (its windowed entry point for those longer than the window), the
        # level's part over the prompts' tails on the efficient kernel (a mask per query: not folded, its few keys
        # copied per query head); the full layer as without a window
        kernels_run = [entry for entry in chosen if entry[0] != "expanded keys"]
        buckets = len(packed.layout.buckets)
        if path == "folded":  # per layer one call, the sliding layer's under flash's window (8 - 1 keys before each
            # query, its prompt's last among them)
            assert kernels_run == [("cuda_flash_varlen", 2)] * 2
            assert windows == [8, None]
        elif varlen:  # the sliding layer's nodes under flash's window (8 - 1 keys before each query), its level's part
            # masked per query; the full layer's nodes and part in flash's variable-length calls, no window
            assert kernels_run == [("cuda_flash_varlen", 2), ("cuda_efficient", 2)] + [("cuda_flash_varlen", 2)] * 2
            assert windows == [8, None, None]
        else:
            assert kernels_run == [("cuda_flash", 2)] * buckets + [("cuda_efficient", 2)] + [
                ("cuda_flash", 2)] * buckets + [("cuda_efficient", 1)]  # fmt: skip
            assert windows == []
        sinks = getattr(model.model.layers[0].self_attn, "sinks", None)
        _attention_backward(chosen, packed, packed.layout, torch.bfloat16, window=8, sinks=sinks, sliding=True)


def test_a_windowed_kernel_that_raises_leaves_the_window_to_chunks_not_to_the_math_path(monkeypatch):
    """Flash's windowed call raising (forward or backward): the blocks go to the chunks with a mask, on the efficient
    kernel, never the math path's (L, L) scores; one warning names the kernel."""
    import warnings

    from rloo_efficient.core.attention import windows as window_attention

    def raising(*args, **kwargs):
        raise RuntimeError("no windowed flash here")

    with fake_cuda(monkeypatch) as chosen, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q, g = on_cuda(3, 40, 4, 64, dtype=torch.bfloat16), on_cuda(3, 40, 4, 64, dtype=torch.bfloat16)
        k, v = on_cuda(3, 40, 2, 64, dtype=torch.bfloat16), on_cuda(3, 40, 2, 64, dtype=torch.bfloat16)
        out, lse, band = window_attention.band_forward(q, k, v, 16, 0.125)  # windowed flash, as it should
        assert band.chunks == 0 and band.kernel.window == 16
        monkeypatch.setattr(kernels, "_flash_window_backward", raising)
        grads = window_attention.band_backward(band, g, q, k, v, out, lse, 16, 0.125)  # raises: the chunks' backward
        assert [grad.shape for grad in grads] == [q.shape, k.shape, v.shape]
        chosen.clear()
        monkeypatch.setattr(kernels, "_flash_window_forward", raising)
        out, lse, band = window_attention.band_forward(q, k, v, 16, 0.125)  # disabled: the chunks
        assert band.chunks == 8 and out.shape == q.shape  # 3 blocks of 40 tokens, 16 queries a chunk
        assert [entry[0] for entry in chosen if entry[0] != "expanded keys"] == ["cuda_efficient"]
    messages = [str(w.message) for w in caught if "attention kernel" in str(w.message)]
    assert len(messages) == 1 and "causal window" in messages[0] and "no windowed flash here" in messages[0]
    assert "uses chunks with a mask there" in messages[0]


def test_wide_global_heads_and_narrow_values_run_the_fused_kernels_on_cuda(monkeypatch):
    """Gemma 4's global layers (head_dim 512, above flash's 256): every part on the efficient kernel, forward and
    backward. DeepSeek-V3's latent attention (values of 12 dims under keys of 24): the values padded to the keys' head
    dim for the kernels, the output cropped back."""
    ids, rows = stock_batch([20, 14], [0, 0, 0, 1, 1, 1], [5, 4, 3, 5, 2, 1], 5, seed=0)
    with fake_cuda(monkeypatch) as chosen:
        packed = pack_rows(ids.to(CUDA), 5, rows, min_saved=0)
        tokens = packed.num_tokens
        _attention_backward(chosen, packed, packed.layout, torch.bfloat16, dim=512, kv_heads=1)
        chosen.clear()
        q, k = on_cuda(1, tokens, 4, 24, dtype=torch.bfloat16), on_cuda(1, tokens, 4, 24, dtype=torch.bfloat16)
        v = on_cuda(1, tokens, 4, 12, dtype=torch.bfloat16)
        out, _ = prefix_attention.prefix_attention(None, q, k, v, layouts.NO_MASK, scaling=0.2,
                                                   **{layouts.LAYOUT_KWARG: packed.layout})  # fmt: skip
        assert out.shape == (1, tokens, 4, 12) and out.dtype == torch.bfloat16
        # head_dim 24 in half precision: flash's variable-length call (each node reading its prompt's keys)
        assert [entry[0] for entry in chosen] == ["cuda_flash_varlen"]
    assert all(reason is None for reason in checks._status.values())  # no kernel fell back to the math path


@pytest.mark.parametrize("window", [None, 8])
def test_image_blocks_in_the_prompt_nodes_run_the_fused_kernels_on_cuda(monkeypatch, window):
    """Gemma's image tokens attend to each other both ways in the prompts' nodes: those nodes' attention under a
    per-query bias (image blocks, and the window where there is one) on the efficient kernel, forward and backward."""
    import numpy as np

    from rloo_efficient.core.layers.vision import token_blocks
    from rloo_efficient.core.tree.layout import tree_layout

    ids, rows = stock_batch([20, 14], [0, 0, 0, 1, 1, 1], [5, 4, 3, 5, 2, 1], 5, seed=0)
    token_types = torch.zeros_like(ids)
    token_types[:, 8:12] = 1  # a 4-token image in every prompt (the second prompt's starts 6 columns later)
    with fake_cuda(monkeypatch) as chosen:
        packed = pack_rows(ids.to(CUDA), 5, rows, min_saved=0)
        tree = packed.tree
        layout = tree_layout(tree, CUDA, image_nodes=np.flatnonzero(tree.depth == 0))[0]
        with unset_fake_temporarily():
            blocks = token_blocks(token_types, (1,), packed.source_index.cpu())
        layout = dataclasses.replace(layout, token_blocks=blocks.to(CUDA), blocks_on="all")
        assert len(layout.image_buckets) == 1
        _attention_backward(chosen, packed, layout, torch.bfloat16, window=window, sliding=window is not None)
        # The prompts' nodes under their image blocks' bias: the efficient kernel, a mask per query (not folded)
        kernels_run = [entry for entry in chosen if entry[0] != "expanded keys"]
        assert kernels_run[len(layout.buckets)] == ("cuda_efficient", 2)


# GPT-OSS's experts (grouped GEMMs) run in bf16 only
@pytest.mark.parametrize("arch, dtype", [(arch, dtype) for arch in (*ARCHITECTURES, "gemma3", "gpt_oss")
                                         for dtype in (torch.bfloat16, torch.float16)
                                         if not (arch == "gpt_oss" and dtype == torch.float16)])  # fmt: skip
@pytest.mark.parametrize("varlen", [True, False])
def test_held_prefixes_run_the_fused_kernels_on_cuda(monkeypatch, arch, dtype, varlen):
    """A group's prompt held by its first chunk's source forward, its second chunk's row reading it ([`hold_plan`]):
    the source forward and the chunk's forward through the model, the row's node and its held keys in one of flash's
    variable-length calls (with windows and sinks where the family has them), and the held keys' and values'
    gradients in their own layout; with flash's variable-length call off, the held parts on the fused kernels."""
    from rloo_efficient.core.forward.scope import HeldScope, chunk_tables
    from rloo_efficient.core.tree.holds import plan_holds

    ids, rows = stock_batch([20, 14], [0, 0, 0, 1, 1, 1], [5, 4, 3, 5, 2, 1], 5, seed=0)
    chunks = [np.array([0, 1]), np.array([2]), np.array([3, 4, 5])]  # the first group split over two chunks
    plan = plan_holds(chunk_tables(rows, chunks), full=False, min_saved=0)
    second = rows[2:3]  # (host tables, sliced outside the fake mode)
    if not varlen:
        monkeypatch.setattr(layouts, "VARLEN_DEVICES", ())
    with fake_cuda(monkeypatch) as chosen:
        model = fake_model(arch, dtype)
        scope = HeldScope(plan, training=False)
        ids = ids.to(CUDA)
        call = lambda **inputs: model(**inputs)  # noqa: E731
        assert scope.forward_source(plan.chunks[0].source, call, ids.shape[1] - 5, CUDA, recurrent=False) == 19
        assert set(scope.sources[0].tensors) == {(kind, layer) for kind in ("key", "value") for layer in (0, 1)}
        assert plan.chunks[1].source is None  # the second chunk reads the first's
        packed = scope.pack(1, ids[2:3], 5, second, min_saved=0)
        layout = packed.layout
        assert layout.held_parts and packed.num_tokens == 3  # the row's own inputs only: its prompt's last, 2 more
        chosen.clear()
        logits = model(**packed.model_inputs()).logits
        assert (logits.shape, logits.dtype) == ((1, packed.num_tokens, 64), dtype)
        # The row's node is a root: per layer one variable-length call reading the held keys, then its own; else
        # the node's call and the held part's (a window's part masks per query: the efficient kernel, heads expanded)
        if varlen:
            assert chosen == [("cuda_flash_varlen", 2)] * 2 and layout.held_nodes is not None
        fused = lambda: chosen and all(kernel in FUSED for kernel, _ in chosen if kernel != "expanded keys")  # noqa: E731
        assert fused()
        window = 8 if arch in WINDOWED else None
        sinks = torch.zeros(4, dtype=dtype).to(CUDA) if arch == "gpt_oss" else None
        _attention_backward(chosen, packed, layout, dtype, window=window, sinks=sinks, sliding=window is not None,
                            held=tuple(layout.held.attention(0)))  # fmt: skip
        assert fused()


class CaptureSafety(TorchDispatchMode):
    """
    Inside a fake CUDA region, records each operator a CUDA graph capture would refuse or replay wrongly: a read of a
    device value on the host (`item`, `nonzero`, ...: capture forbids the synchronization), and a host tensor handed to
    an operator producing CUDA tensors (a copy from the host, or a host value baked into the graph at capture).
    """

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        outputs = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        if name in HOST_SYNC_OPS:
            self.found.append(name)
        elif any(x.device.type == "cpu" for x in inputs) and any(x.device.type == "cuda" for x in outputs):
            self.found.append(f"{name} (a host tensor in)")
        return out


@pytest.mark.parametrize("once", [False, True])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_static_decoding_steps_stay_on_cuda_in_place(monkeypatch, arch, once):
    """Three steps of static decoding ([`core.generation.static_decode.StaticStep`]) from a fanned-out prefill on
    CUDA, bf16, the prompt fanned out or kept once per group (the rows' own keys in the buffers, through the fused
    kernels): every buffer the step reads and writes (cache, mask, positions, the input token, the write column)
    on the device, the same tensors each step, the cache sized once for the call; the step's logits float32; nothing
    in a step that a CUDA graph's capture would refuse or bake in (a host read, a host tensor)."""
    from rloo_efficient.core.generation.generate import fan_out, generation_position_ids
    from rloo_efficient.core.generation.static_decode import StaticStep

    prompts, order, width, steps = [[5] * 12, [6] * 9], [0, 0, 0, 1, 1, 1], 12, 3
    ids = torch.tensor([[0] * (width - len(prompts[g])) + prompts[g] for g in order])
    mask = torch.tensor([[0] * (width - len(prompts[g])) + [1] * len(prompts[g]) for g in order])
    first, inverse = unique_rows([prompts[g] for g in order])
    with fake_cuda(monkeypatch) as chosen:
        model = fake_model(arch, torch.bfloat16)
        ids, mask = ids.to(CUDA), mask.to(CUDA)
        prefilled = prefill_prompts(model, ids, mask, first, padded=True)
        if once:
            cache = PrefixCache(prefilled, inverse, [len(prompt) - 1 for prompt in prompts], width - 1)
        else:
            cache = fan_out(prefilled, inverse, CUDA)
        inputs = {"attention_mask": mask, "position_ids": generation_position_ids(mask), CACHE_KWARG: cache,
                  "logits_to_keep": 1}  # fmt: skip
        step = StaticStep(model, ids, inputs, width - 1 + steps)
        decoding = prefix_attention.decoding_with(cache) if once else contextlib.nullcontext()
        with decoding:
            logits = step()  # the first step sizes a kept-once cache's own buffers
            chosen.clear()
            step.advance(torch.randint(3, 64, (6,)).to(CUDA))
            # Fake tensors have no addresses: the same tensor objects, written in place (the CPU tests check addresses)
            before = step.buffers()
            assert len(before) == 3 + 2 * 2 + 1 and all(buffer.device == CUDA for buffer in before)
            if once:  # the rows' own positions (the prompt's last and each step's), the prompts once
                assert step.cache.layers[0].keys.shape == (6, 2, steps, 64) and step.mask.shape == (1, 1, 1, steps)
                assert step.cache.layers[0].prefix_keys.shape == (2, 2, width - 1, 64)
            else:
                assert step.cache.layers[0].keys.shape == (6, 2, width - 1 + steps, 64)
                assert step.mask.dtype == torch.bool
            for _ in range(steps - 1):
                with CaptureSafety() as unsafe:
                    logits = step()
                assert unsafe.found == []  # what a captured graph could not replay
                if once:  # per layer: the prompts (efficient, a bias for padding), the rows' own (the bias masking
                    # the positions not written yet: efficient, key heads expanded)
                    assert chosen == [("cuda_efficient", 1), ("cuda_efficient", 1)] * 2
                    chosen.clear()
                assert (logits.shape, logits.dtype, logits.device) == ((6, 64), torch.float32, CUDA)
                step.advance(torch.randint(3, 64, (6,)).to(CUDA))
                assert all(a is b for a, b in zip(step.buffers(), before, strict=True))


def test_an_embeddings_gradient_is_added_on_cuda_without_host_reads():
    """[`core.forward.embedding_rows.add_rows`] on CUDA: the embedding's gradient added on the rows its tokens touch,
    with shapes fixed by the token count: no host read, no host tensor handed in."""
    from rloo_efficient.core.forward.embedding_rows import add_rows

    with FakeTensorMode(allow_non_fake_inputs=True), CaptureSafety() as safety:
        grad, rows = torch.zeros(40, 8, device=CUDA), torch.randn(150, 8, device=CUDA)
        add_rows(grad, rows, torch.randint(12, (150,), device=CUDA), 3)
    assert grad.device == CUDA and safety.found == []


@pytest.mark.parametrize("fresh", [True, False])
def test_a_tied_weights_gradient_is_added_on_cuda_without_host_reads(fresh):
    """A tied weight's head and lookup gradients added in place on CUDA ([`embedding_rows.Tied`]): the touched rows
    kept and written with shapes fixed by the token count, on the first micro-batch (no `.grad` yet) and later ones."""
    from rloo_efficient.core.forward.embedding_rows import Tied

    with FakeTensorMode(allow_non_fake_inputs=True), CaptureSafety() as safety:
        weight = torch.zeros(40, 8, device=CUDA, requires_grad=True)
        weight.grad = None if fresh else torch.zeros(40, 8, device=CUDA)
        tied = Tied(torch.randint(12, (2, 75), device=CUDA), 3, weight)
        tied.hold()
        for start in range(0, 40, 16):
            tied.take(torch.randn(min(16, 40 - start), 8, device=CUDA), start)
        assert tied.add(torch.randn(150, 8, device=CUDA))
    assert weight.grad.device == CUDA and weight.grad.shape == (40, 8) and safety.found == []
