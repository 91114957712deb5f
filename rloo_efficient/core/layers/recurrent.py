"""
Recurrent layers over the prefix tree: Gated DeltaNet (and Kimi's, with a decay per channel), Mamba2 and gated short
convolutions in the packed forward.

Hybrid models interleave attention with layers that carry a state along the sequence: a causal depthwise convolution
over the last `K` inputs and, for Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid) and Mamba2 (Nemotron-H,
Granite 4-H, Falcon-H1), a recurrent state. On stock's padded rows each row runs them over [prompt, completion] from a
zero state. In the packed prefix tree ([`tree.layout`]) a layer runs level by level, from the roots down, each level
one batched call over its nodes (padded to the level's longest, gathered from the flat sequence):

- each node starts from its parent's final state (a gather: its backward sums the children's gradients into their
  parent's state), the roots from zero;
- its convolution reads its parent's tail as left context: the last `K - 1` inputs of the parent's path (zeros before
  a row's first token), which reach back past the parent where the parent is shorter than `K - 1`;
- a node's padding must not move its state: there the state is frozen (Gated DeltaNet: no write, no decay; Mamba2: no
  input, no decay), since padded steps would decay it (Mamba2's `dt` has a floor, so a zeroed input still decays).

Everything else in these layers (projections, gates, norms) is per token and runs once over all tokens. The kernels
are the layer's own module's (transformers' torch implementations, or the fused ones it imported when installed: they
take initial states and return final states). [`install`] routes a layer to its fork when the packed layout reaches
it in the call's keyword arguments, which transformers passes to these mixers; without one the layer is the model's
own. The number of kernel calls per layer is the tree's depth: nothing loops over nodes or rows.
"""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.accelerate import force_accelerate_hooks

from ..attention.held import capturing
from ..tree.layout import LAYOUT_KWARG
from ..tree.parts import Level, TreeLayout
from .recurrent_checks import trusted


