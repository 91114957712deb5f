"""
Recurrent layers forked after the prompt (`rloo_efficient.core.recurrent`): one layer of each kind, taken from its
family's own tiny model, on the packed sequence against the same layer run on each stock row on its own ([prompt,
completion] from a zero state), forward and gradients, over ragged layouts (groups of 1-4 rows, not always adjacent;
prompts of 1 token, shorter than the convolution, longer than a scan chunk; completions of 1-7 tokens).
"""

import pytest
import torch

from rloo_efficient.core import recurrent
from rloo_efficient.core.packing import pack_groups, row_groups
from rloo_efficient.tiny_models import model_config, model_from_config
from rloo_efficient.workload import WorkloadConfig, build_tokenizer

from .conftest import tiny_workload


# Gated DeltaNet (three projection layouts), Mamba2 (three families' mixers), a gated short convolution
KINDS = ("qwen3_next", "qwen3_5", "olmo_hybrid", "nemotron_h", "granitemoehybrid", "falcon_h1", "lfm2")
# (prompt length per group, group of each row, completion length per row): one-token prompts and prompts shorter than
# the 4-tap convolution; a prompt past Mamba2's 16-token chunks; rows of a group not adjacent; a lone row
LAYOUTS = {
    "short_prompts": ([1, 2, 3], [0, 1, 1, 2, 2, 2], [3, 1, 2, 4, 1, 2]),
    "ragged": ([19, 6, 11], [0, 1, 0, 2, 1, 0], [2, 5, 7, 1, 3, 4]),
    "one_token_prompts": ([1, 1], [0, 1, 0], [2, 3, 4]),
    "lone_row": ([9], [0], [6]),
}


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


def _packed(layout_name, dtype, dim, seed=0):
    """The packed layout of a stock batch, stock's per-row hidden states (B rows of [prompt, completion], ragged), and
    the packed hidden states gathered from them."""
    prompt_lengths, group_of_row, completion_lengths = LAYOUTS[layout_name]
    generator = torch.Generator().manual_seed(seed)
    width_p, width_c = max(prompt_lengths), max(completion_lengths)
    prompts = [torch.randn(p, dim, generator=generator, dtype=dtype) for p in prompt_lengths]
    rows = [torch.cat([prompts[g], torch.randn(n, dim, generator=generator, dtype=dtype)])
            for g, n in zip(group_of_row, completion_lengths, strict=True)]  # fmt: skip
    # A stock batch of flat indices: packing gathers them, so the packed sequence says where each token comes from
    width = width_p + width_c
    index = torch.arange(len(rows) * width).view(len(rows), width)
    structure = row_groups([[g + 1] * p for g, p in ((g, prompt_lengths[g]) for g in group_of_row)], completion_lengths)
    packed = pack_groups(index, width_c, structure, dtype)
    flat = torch.zeros(len(rows) * width, dim, dtype=dtype)
    for r, row in enumerate(rows):  # left-padded prompt, then the completion (the test's reference, not the code's)
        p = prompt_lengths[group_of_row[r]]
        flat[r * width + width_p - p : r * width + width_p + completion_lengths[r]] = row
    fork = recurrent.Fork.of(packed.layout)
    real = torch.cat([fork.real.reshape(-1), (packed.shift_labels[0, fork.prompt_tokens :] != -100)])
    return packed, rows, flat[packed.input_ids[0]][None], real, width, width_p, prompt_lengths, group_of_row


