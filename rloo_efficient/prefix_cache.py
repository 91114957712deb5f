"""
The prompt's KV cache once per group during decoding (the prefix/suffix split of Hydragen, arXiv 2402.05099).

After the shared prefill, [`shared_generation.fan_out`] copies each prompt's keys and values to its `k` rows, and
every decoding step attends `k` times over the same prompt. Here the cache keeps the prompt's keys and values once
per distinct prompt row (`G` of them) and only the decoded tokens per row (`B` rows). Attention over a row's
`L_p + t` keys is computed in two parts and merged exactly:

    prefix:  scores over the G prompts' keys, one batched matmul per group for all its rows' queries (G, Hkv, M, L_p)
    suffix:  scores over each row's own t keys                                                     (B, Hkv, M', t)
    merge:   out = o_p * exp(lse_p - lse) + o_s * exp(lse_s - lse),  lse = logaddexp(lse_p, lse_s)

which is softmax over the concatenated keys, rearranged. The function is registered in transformers' attention
interface under `ATTENTION_NAME` and used only inside [`prefix_attention`], which points the model's config at it
and makes the cache known to it; the model's own attention is restored on exit.
"""

import contextlib
import contextvars

import torch
from torch import nn
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from .prefix_sharing import sliding_window


ATTENTION_NAME = "rloo_shared_prefix"
# Architectures whose attention hands the interface plain scaled dot-product attention (no logit soft-capping, no
# attention sinks, no per-layer window), with keys and values of shape (B, Hkv, L, D); tested in the suite
PREFIX_ATTENTION_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_active_cache: contextvars.ContextVar["PrefixCache | None"] = contextvars.ContextVar("rloo_prefix_cache", default=None)


class PrefixLayer(DynamicLayer):
    """A layer's decoded keys/values per row (`keys`, `values`: (B, Hkv, t, D)) after a prompt stored once per group
    (`prefix_keys`, `prefix_values`: (G, Hkv, L_p, D)). Sequence lengths and mask sizes count both."""

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor):
        super().__init__()
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values
        self.prefix_length = prefix_keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.prefix_length + super().get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("A shared-prefix cache is built for one generate call and is not cropped.")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("A shared-prefix cache's rows are fixed when it is built.")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("A shared-prefix cache's rows are fixed when it is built.")


class PrefixCache(DynamicCache):
    """
    The cache [`prefix_attention`] decodes from: a filled cache of `G` distinct prompt rows, and `inverse` (B,) giving
    each of the `B` decoded rows its prompt. `slots` (G, R) lists each prompt's rows (R = the most rows any prompt
    has; missing ones repeat the first, and their results are never read) and `row_slot` (B,) is each row's position
    in `slots.flatten()`.
    """

    def __init__(self, prefilled: DynamicCache, inverse: torch.Tensor):
        super().__init__()
        self.layers = [PrefixLayer(layer.keys, layer.values) for layer in prefilled.layers]
        groups = int(inverse.max()) + 1
        members = [[] for _ in range(groups)]
        for row, group in enumerate(inverse.tolist()):
            members[group].append(row)
        width = max(len(rows) for rows in members)
        self.slots = torch.tensor([rows + rows[:1] * (width - len(rows)) for rows in members], device=inverse.device)
        row_slot = [0] * inverse.numel()
        for group, rows in enumerate(members):
            for position, row in enumerate(rows):
                row_slot[row] = group * width + position
        self.row_slot = torch.tensor(row_slot, device=inverse.device)
        self.first_row = self.slots[:, 0]


def prefix_attention_unsupported_reason(model: nn.Module) -> str | None:
    """Why the once-per-group prompt cache cannot be exact for `model`, or None."""
    text_config = model.config.get_text_config()
    if text_config.model_type not in PREFIX_ATTENTION_MODEL_TYPES:
        verified = ", ".join(PREFIX_ATTENTION_MODEL_TYPES)
        return f"its attention is only verified for {verified}, not {text_config.model_type}"
    if sliding_window(model) is not None:
        return "its layers use a sliding window, whose cache drops prompt tokens as decoding goes on"
    return None


