"""
Recurrent layers over the prefix tree (`rloo_efficient.core.layers.recurrent`): one layer of each kind, taken from its
family's own tiny model, on the packed tree against the same layer run on each stock row on its own (from a zero
state), forward and gradients, over ragged trees: depth 1 to 4; one-token nodes and nodes shorter than the 4-tap
convolution (whose left context then reaches past the parent); a node longer than a scan chunk; rows that end inside
another's tokens; completions of very different lengths.
"""

import pytest
import torch

from rloo_efficient.core.layers import recurrent
from rloo_efficient.core.tree.layout import tree_layout
from rloo_efficient.core.tree.radix import build_tree
from rloo_efficient.demo.tiny_models import model_config, model_from_config
from rloo_efficient.demo.workload import build_tokenizer

from .conftest import tiny_workload
from .trees import random_rows


# Gated DeltaNet (three projection layouts), Kimi Delta Attention, Mamba2 (three families' mixers), a gated short
# convolution
KINDS = ("qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear", "nemotron_h", "granitemoehybrid", "falcon_h1", "lfm2")
# Rows of a random tree: (seed, longest run); long runs pass Gated DeltaNet's 64-token chunks (Mamba2's are 16)
TREES = {"short_runs": (25, 3), "ragged": (16, 9), "deep": (13, 6), "long_runs": (47, 70)}


@pytest.fixture(scope="module", params=KINDS)
def layer(request, model_cache):
    """The family's first recurrent layer, its parameters perturbed (norm weights, decays and biases off their init)."""
    cfg = tiny_workload(model_cache, arch=request.param, model_dtype="float64" if request.param == "lfm2" else "float32",
                        num_hidden_layers=3 if request.param == "nemotron_h" else 2)  # fmt: skip
    torch.manual_seed(0)
    model = model_from_config(cfg, model_config(cfg, build_tokenizer(arch=cfg.arch)), getattr(torch, cfg.model_dtype))
    module, fork = next(recurrent.recurrent_layers(model))
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return module, fork


def packed_tree(name: str):
    """A random tree's packed layout (every shared run its node), and the tree."""
    seed, longest = TREES[name]
    tree = build_tree(random_rows(seed, max_run=longest), min_saved=0)
    assert tree.depth.max() >= 1  # something is shared
    return tree_layout(tree, torch.device("cpu"))[0], tree


def errors(module, fork_fn, tree_name) -> dict[str, float]:
    """The fork's output, input gradient and each parameter's gradient against the layer run on each stock row, each
    as its largest difference over the reference's largest value. Each stock row's inputs are read from the packed
    ones, so that a token the tree holds once is one input of every row through it."""
    dtype = next(module.parameters()).dtype
    dim = next(p for n, p in module.named_parameters() if "proj" in n and p.dim() == 2).shape[1]
    layout, tree = packed_tree(tree_name)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tree.num_tokens, dim, generator=generator, dtype=dtype).requires_grad_(True)
    cotangent = torch.randn(1, tree.num_tokens, dim, generator=generator, dtype=dtype)
    out = fork_fn(module, hidden, layout)
    module.zero_grad()
    (out * cotangent).sum().backward()
    ours = {name: parameter.grad.clone() for name, parameter in module.named_parameters() if parameter.grad is not None}
    ours_input = hidden.grad.clone()

    # The reference: the layer on each row alone; a token the tree holds once is weighted by 1 / its rows, so that the
    # rows through it add up to its cotangent once
    module.zero_grad()
    hidden.grad = None
    expected = torch.zeros_like(out[0])
    share = torch.from_numpy(tree.token_weight).to(dtype)[:, None]
    for inputs in tree.row_inputs:
        index = torch.from_numpy(inputs)
        y = module(hidden[:, index])[0]
        expected[index] = y.detach()
        ((y * cotangent[0, index]) / share[index]).sum().backward()
    found = {"output": scaled_error(out[0], expected), "input gradient": scaled_error(ours_input, hidden.grad)}
    for name, parameter in module.named_parameters():
        if parameter.grad is not None:
            found[name] = scaled_error(ours[name], parameter.grad)
    return found


def scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).detach().abs().max() / expected.detach().abs().max().clamp(min=1e-30))


def _tolerance(layer) -> float:
    return 1e-10 if next(layer[0].parameters()).dtype == torch.float64 else 1e-4


def _allowed(layer, name: str) -> float:
    return _tolerance(layer) * (10 if name in DECAY else 1)


# The decay's parameters: each token's gradient reaches them through the chunked scan's triangular solve, whose float32
# rounding depends on where the chunks start (a node's own start, not its row's): Qwen3-Next measured 6e-4 of their
# largest value over 3 levels; with its scan patched to float64, 3e-8 (the remaining float32: the log-decay's own)
DECAY = ("A_log", "dt_bias")