def errors(module, fork_fn, layout_name) -> dict[str, float]:
    """The fork's output, input gradient and each parameter's gradient against the layer run on each stock row, each
    as its largest difference over the reference's largest value."""
    dtype = next(module.parameters()).dtype
    dim = next(p for n, p in module.named_parameters() if "proj" in n and p.dim() == 2).shape[1]
    packed, rows, hidden, real, width, width_p, prompt_lengths, group_of_row = _packed(layout_name, dtype, dim)
    hidden.requires_grad_(True)
    out = fork_fn(module, hidden, packed.layout)
    cotangent = torch.randn_like(out) * real[None, :, None]  # gradients from real positions only
    module.zero_grad()
    (out * cotangent).sum().backward()
    ours = {name: parameter.grad.clone() for name, parameter in module.named_parameters() if parameter.grad is not None}

    # Where each real packed token comes from: (stock row, position in that row's [prompt, completion])
    source = packed.input_ids[0]
    row_of = source // width
    position = source % width - (width_p - torch.tensor(prompt_lengths)[torch.tensor(group_of_row)][row_of])
    body = torch.arange(source.numel()) < packed.layout.prompt_tokens
    # The reference: the layer on each stock row alone, each real token's cotangent at its own (row, position)
    module.zero_grad()
    expected, input_grad = torch.zeros_like(out[0]), torch.zeros_like(hidden[0])
    for r, row in enumerate(rows):
        x = row[None].clone().requires_grad_(True)
        y = module(x)[0]
        mine = real & (row_of == r)
        expected[mine] = y[position[mine]].detach()
        weights = torch.zeros_like(y)
        weights[position[mine]] = cotangent[0, mine]
        (y * weights).sum().backward()
        input_grad[mine & ~body] = x.grad[0, position[mine & ~body]]
        # A body token is every row of its group's prompt token: its gradient sums over the group's rows
        group_body = real & body & (torch.tensor(group_of_row)[row_of] == group_of_row[r])
        input_grad[group_body] += x.grad[0, position[group_body]]
    found = {"output": scaled_error(out[0][real], expected[real]),
             "input gradient": scaled_error(hidden.grad[0][real], input_grad[real])}  # fmt: skip
    for name, parameter in module.named_parameters():
        if parameter.grad is not None:
            found[name] = scaled_error(ours[name], parameter.grad)
    return found


def scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).detach().abs().max() / expected.detach().abs().max().clamp(min=1e-30))


def _tolerance(layer) -> float:
    return 1e-10 if next(layer[0].parameters()).dtype == torch.float64 else 1e-4


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_a_forked_layer_is_the_layer_on_each_row(layer, layout_name):
    # Relative to each tensor's largest value: the float32 kernels (Gated DeltaNet's and Mamba2's compute in float32
    # whatever the layer's dtype) sum a parameter's gradient over the tokens in other orders (1e-5 of its scale seen);
    # the mutations below are off by 4e-3 to 10
    tolerance = _tolerance(layer)
    found = errors(*layer, layout_name)
    assert max(found.values()) <= tolerance, {name: f"{error:.1e}" for name, error in found.items() if error > tolerance}


MUTATIONS = {
    "state_not_forked": ("initial", lambda own: lambda self, state: torch.zeros_like(own(self, state))),
    "conv_tail_off_by_one": ("tail", lambda own: lambda self, body_x, kernel: own(
        self, torch.nn.functional.pad(body_x, (0, 0, 1, 0))[:, :-1], kernel)),
    "padding_moves_the_state": ("frozen", lambda own: lambda self, x, value=0.0: x),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutations_fail(layer, monkeypatch, mutation):
    """Each of these mistakes in the fork is caught by the comparison above (a short convolution has no state)."""
    name, mutate = MUTATIONS[mutation]
    if mutation != "conv_tail_off_by_one" and layer[1] is recurrent.short_conv:
        pytest.skip("a short convolution has no recurrent state")
    monkeypatch.setattr(recurrent.Fork, name, mutate(getattr(recurrent.Fork, name)))
    # Far outside the equivalence tolerance (at least 4e-3 of the largest value seen, against 1e-4 in float32)
    assert max(errors(*layer, "ragged").values()) > 10 * _tolerance(layer)


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

    from rloo_efficient.core import recurrent_checks

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

    from rloo_efficient.core import recurrent_checks

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

    from rloo_efficient.core import recurrent_checks

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

    from rloo_efficient.core.prefix_attention import LAYOUT_KWARG
    from rloo_efficient.workload import build_model_dir

    cfg = tiny_workload(model_cache, arch=arch, model_dtype="float64" if arch == "lfm2" else "float32",
                        num_hidden_layers=3 if arch == "nemotron_h" else 2)  # fmt: skip
    path = build_model_dir(cfg)
    plain = AutoModelForCausalLM.from_pretrained(path)
    name, module = next((n, m) for n, m in plain.named_modules() if type(m).__name__ in recurrent.FORKS)
    fork = recurrent.FORKS[type(module).__name__][0]
    dim = plain.config.get_text_config().hidden_size
    packed, *_ = _packed("ragged", plain.dtype, dim)
    hidden = torch.randn(1, packed.input_ids.shape[1], dim, dtype=plain.dtype)
    expected = fork(module, hidden, packed.layout)

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
    torch.testing.assert_close(hooked(hidden, **{LAYOUT_KWARG: packed.layout}), expected, rtol=0, atol=0)