def _softmax_parts(scores: torch.Tensor, values: torch.Tensor, dtype: torch.dtype):
    """(attention output, logsumexp) of `scores` (..., M, L) over `values` (..., L, D), normalized in `dtype`."""
    scores = scores.to(dtype)
    peak = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights.to(values.dtype), values).to(dtype) / total
    return out, (peak + torch.log(total)).squeeze(-1)


def shared_prefix_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """
    Attention over [a row's prompt, stored once per group | its own decoded keys]. `query` (B, H, q, D); `key`,
    `value` (B, Hkv, t, D): the row's decoded keys (the [`PrefixLayer`] returns only those); `attention_mask`
    (B, 1, q, L_p + t), additive. Returns (B, q, H, D), as transformers' attention functions do.
    """
    cache = _active_cache.get()
    if cache is None:
        raise RuntimeError(f"{ATTENTION_NAME!r} attention runs only inside rloo_efficient's prefix_attention().")
    if dropout:
        raise ValueError("shared-prefix attention has no dropout; generation runs without it")
    layer = cache.layers[module.layer_idx]
    prefix_keys, prefix_values = layer.prefix_keys, layer.prefix_values  # (G, Hkv, L_p, D)
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    rep = heads // kv_heads  # query heads per key/value head (GQA): head h reads key/value head h // rep
    groups, width = cache.slots.shape
    work = torch.promote_types(query.dtype, torch.float32)  # softmax in float32 at least, as eager attention does
    length = layer.prefix_length

    # Prefix: each prompt's rows' queries in one matmul against its keys. (G, R, H, q, D) -> (G, Hkv, R*rep*q, D)
    grouped = query[cache.slots.flatten()].view(groups, width, kv_heads, rep, q_len, dim)
    grouped = grouped.permute(0, 2, 1, 3, 4, 5).reshape(groups, kv_heads, width * rep * q_len, dim)
    scores = torch.matmul(grouped, prefix_keys.transpose(-1, -2)) * scaling  # (G, Hkv, R*rep*q, L_p)
    mask = attention_mask[cache.first_row, :, :, :length]  # (G, 1, q, L_p): a prompt's rows share its padding
    scores = scores.view(groups, kv_heads, width, rep, q_len, length) + mask.view(groups, 1, 1, 1, q_len, length)
    out_p, lse_p = _softmax_parts(scores.flatten(2, 4), prefix_values, work)  # (G, Hkv, R*rep*q, D), (G, Hkv, R*rep*q)
    # back to rows: (G, Hkv, R, rep*q, .) -> (G*R, Hkv, rep*q, .) -> (B, Hkv, rep*q, .)
    out_p = out_p.view(groups, kv_heads, width, rep * q_len, dim).transpose(1, 2).flatten(0, 1)[cache.row_slot]
    lse_p = lse_p.view(groups, kv_heads, width, rep * q_len).transpose(1, 2).flatten(0, 1)[cache.row_slot]

    # Suffix: each row's queries against its own decoded keys. (B, Hkv, rep*q, t)
    per_row = query.reshape(rows, kv_heads, rep * q_len, dim)
    scores = torch.matmul(per_row, key.transpose(-1, -2)) * scaling
    suffix_mask = attention_mask[:, :, :, length:]  # (B, 1, q, t)
    scores = (scores.view(rows, kv_heads, rep, q_len, -1) + suffix_mask.unsqueeze(1)).flatten(2, 3)
    out_s, lse_s = _softmax_parts(scores, value, work)

    lse = torch.logaddexp(lse_p, lse_s)
    out = out_p * torch.exp(lse_p - lse).unsqueeze(-1) + out_s * torch.exp(lse_s - lse).unsqueeze(-1)
    out = out.to(query.dtype).view(rows, heads, q_len, dim).transpose(1, 2).contiguous()
    return out, None


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)
AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)  # additive (B, 1, q, L) masks, always materialized


@contextlib.contextmanager
def prefix_attention(model: nn.Module, cache: PrefixCache):
    """Within the block, `model`'s attention reads prompts from `cache` once per group; restored on exit."""
    config = model.config.get_text_config()
    previous = config._attn_implementation
    token = _active_cache.set(cache)
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
        _active_cache.reset(token)
