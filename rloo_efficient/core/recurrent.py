"""
Recurrent layers forked after the prompt: Gated DeltaNet, Mamba2 and gated short convolutions in the packed forward.

Hybrid models interleave attention with layers that carry a state along the sequence: a causal depthwise convolution
over the last `K` inputs and, for Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid) and Mamba2 (Nemotron-H,
Granite 4-H, Falcon-H1), a recurrent state. On stock's padded rows each row runs them over [prompt, completion] from a
zero state. In the packed sequence ([`packing`]: `G` prompt bodies of `Pm` tokens, right-padded, then `S` rows of `Cm`
tokens, each opened by its prompt's last token) a layer runs in two batched steps:

1. the prompt bodies, from a zero state, give each group's state after its body and each body's conv tail (its last
   `K - 1` conv inputs, zeros before its first token). A body's right padding must not move its state: there the
   state is frozen (Gated DeltaNet: no write, no decay; Mamba2: no input, no decay), since padded steps would decay it
   (Mamba2's `dt` has a floor, so a zeroed input still decays);
2. the rows start from their group's state (one gather: its backward sums the `k` rows' gradients into their group's
   state), their convolution reading the group's tail as left context.

Everything else in these layers (projections, gates, norms) is per token and runs once over all tokens. The kernels
are the layer's own module's (transformers' torch implementations, or the fused ones it imported when installed: they
take initial states and return final states). [`install`] routes a layer to its fork when the packed layout reaches
it in the call's keyword arguments, which transformers passes to these mixers; without one the layer is the model's
own. Nothing loops over groups or rows.
"""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.accelerate import force_accelerate_hooks

from .prefix_attention import LAYOUT_KWARG, PackedLayout
from .recurrent_checks import trusted