@dataclass(frozen=True)
class Fork:
    """What a recurrent layer reads of a [`TreeLayout`]: its levels (each depth's nodes by length bucket), and where
    each token sits in them."""

    levels: tuple[tuple[Level, ...], ...]
    assemble: torch.Tensor  # (N,) each token's slot in the levels' blocks, flattened and concatenated
    # Nodes held by an earlier forward ([`tree.holds`]): what this forward reads of them ([`attention.held.HeldReads`]), and
    # per root bucket each root's held parent's row in their concatenated states (its last, zeros: none)
    held: object = None
    held_roots: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def of(layout: TreeLayout) -> "Fork":
        """The layout's fork, derived once per batch for every layer."""
        if layout.assemble is None:
            raise ValueError("rloo_efficient: this packed layout was built without the recurrent layers' levels.")
        if "fork" not in layout.memo:
            layout.memo["fork"] = Fork(layout.levels, layout.assemble, layout.held, layout.held_roots)
        return layout.memo["fork"]

    def _held(self, layer) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`layer`'s held final states and convolution tails (the slots' concatenated, then a zero row), or None."""
        if not self.held_roots:
            return None
        held = self.held.recurrent(layer)
        if held is None:
            raise RuntimeError(f"No recurrent state was held for {type(layer).__name__}: its layer did not run the "
                               "rloo_efficient fork in the source forward.")  # fmt: skip
        return held

    @property
    def blocks(self) -> list[Level]:
        """Every depth's buckets, in order."""
        return [run for level in self.levels for run in level]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Packed `(1, N, *rest)` -> per bucket of each depth, its nodes' blocks `(n, L, *rest)` (padding: a token of
        the node)."""
        flat = x[0]
        return [flat.index_select(0, run.blocks.gather.view(-1)).view(*run.blocks.shape, *flat.shape[1:])
                for run in self.blocks]  # fmt: skip

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of [`split`], the padding dropped: `(1, N, *rest)`."""
        flat = torch.cat([part.reshape(-1, *part.shape[2:]) for part in parts])
        return flat.index_select(0, self.assemble)[None]

    def frozen(self, parts: list[torch.Tensor], value: float = 0.0) -> list[torch.Tensor]:
        """Per-step values `(n, L, *rest)` of each bucket set to `value` at the padding."""
        out = []
        for run, x in zip(self.blocks, parts, strict=True):
            real = run.real.view(*run.real.shape, *([1] * (x.dim() - 2)))
            out.append(torch.where(real, x, torch.full((), value, dtype=x.dtype, device=x.device)))
        return out

    def _depths(self, parts: list) -> list[list]:
        """`parts` (one per bucket, in order) grouped by depth."""
        grouped, first = [], 0
        for level in self.levels:
            grouped.append(parts[first : first + len(level)])
            first += len(level)
        return grouped

    def conv(self, conv_fn, parts: list[torch.Tensor], kernel: int, layer=None) -> list[torch.Tensor]:
        """
        A causal depthwise convolution `conv_fn((batch, channels, length)) -> same` over each bucket's nodes
        `(n, L, C)`, each with its parent's tail as left context (zeros at the roots, or a held parent's tail).
        Returns the outputs, token-major. In a source forward ([`attention.held.capturing`]), every node's tail is held
        for `layer`.
        """
        outs, tails, every = [], None, []
        held = self._held(layer)
        for depth, (level, xs) in enumerate(zip(self.levels, self._depths(parts), strict=True)):
            depth_tails = []
            for index, (run, x) in enumerate(zip(level, xs, strict=True)):
                if depth == 0 and held is not None:  # a root's left context: its held parent's tail
                    left = held[1].index_select(0, self.held_roots[index]).to(x.dtype)
                elif tails is None:
                    left = x.new_zeros(x.shape[0], kernel - 1, x.shape[-1])
                else:
                    left = self.inherit(tails, run)
                full = torch.cat([left, x], dim=1)  # position i here is the node's input i - (K - 1)
                outs.append(conv_fn(full.transpose(1, 2))[:, :, kernel - 1 :].transpose(1, 2))
                depth_tails.append(self.tail(full, run, kernel))
            tails = torch.cat(depth_tails)  # this depth's nodes in order, for the depth below
            every.append(tails)
        capture = capturing()
        if capture is not None and layer is not None:
            capture.recurrent(layer, "tail", torch.cat(every))
        return outs

    @staticmethod
    def tail(full: torch.Tensor, level: Level, kernel: int) -> torch.Tensor:
        """`(n, K - 1, C)`: each node's last `K - 1` inputs along its path, from `[parent's tail | node]` `full`."""
        index = level.length[:, None] + torch.arange(kernel - 1, device=full.device)
        return full.gather(1, index[:, :, None].expand(-1, -1, full.shape[-1]))

    @staticmethod
    def inherit(values: torch.Tensor, level: Level) -> torch.Tensor:
        """Each node of `level` gets its parent's entry of `values` (the depth above's, its nodes in order): a gather,
        whose backward sums the children's gradients into their parent."""
        return values.index_select(0, level.parent)

    def scan(self, run, parts: list[tuple], layer=None) -> list[torch.Tensor]:
        """`run(*inputs, initial) -> (out, final)` over each bucket's `inputs`, each node from its parent's final state
        (None at the roots: zero; a held parent's final state where there is one). Returns each bucket's outputs. In a
        source forward ([`attention.held.capturing`]), every node's final state is held for `layer`."""
        outs, states, every = [], None, []
        held = self._held(layer)
        for depth, (level, inputs_of) in enumerate(zip(self.levels, self._depths(parts), strict=True)):
            finals = []
            for index, (bucket, inputs) in enumerate(zip(level, inputs_of, strict=True)):
                if depth == 0 and held is not None:
                    initial = held[0].index_select(0, self.held_roots[index])
                else:
                    initial = None if states is None else self.inherit(states, bucket)
                out, final = run(*inputs, initial)
                outs.append(out)
                finals.append(final)
            states = torch.cat(finals)
            every.append(states)
        capture = capturing()
        if capture is not None and layer is not None:
            capture.recurrent(layer, "state", torch.cat(every))
        return outs


def _kernels(layer, hidden_states: torch.Tensor, scan: str, scan_name: str):
    """The scan kernel named `scan` and the causal convolution that `layer`'s own module calls (fused where
    transformers found the packages), each checked at its first use with an initial state ([`layers.recurrent_checks`])."""
    module = sys.modules[type(layer).__module__]
    device, dtype = hidden_states.device, hidden_states.dtype
    return (trusted(scan_name, getattr(module, scan), device, dtype),
            trusted("causal convolution", module.causal_conv1d_fn, device, layer.conv1d.weight.dtype))  # fmt: skip