@pytest.mark.parametrize("tree_name", list(TREES))
def test_a_forked_layer_is_the_layer_on_each_row(layer, tree_name):
    # Relative to each tensor's largest value: the float32 kernels (Gated DeltaNet's and Mamba2's compute in float32
    # whatever the layer's dtype) sum a parameter's gradient over the tokens in other orders (1e-5 of its scale seen);
    # the mutations below are off by 4e-3 to 10
    found = errors(*layer, tree_name)
    assert all(found[name] <= _allowed(layer, name) for name in found), {
        name: f"{error:.1e}" for name, error in found.items() if error > _allowed(layer, name)}  # fmt: skip


@pytest.mark.parametrize("autocast", [False, True])
def test_a_held_nodes_states_are_what_the_hold_budget_counts(layer, monkeypatch, autocast):
    """What a source forward holds for every node of a recurrent layer (its final scan state and its convolution's
    tail) is what the hold budget charges a held node ([`recurrent.held_state_values`], read from the module's
    attributes), in the layer's dtype and under bf16 autocast (the compute dtype 2 bytes) alike; Mamba2's torch scan
    hands its state over in bf16 there, charged as float32."""
    from rloo_efficient.core.tree.hold_budget import held_node_bytes

    module, fork_fn = layer
    held = {}

    class Recorder:
        def recurrent(self, layer, kind, values):
            held[kind] = values

    monkeypatch.setattr(recurrent, "capturing", Recorder)
    layout, tree = packed_tree("ragged")
    dim = next(p for n, p in module.named_parameters() if "proj" in n and p.dim() == 2).shape[1]
    dtype = next(module.parameters()).dtype
    if autocast and dtype != torch.float32:
        pytest.skip("autocast casts float32 weights")
    hidden = torch.randn(1, tree.num_tokens, dim, dtype=dtype)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fork_fn(module, hidden, layout)
    nodes = len(tree.start)
    assert all(len(values) == nodes for values in held.values())  # every node's
    assert ("state" in held) == (fork_fn is not recurrent.short_conv)
    wide, narrow = recurrent.held_state_values(module)
    states = held["state"][0].numel() if "state" in held else 0
    # The tails exactly (Falcon-H1's float32 ones under autocast as such), once the states' values are taken out
    tails = held["tail"][0].numel() * held["tail"].element_size()
    assert tails == held_node_bytes(wide - states, narrow, 2 if autocast else dtype.itemsize, training=False)
    if states:
        bf16 = autocast and fork_fn is recurrent.mamba2
        assert held["state"].dtype == (torch.bfloat16 if bf16 else torch.float32)


MUTATIONS = {
    "state_from_the_wrong_parent": ("inherit", lambda own: staticmethod(
        lambda values, level: own(values, type(level)(level.blocks, level.length, level.parent.roll(1), level.real)))),
    "conv_tail_off_by_one": ("tail", lambda own: staticmethod(
        lambda full, level, kernel: own(torch.nn.functional.pad(full, (0, 0, 1, 0))[:, :-1], level, kernel))),
    "padding_moves_the_state": ("frozen", lambda own: lambda self, parts, value=0.0: parts),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutations_fail(layer, monkeypatch, mutation):
    """Each of these mistakes in the fork is caught by the comparison above (a short convolution has no state)."""
    name, mutate = MUTATIONS[mutation]
    if mutation == "padding_moves_the_state" and layer[1] is recurrent.short_conv:
        pytest.skip("a short convolution has no recurrent state")
    monkeypatch.setattr(recurrent.Fork, name, mutate(recurrent.Fork.__dict__[name].__func__
                                                     if isinstance(recurrent.Fork.__dict__[name], staticmethod)
                                                     else recurrent.Fork.__dict__[name]))  # fmt: skip
    # Far outside the equivalence tolerance somewhere (at least 4e-3 of the largest value seen, against 1e-4 in
    # float32; the decay's parameters 2e-2, against 1e-3)
    found = errors(*layer, "ragged")
    assert any(error > 10 * _allowed(layer, name) for name, error in found.items()), found


# -- the kernels' first-use check --------------------------------------------------------------------------------------
KERNELS = {  # the check's name -> a model module's kernel (transformers' wrapper around a fused kernel or its reference)
    "gated delta rule": ("qwen3_next", "torch_chunk_gated_delta_rule"),
    "mamba2 scan": ("nemotron_h", "mamba2_chunk_scan"),
    "causal convolution": ("nemotron_h", "causal_conv1d_fn"),
}


def _kernel(name):
    import importlib

    family, function = KERNELS[name]
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), function)