@dataclass(frozen=True)
class Fork:
    """What a recurrent layer needs of a [`PackedLayout`]: where its bodies end, and each row's group."""

    groups: int  # G
    prompt_length: int  # Pm
    rows: int  # S
    row_length: int  # Cm
    real: torch.Tensor  # (G, Pm) bool: the bodies' real tokens
    body_lengths: torch.Tensor  # (G,)
    row_groups: torch.Tensor  # (S,) each row's group

    @property
    def prompt_tokens(self) -> int:
        return self.groups * self.prompt_length

    @staticmethod
    def of(layout: PackedLayout) -> "Fork":
        """The layout's fork, derived once per batch for every layer."""
        if "fork" not in layout.memo:
            split, device = layout.split, layout.body_lengths.device
            if split.rows_per_group is not None:
                row_groups = torch.arange(split.groups, device=device).repeat_interleave(split.rows_per_group)
            else:  # scatter[q] = group * slots + slot of the row's query q = s * Cm + j
                row_groups = split.scatter.view(layout.rows, layout.row_length)[:, 0] // split.slots
            real = torch.arange(layout.prompt_length, device=device) < layout.body_lengths[:, None]
            layout.memo["fork"] = Fork(split.groups, layout.prompt_length, layout.rows, layout.row_length, real,
                                       layout.body_lengths, row_groups)  # fmt: skip
        return layout.memo["fork"]

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed `(1, N, *rest)` -> bodies `(G, Pm, *rest)` and rows `(S, Cm, *rest)` (views)."""
        flat = x[0]
        return (flat[: self.prompt_tokens].view(self.groups, self.prompt_length, *flat.shape[1:]),
                flat[self.prompt_tokens :].view(self.rows, self.row_length, *flat.shape[1:]))  # fmt: skip

    def join(self, bodies: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of [`split`]: `(1, N, *rest)`."""
        return torch.cat([bodies.flatten(0, 1), rows.flatten(0, 1)])[None]

    def frozen(self, x: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        """Bodies' per-step values `(G, Pm, *rest)` set to `value` at the padding."""
        real = self.real.view(*self.real.shape, *([1] * (x.dim() - 2)))
        return torch.where(real, x, torch.full((), value, dtype=x.dtype, device=x.device))

    def conv(self, conv_fn, body_x: torch.Tensor, row_x: torch.Tensor, kernel: int):
        """
        A causal depthwise convolution `conv_fn((batch, channels, length)) -> same` over the bodies `(G, Pm, C)` from
        zero left context, and over the rows `(S, Cm, C)` with their group's body tail as left context. Returns both
        outputs, token-major.
        """
        tail = self.tail(body_x, kernel)  # (G, K - 1, C)
        bodies = conv_fn(body_x.transpose(1, 2)).transpose(1, 2) if self.prompt_length else body_x  # one-token prompts
        rows = torch.cat([tail.index_select(0, self.row_groups), row_x], dim=1)
        rows = conv_fn(rows.transpose(1, 2))[:, :, kernel - 1 :].transpose(1, 2)
        return bodies, rows

    def tail(self, body_x: torch.Tensor, kernel: int) -> torch.Tensor:
        """`(G, K - 1, C)`: each body's last `K - 1` inputs, zeros before its first token."""
        left = F.pad(body_x, (0, 0, kernel - 1, 0))  # position i here is body position i - (K - 1)
        index = self.body_lengths[:, None] + torch.arange(kernel - 1, device=body_x.device)
        return left.gather(1, index[:, :, None].expand(-1, -1, body_x.shape[-1]))

    def initial(self, state: torch.Tensor) -> torch.Tensor:
        """Each row's initial state: its group's (a gather; its backward sums the rows' gradients per group)."""
        return state.index_select(0, self.row_groups)


def _kernels(layer, hidden_states: torch.Tensor, scan: str, scan_name: str):
    """The scan kernel named `scan` and the causal convolution that `layer`'s own module calls (fused where
    transformers found the packages), each checked at its first use with an initial state ([`recurrent_checks`])."""
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


def gated_delta_net(layer, hidden_states: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """A Gated DeltaNet layer over the packed sequence `(1, N, D)`: bodies from a zero state (frozen at their
    padding), rows from their group's state, the convolution's left context the body's tail."""
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

    body_x, row_x = fork.split(mixed)
    body_g, row_g = fork.split(g)
    body_beta, row_beta = fork.split(beta)
    body_conv, row_conv = fork.conv(conv, body_x, row_x, layer.conv_kernel_size)
    state = None  # one-token prompts: no body, a zero state
    body_out = body_conv.new_empty(fork.groups, 0, layer.num_v_heads, layer.head_v_dim)
    if fork.prompt_length > 0:  # padding neither writes (beta 0) nor decays (log-decay 0) a body's state
        body_out, state = chunk(
            *heads(body_conv), g=fork.frozen(body_g), beta=fork.frozen(body_beta), initial_state=None,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
    row_out, _ = chunk(
        *heads(row_conv), g=row_g, beta=row_beta, initial_state=None if state is None else fork.initial(state),
        output_final_state=False, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    core = fork.join(body_out, row_out)  # (1, N, Hv, dv)
    norm = layer.norm if hasattr(layer, "norm") else layer.o_norm
    out_proj = layer.out_proj if hasattr(layer, "out_proj") else layer.o_proj
    core = norm(core.reshape(-1, layer.head_v_dim), gate.reshape(-1, layer.head_v_dim))
    return out_proj(core.reshape(*hidden_states.shape[:2], -1))


# -- Mamba2 (Nemotron-H, Granite 4-H, Falcon-H1) ----------------------------------------------------------------------
def mamba2(mixer, hidden_states: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """A Mamba2 mixer over the packed sequence `(1, N, D)`, as its own torch path computes it (the fused training
    path, where installed, would skip the fork): bodies from a zero state with `dt` zeroed at their padding after its
    floor (no input, no decay), rows from their group's state, the convolution's left context the body's tail."""
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

    # dt as the scan makes it (softplus, then clamped to the family's limits), before the bodies' padding is frozen
    dt = torch.clamp(F.softplus(dt + mixer.dt_bias.to(dt.dtype)), *mixer.time_step_limit)
    A = -torch.exp(mixer.A_log.float())

    def scan(xbc, dt, initial, final):
        x, B, C = torch.split(xbc, [mixer.intermediate_size, groups * state_size, groups * state_size], dim=-1)
        return chunk_scan(
            x.unflatten(-1, (heads, head_dim)), dt, A, B.unflatten(-1, (groups, state_size)),
            C.unflatten(-1, (groups, state_size)), chunk_size=mixer.chunk_size, D=mixer.D, z=None, dt_bias=None,
            dt_softplus=False, dt_limit=(0.0, float("inf")), initial_states=initial, return_final_states=final,
        )  # fmt: skip

    body_x, row_x = fork.split(xbc)
    body_dt, row_dt = fork.split(dt)
    body_conv, row_conv = fork.conv(conv, body_x, row_x, mixer.conv_kernel_size)
    state = None
    body_y = body_conv.new_empty(fork.groups, 0, heads, head_dim, dtype=torch.float32)
    if fork.prompt_length > 0:
        body_y, state = scan(body_conv, fork.frozen(body_dt), None, True)
    row_y = scan(row_conv, row_dt, None if state is None else fork.initial(state), False)
    y = fork.join(body_y.flatten(2), row_y.flatten(2))
    if getattr(mixer, "mamba_rms_norm", True):
        y = mixer.norm(y, gate)
    else:  # Falcon-H1 without its norm
        y = y * F.silu(gate)
    return mixer.out_proj(y.to(hidden_states.dtype))


# -- gated short convolutions (LFM2) -----------------------------------------------------------------------------------
def short_conv(layer, hidden_states: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """LFM2's gated short convolution `out_proj(C * conv(B * x))` over the packed sequence: the rows' convolution reads
    their group's body tail as left context."""
    fork = Fork.of(layout)
    B, C, x = layer.in_proj(hidden_states).chunk(3, dim=-1)
    weight = layer.conv.weight

    def conv(u):
        return F.conv1d(F.pad(u, (weight.shape[-1] - 1, 0)), weight, layer.conv.bias, groups=u.shape[1])

    body_conv, row_conv = fork.conv(conv, *fork.split(B * x), weight.shape[-1])
    return layer.out_proj(C * fork.join(body_conv, row_conv))


# -- installing the forks ----------------------------------------------------------------------------------------------
# Each recurrent layer class (by name: each family's modeling module defines its own copy), its forked forward, and
# the child whose weights it reads directly (the convolution), as the layer's own forward names it to
# `force_accelerate_hooks`
FORKS = {
    "Qwen3NextGatedDeltaNet": (gated_delta_net, "conv1d"),
    "Qwen3_5GatedDeltaNet": (gated_delta_net, "conv1d"),
    "Qwen3_5MoeGatedDeltaNet": (gated_delta_net, "conv1d"),
    "OlmoHybridGatedDeltaNet": (gated_delta_net, "conv1d"),
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


def install(model: nn.Module) -> int:
    """Routes each recurrent layer of `model` to its fork when the packed layout reaches it (idempotent). Returns how
    many there are."""
    count = 0
    for module, fork in recurrent_layers(model):
        count += 1
        if getattr(module, "_rloo_efficient_routed", False):
            continue
        # Under an accelerate hook (`device_map`, offloading), its forward moves the inputs (and loads offloaded
        # weights) before calling `_old_forward`: route there, so that the fork runs after the hook's work too. The
        # fork reads the convolution's weights without calling it: fire that child's hook around the fork, as the
        # layer's own forward does (an offloaded child's weights are on the meta device until then)
        target = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
        own_forward = getattr(module, target)
        fork = force_accelerate_hooks(FORKS[type(module).__name__][1])(fork)

        def forward(*args, _own=own_forward, _module=module, _fork=fork, **kwargs):
            layout = kwargs.pop(LAYOUT_KWARG, None)
            if layout is None:
                return _own(*args, **kwargs)
            return _fork(_module, args[0] if args else kwargs["hidden_states"], layout)

        setattr(module, target, forward)
        module._rloo_efficient_routed = True
    return count