# -- Gated DeltaNet (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid) --------------------------------------------------
def _gdn_projections(layer, hidden_states):
    """`(B, T, D)` -> the pre-conv q|k|v `(B, T, C)`, the output gate z `(B, T, Hv, dv)`, b and a `(B, T, Hv)`."""
    batch, length, _ = hidden_states.shape
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: fused, head-interleaved projections
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(hidden_states),
                                                                        layer.in_proj_ba(hidden_states))  # fmt: skip
        mixed = torch.cat([x.reshape(batch, length, -1) for x in (query, key, value)], dim=-1)
        return mixed, z, b, a
    if hasattr(layer, "in_proj_qkv"):  # Qwen3.5, Qwen3.5-MoE
        mixed, gate = layer.in_proj_qkv(hidden_states), layer.in_proj_z(hidden_states)
        b, a = layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states)
    else:  # OLMo-hybrid
        mixed = torch.cat([layer.q_proj(hidden_states), layer.k_proj(hidden_states), layer.v_proj(hidden_states)], -1)
        gate, b, a = layer.g_proj(hidden_states), layer.b_proj(hidden_states), layer.a_proj(hidden_states)
    return mixed, gate.reshape(batch, length, -1, layer.head_v_dim), b, a


def gated_delta_net(layer, hidden_states: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """A Gated DeltaNet layer over the packed tree `(1, N, D)`: each node from its parent's final state (its padding
    neither writes (beta 0) nor decays (log-decay 0) the state), its convolution's left context its parent's tail."""
    fork = Fork.of(layout)
    chunk, causal_conv = _kernels(layer, hidden_states, "torch_chunk_gated_delta_rule", "gated delta rule")
    mixed, gate, b, a = _gdn_projections(layer, hidden_states)
    beta = b.sigmoid() * (2.0 if getattr(layer, "allow_neg_eigval", False) else 1.0)  # OLMo-hybrid: eigenvalues < 0
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)  # the log-decay, float32 as the layer's
    weight = layer.conv1d.weight.squeeze(1)

    def conv(x):
        return causal_conv(x, weight, layer.conv1d.bias, activation=layer.activation)

    def heads(x):  # (B, T, C) -> q, k (B, T, Hk, dk), v (B, T, Hv, dv)
        query, key, value = torch.split(x, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        return (query.unflatten(-1, (-1, layer.head_k_dim)), key.unflatten(-1, (-1, layer.head_k_dim)),
                value.unflatten(-1, (-1, layer.head_v_dim)))  # fmt: skip

    conv_out = fork.conv(conv, fork.split(mixed), layer.conv_kernel_size, layer)

    def run(x, g, beta, initial):
        return chunk(*heads(x), g=g, beta=beta, initial_state=initial, output_final_state=True,
                     use_qk_l2norm_in_kernel=True)  # fmt: skip

    outs = fork.scan(run, list(zip(conv_out, fork.frozen(fork.split(g)), fork.frozen(fork.split(beta)), strict=True)),
                     layer)  # fmt: skip
    core = fork.join(outs)  # (1, N, Hv, dv)
    norm = layer.norm if hasattr(layer, "norm") else layer.o_norm
    out_proj = layer.out_proj if hasattr(layer, "out_proj") else layer.o_proj
    core = norm(core.reshape(-1, layer.head_v_dim), gate.reshape(-1, layer.head_v_dim))
    return out_proj(core.reshape(*hidden_states.shape[:2], -1))


# -- Kimi Delta Attention (Kimi-Linear) -------------------------------------------------------------------------------
def kimi_delta_attention(layer, hidden_states: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """A Kimi Delta Attention layer over the packed tree `(1, N, D)`: Gated DeltaNet with a decay per channel, each
    node from its parent's final state (its padding neither writes (beta 0) nor decays (log-decay 0) the state), its
    convolution's left context its parent's tail."""
    fork = Fork.of(layout)
    chunk, causal_conv = _kernels(layer, hidden_states, "chunk_kimi_delta_attention", "kimi delta rule")
    mixed = torch.cat([layer.q_proj(hidden_states), layer.k_proj(hidden_states), layer.v_proj(hidden_states)], -1)
    g = layer.forget_gate(hidden_states)  # (1, N, H, dk) log-decay, float32 as the layer's
    beta = torch.sigmoid(layer.b_proj(hidden_states))
    weight = layer.conv1d.weight.squeeze(1)

    def conv(x):
        return causal_conv(x, weight, layer.conv1d.bias, activation=layer.activation)

    def run(x, g, beta, initial):
        query, key, value = (part.unflatten(-1, (-1, layer.head_dim)) for part in x.split([layer.qkv_dim] * 3, -1))
        return chunk(query, key, value, g=g, beta=beta, initial_state=initial, output_final_state=True,
                     use_qk_l2norm_in_kernel=True)  # fmt: skip

    conv_out = fork.conv(conv, fork.split(mixed), layer.conv_kernel_size, layer)
    outs = fork.scan(run, list(zip(conv_out, fork.frozen(fork.split(g)), fork.frozen(fork.split(beta)), strict=True)),
                     layer)  # fmt: skip
    core = fork.join(outs)  # (1, N, H, dk)
    gate = layer.g_b_proj(layer.g_a_proj(hidden_states)).unflatten(-1, (-1, layer.head_dim))
    return layer.o_proj(layer.o_norm(core, gate).reshape(*hidden_states.shape[:2], -1))


# -- Mamba2 (Nemotron-H, Granite 4-H, Falcon-H1) ----------------------------------------------------------------------
def mamba2(mixer, hidden_states: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """A Mamba2 mixer over the packed tree `(1, N, D)`, as its own torch path computes it (the fused training path,
    where installed, would skip the fork): each node from its parent's final state, `dt` zeroed at its padding after
    its floor (no input, no decay), its convolution's left context its parent's tail."""
    fork = Fork.of(layout)
    chunk_scan, causal_conv = _kernels(mixer, hidden_states, "mamba2_chunk_scan", "mamba2 scan")
    heads, head_dim, groups, state_size = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    if hasattr(mixer, "ssm_in_multiplier"):  # Falcon-H1's multipliers
        hidden_states = hidden_states * mixer.ssm_in_multiplier
    projected = mixer.in_proj(hidden_states)
    if hasattr(mixer, "mup_vector"):
        projected = projected * mixer.mup_vector
    gate, xbc, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, heads], dim=-1)
    weight = mixer.conv1d.weight.squeeze(1)

    def conv(x):
        return causal_conv(x, weight, mixer.conv1d.bias, activation=mixer.activation)

    # dt as the scan makes it (softplus, then clamped to the family's limits), before the nodes' padding is frozen
    dt = torch.clamp(F.softplus(dt + mixer.dt_bias.to(dt.dtype)), *mixer.time_step_limit)
    A = -torch.exp(mixer.A_log.float())

    def run(xbc, dt, initial):
        x, B, C = torch.split(xbc, [mixer.intermediate_size, groups * state_size, groups * state_size], dim=-1)
        y, final = chunk_scan(
            x.unflatten(-1, (heads, head_dim)), dt, A, B.unflatten(-1, (groups, state_size)),
            C.unflatten(-1, (groups, state_size)), chunk_size=mixer.chunk_size, D=mixer.D, z=None, dt_bias=None,
            dt_softplus=False, dt_limit=(0.0, float("inf")), initial_states=initial, return_final_states=True,
        )  # fmt: skip
        return y.flatten(2), final

    conv_out = fork.conv(conv, fork.split(xbc), mixer.conv_kernel_size, mixer)
    y = fork.join(fork.scan(run, list(zip(conv_out, fork.frozen(fork.split(dt)), strict=True)), mixer))
    if getattr(mixer, "mamba_rms_norm", True):
        y = mixer.norm(y, gate)
    else:  # Falcon-H1 without its norm
        y = y * F.silu(gate)
    return mixer.out_proj(y.to(hidden_states.dtype))


# -- gated short convolutions (LFM2) -----------------------------------------------------------------------------------
def short_conv(layer, hidden_states: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """LFM2's gated short convolution `out_proj(C * conv(B * x))` over the packed tree: each node's convolution reads
    its parent's tail as left context."""
    fork = Fork.of(layout)
    B, C, x = layer.in_proj(hidden_states).chunk(3, dim=-1)
    weight = layer.conv.weight

    def conv(u):
        return F.conv1d(F.pad(u, (weight.shape[-1] - 1, 0)), weight, layer.conv.bias, groups=u.shape[1])

    return layer.out_proj(C * fork.join(fork.conv(conv, fork.split(B * x), weight.shape[-1], layer)))


# -- installing the forks ----------------------------------------------------------------------------------------------
# Each recurrent layer class (by name: each family's modeling module defines its own copy), its forked forward, and
# the child whose weights it reads directly (the convolution), as the layer's own forward names it to
# `force_accelerate_hooks`
FORKS = {
    "Qwen3NextGatedDeltaNet": (gated_delta_net, "conv1d"),
    "Qwen3_5GatedDeltaNet": (gated_delta_net, "conv1d"),
    "Qwen3_5MoeGatedDeltaNet": (gated_delta_net, "conv1d"),
    "OlmoHybridGatedDeltaNet": (gated_delta_net, "conv1d"),
    "KimiLinearDeltaAttention": (kimi_delta_attention, "conv1d"),
    "NemotronHMamba2Mixer": (mamba2, "conv1d"),
    "GraniteMoeHybridMambaLayer": (mamba2, "conv1d"),
    "FalconH1Mixer": (mamba2, "conv1d"),
    "Lfm2ShortConv": (short_conv, "conv"),
}


def recurrent_layers(model: nn.Module):
    """`(module, fork)` for every recurrent layer of `model` this module forks."""
    for module in model.modules():
        fork, _ = FORKS.get(type(module).__name__, (None, None))
        if fork is not None:
            yield module, fork


def held_state_values(model: nn.Module) -> tuple[int, int]:
    """
    What a held node keeps of `model`'s forked recurrent layers, summed over them, in values per node: `(wide,
    narrow)`, those charged as float32 and those in the compute dtype. Its final scan states are float32 (Gated
    DeltaNet's and Kimi's; Mamba2's torch scan under autocast hands its state over in bf16, charged as float32: at
    most twice over), its convolution tails (its last `K - 1` inputs) in the compute dtype (Falcon-H1's float32
    multiplier makes them float32 beside float32 weights). Read from the modules' attributes, not their weights (a
    sharded model's are placeholders).
    """
    wide = narrow = 0
    for module, fork in _known_recurrent_layers(model):
        conv = getattr(module, FORKS[type(module).__name__][1])
        tail = conv.in_channels * (conv.kernel_size[0] - 1)
        multiplier = getattr(module, "mup_vector", None)
        if multiplier is not None and multiplier.dtype == torch.float32:
            wide += tail
        else:
            narrow += tail
        if fork is mamba2:  # (heads, head dim, state size)
            wide += module.num_heads * module.head_dim * module.ssm_state_size
        elif fork is gated_delta_net:  # (value heads, key dim, value dim)
            wide += module.num_v_heads * module.head_k_dim * module.head_v_dim
        elif fork is kimi_delta_attention:  # (heads, head dim, head dim)
            wide += module.num_heads * module.head_dim * module.head_dim
        elif fork is not short_conv:  # (a convolution alone: no state)
            raise NotImplementedError(f"rloo_efficient: the held state of {type(module).__name__} is not counted.")
    return wide, narrow


def _known_recurrent_layers(model: nn.Module) -> list:
    """[`recurrent_layers`] of `model`, found once per model (every packed forward asks, and routes them again)."""
    known = model.__dict__.get("_rloo_recurrent_layers")
    if known is None:
        known = model.__dict__["_rloo_recurrent_layers"] = list(recurrent_layers(model))
    return known


def has_recurrent_layers(model: nn.Module) -> bool:
    """Whether `model` has a layer this module forks (a packed layout then needs the tree's levels)."""
    return bool(_known_recurrent_layers(model))


def install(model: nn.Module) -> int:
    """Routes each recurrent layer of `model` to its fork when the packed layout reaches it (idempotent: a layer still
    routed is left as it is, one whose forward was reset is routed again). Returns how many there are.

    transformers 5.25 kernelizes a model loaded by `from_pretrained` at every change of `train()`/`eval()` mode, and
    kernelizing a layer that has no kernel for its device removes any forward set on the instance: ours too. Each of
    our forwards installs first, so that a layer reset since is routed again before the forward reaches it."""
    layers = _known_recurrent_layers(model)
    for module, fork in layers:
        # Under an accelerate hook (`device_map`, offloading), its forward moves the inputs (and loads offloaded
        # weights) before calling `_old_forward`: route there, so that the fork runs after the hook's work too. The
        # fork reads the convolution's weights without calling it: fire that child's hook around the fork, as the
        # layer's own forward does (an offloaded child's weights are on the meta device until then)
        # (a kernelization that removed the hook's wrapper leaves `_old_forward` unused: route `forward` then)
        hooked = hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") and "forward" in vars(module)
        target = "_old_forward" if hooked else "forward"
        if getattr(vars(module).get(target), "_rloo_routed", False):
            continue
        own_forward = getattr(module, target)
        # Outside a compiled graph, as our attention function ([`attention.backend`]): the fork reads host structure
        fork = torch._dynamo.disable(force_accelerate_hooks(FORKS[type(module).__name__][1])(fork), recursive=True)

        def forward(*args, _own=own_forward, _module=module, _fork=fork, **kwargs):
            layout = kwargs.pop(LAYOUT_KWARG, None)
            if layout is None:
                return _own(*args, **kwargs)
            return _fork(_module, args[0] if args else kwargs["hidden_states"], layout)

        forward._rloo_routed = True
        setattr(module, target, forward)
    return len(layers)