def _state_detached(reference):
    """A 'fused kernel' that forgets the initial state's gradient (what an unchecked kernel could do)."""

    def kernel(*args, **kwargs):
        for key in ("initial_state", "initial_states"):
            if kwargs.get(key) is not None:
                kwargs[key] = kwargs[key].detach()
        return reference(*args, **kwargs)

    return kernel


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_check_passes_the_reference_and_refuses_a_wrong_one(name, dtype):
    import inspect

    from rloo_efficient.core.layers import recurrent_checks

    wrapper = _kernel(name)
    reference = inspect.unwrap(wrapper)
    assert recurrent_checks.check(name, wrapper, reference, torch.device("cpu"), dtype) is None
    shifted = lambda *args, **kwargs: tuple(  # noqa: E731 (an output off by 10%)
        o * 1.1 if isinstance(o, torch.Tensor) else o for o in (lambda r: r if isinstance(r, tuple) else (r,))(
            reference(*args, **kwargs)))  # fmt: skip
    assert "off by" in recurrent_checks.check(name, shifted, reference, torch.device("cpu"), dtype)

    def raising(*args, **kwargs):
        raise RuntimeError("no such kernel here")

    assert "raised RuntimeError" in recurrent_checks.check(name, raising, reference, torch.device("cpu"), dtype)
    if name != "causal convolution":  # a convolution takes no state
        reason = recurrent_checks.check(name, _state_detached(reference), reference, torch.device("cpu"), dtype)
        assert reason is not None and "initial_state" in reason


def test_a_kernel_that_fails_its_check_is_replaced_by_its_reference_with_one_warning(monkeypatch):
    import functools
    import inspect
    import warnings

    from rloo_efficient.core.layers import recurrent_checks

    reference = inspect.unwrap(_kernel("gated delta rule"))
    fused = functools.wraps(reference)(_state_detached(reference))  # unwraps to the reference, as transformers' do
    monkeypatch.setattr(recurrent_checks, "_trusted", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            chosen = recurrent_checks.trusted("gated delta rule", fused, torch.device("cpu"), torch.float32)
    assert chosen is reference
    messages = [str(w.message) for w in caught if "kernel" in str(w.message)]
    assert len(messages) == 1 and "initial_state" in messages[0] and "torch reference runs there instead" in messages[0]


def test_the_check_runs_inside_a_no_grad_pass(monkeypatch):
    """A kernel's first use may be a scoring pass under no_grad or inference_mode: its check still runs its backward
    (it would otherwise blame the kernel and warn)."""
    import functools
    import inspect
    import warnings

    from rloo_efficient.core.layers import recurrent_checks

    reference = inspect.unwrap(_kernel("mamba2 scan"))
    wrapped = functools.wraps(reference)(lambda *args, **kwargs: reference(*args, **kwargs))
    monkeypatch.setattr(recurrent_checks, "_trusted", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.inference_mode():
            assert recurrent_checks.trusted("mamba2 scan", wrapped, torch.device("cpu"), torch.float32) is wrapped


@pytest.mark.parametrize("arch, placement", [("lfm2", "disk"), ("qwen3_5", "disk"), ("nemotron_h", "disk"),
                                             ("lfm2", "hooks_only")])  # fmt: skip
def test_a_layer_dispatched_by_accelerate_is_forked_with_its_weights(model_cache, tmp_path, arch, placement):
    """
    A model loaded with a `device_map` carries accelerate's hooks: its recurrent layer's forward moves the inputs and
    loads the layer's own offloaded weights before the layer runs, and the convolution child, whose weights the fork
    reads without calling it, has a hook of its own. Loaded as a user loads it (`from_pretrained` with the layer's
    block offloaded to disk, or every module on the CPU with hooks forced), the fork computes what it computes on the
    plain model.
    """
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    from rloo_efficient.core.tree.layout import LAYOUT_KWARG
    from rloo_efficient.demo.workload import build_model_dir

    cfg = tiny_workload(model_cache, arch=arch, model_dtype="float64" if arch == "lfm2" else "float32",
                        num_hidden_layers=3 if arch == "nemotron_h" else 2)  # fmt: skip
    path = build_model_dir(cfg)
    plain = AutoModelForCausalLM.from_pretrained(path)
    name, module = next((n, m) for n, m in plain.named_modules() if type(m).__name__ in recurrent.FORKS)
    fork = recurrent.FORKS[type(module).__name__][0]
    dim = plain.config.get_text_config().hidden_size
    layout, tree = packed_tree("ragged")
    hidden = torch.randn(1, tree.num_tokens, dim, dtype=plain.dtype)
    expected = fork(module, hidden, layout)

    block = ".".join(name.split(".")[:3])  # model.layers.<i>
    device_map = {f"model.{child}": "cpu" for child, _ in plain.model.named_children() if child != "layers"}
    device_map |= {f"model.layers.{i}": "cpu" for i in range(len(plain.model.layers))} | {"lm_head": "cpu"}
    if placement == "disk":
        model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map | {block: "disk"},
                                                     offload_folder=tmp_path / "offload")  # fmt: skip
    else:
        model = dispatch_model(AutoModelForCausalLM.from_pretrained(path), device_map, force_hooks=True)
    hooked = model.get_submodule(name)
    conv = getattr(hooked, "conv1d", None) or hooked.conv
    assert hasattr(hooked, "_hf_hook") and hasattr(conv, "_hf_hook")
    assert conv.weight.device.type == ("meta" if placement == "disk" else "cpu")
    assert recurrent.install(model) == recurrent.install(model) > 0  # idempotent under the hooks too
    torch.testing.assert_close(hooked(hidden, **{LAYOUT_KWARG: layout}), expected, rtol=0, atol=0)
