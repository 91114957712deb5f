"""
The prompt's KV cache once per group during decoding.

After the shared prefill, [`generation.generate.fan_out`] would copy each prompt's keys and values to its `k` rows, and
every decoding step would attend `k` times over the same prompt. [`PrefixCache`] keeps the prompt's keys and values once
per distinct prompt row (`G` of them) and only the decoded tokens per row (`B` rows). Each step, every layer's
attention is [`attention.backend.split_attention`]: one kernel call for all rows' queries against their prompts, one for
all rows against their own decoded keys, merged by log-sum-exp. The structure (which rows share which prompt, which
prompt positions are padding) is computed on the host once, when the cache is built: nothing in a decoding step reads
a device value back.
"""

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from ..attention.backend import SplitLayout, stored_as_read
from ..layers.families import attention_reason


class ReadDtypeCache(DynamicCache):
    """
    A `DynamicCache` storing keys and values in the dtype attention reads them ([`attention.backend.stored_as_read`]):
    under bf16 autocast, a model whose keys come out in float32 (Qwen3's normalized keys, rotary embeddings in float32)
    stores them in bf16, as every reader casts them, a third less than stock's cache of float32 keys and bf16 values.
    Each attention call gets the same values. `source_dtype`: the keys' dtype as the model handed them over (what
    stock's cache stores), which the masks built for this cache keep ([`mask_dtype`]).
    """

    source_dtype: torch.dtype | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.source_dtype is None:
            self.source_dtype = key_states.dtype
        key_states, value_states = stored_as_read(key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def mask_dtype(cache, keys: torch.Tensor) -> torch.dtype:
    """The dtype of an additive mask over `cache`'s `keys`: stock's cache's keys' ([`ReadDtypeCache.source_dtype`])."""
    return getattr(cache, "source_dtype", None) or keys.dtype


class PrefixLayer(DynamicLayer):
    """
    A layer's decoded keys/values per row (`keys`, `values`: (B, Hkv, t, D)) after a prompt stored once per group
    (`prefix_keys`, `prefix_values`: (G, Hkv, L_p, D): the last L_p of the prompt's `prefix_columns` positions, all of
    them but where a sliding-window layer kept only its window), masked by `prefix_bias` (G, 1, 1, L_p) where a prompt
    is padded. Sequence lengths and mask sizes count the prompt's positions and the decoded ones.
    """

    # What masks the rows' own keys (`(1, 1, 1, t)`), or None: each holds only what was written (a static decoding
    # buffer's layer holds positions not written yet: [`generation.static_buffers.StaticPrefixLayer`])
    own_bias: torch.Tensor | None = None

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor, prefix_columns: int,
                 prefix_bias: torch.Tensor | None, window: int | None = None):  # fmt: skip
        super().__init__()
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values
        self.prefix_columns, self.prefix_bias = prefix_columns, prefix_bias
        self.window = window  # a sliding-window layer keeps only its rows' last w - 1 tokens, as transformers' does
        self.own_length = 0  # the rows' decoded positions so far

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states)  # the new tokens' attention reads all of these
        self.own_length += key_states.shape[-2]
        if self.window is not None and keys.shape[-2] > self.window - 1:
            self.keys, self.values = keys[:, :, 1 - self.window :], values[:, :, 1 - self.window :]
        return keys, values

    def get_seq_length(self) -> int:
        return self.prefix_columns + self.own_length

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("A shared-prefix cache is built for one generate call and is not cropped.")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("A shared-prefix cache's rows are fixed when it is built.")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("A shared-prefix cache's rows are fixed when it is built.")


def padding_bias(prompt_lengths: list[int], width: int, device, dtype) -> torch.Tensor | None:
    """`(G, 1, 1, width)` masking the left padding of prompts of `prompt_lengths` real tokens in the last `width`
    positions of the cached prompt, or None when none is padded there."""
    lengths = np.asarray(prompt_lengths, dtype=np.int64)
    if (lengths >= width).all():
        return None
    padded = np.arange(width)[None, :] < (width - lengths)[:, None]
    bias = torch.from_numpy(np.where(padded, torch.finfo(dtype).min, 0.0)).to(device, dtype)
    return bias.view(len(lengths), 1, 1, width)


def decode_split(inverse: list[int], prompt_lengths: list[int], prefix_width: int, device, dtype) -> SplitLayout:
    """
    The [`SplitLayout`] of one decoding step: `B` rows of one query each, row `b` reading prompt `inverse[b]` (of
    `prompt_lengths[g]` real tokens, left-padded to `prefix_width` in the cache). Built on the host.
    """
    inverse_np = np.asarray(inverse, dtype=np.int64)
    groups = int(inverse_np.max()) + 1
    counts = np.bincount(inverse_np, minlength=groups)
    # The rows of each prompt consecutive and equally many (TRL's sampler lays out groups so): the prefix layout of
    # the queries is a view of the batch
    consecutive = np.array_equal(inverse_np, np.repeat(np.arange(groups), counts))
    rows_per_group = int(counts[0]) if consecutive and (counts == counts[0]).all() else None
    slots = int(counts.max())
    gather = scatter = None
    if rows_per_group is None:
        order = np.argsort(inverse_np, kind="stable")  # rows grouped by prompt, in row order within a prompt
        rank = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)  # position within its prompt
        slot_of_row = np.empty_like(order)
        slot_of_row[order] = inverse_np[order] * slots + rank
        gather_np = np.full(groups * slots, len(inverse_np), dtype=np.int64)  # padding slots read the zero row
        gather_np[slot_of_row] = np.arange(len(inverse_np))
        gather = torch.from_numpy(gather_np).to(device)
        scatter = torch.from_numpy(slot_of_row).to(device)
    return SplitLayout(groups, rows_per_group, slots, gather, scatter, padding_bias(prompt_lengths, prefix_width,
                                                                                 device, dtype))  # fmt: skip


class PrefixCache(ReadDtypeCache):
    """
    The cache [`attention.backend`] decodes from: a filled cache of `G` distinct prompt rows, and `split`, the
    [`SplitLayout`] of the `B` decoded rows over them.

    Args:
        prefilled (`DynamicCache`):
            The prompts' keys and values, one row per distinct prompt.
        inverse (`list[int]`):
            For each decoded row, its prompt's row in `prefilled`.
        prompt_lengths (`list[int]`):
            Each distinct prompt's real (unpadded) tokens in `prefilled`; the rest of its row is left padding.
        prefix_columns (`int`):
            The prompt positions the prefill forwarded (sliding-window layers may keep only the last of them).
    """

    @staticmethod
    def layer_types(prefilled: DynamicCache, sources: list[int] | None = None) -> list[type]:
        """The type of each layer a `PrefixCache` of `prefilled` holds, without building it (building one reorders
        recurrent states in place)."""
        types = [type(layer) if isinstance(layer, (LinearAttentionLayer, DummyLayer)) else PrefixLayer
                 for layer in prefilled.layers]  # fmt: skip
        return [SharedPrefixLayer if source != index else types[index]
                for index, source in enumerate(sources or range(len(types)))]  # fmt: skip

    def __init__(self, prefilled: DynamicCache, inverse: list[int], prompt_lengths: list[int], prefix_columns: int,
                 sources: list[int] | None = None):  # fmt: skip
        super().__init__()
        self.inverse = inverse
        attention = [layer for layer in prefilled.layers if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)]
        keys = attention[0].keys
        self.source_dtype = dtype = mask_dtype(prefilled, keys)
        self.split = decode_split(inverse, prompt_lengths, prefix_columns, keys.device, dtype)
        # A sliding-window layer kept the prompt's last positions only: its own padding mask, one per width
        biases = {prefix_columns: self.split.prefix_bias}
        for layer in attention:
            width = layer.keys.shape[-2]
            if width not in biases:
                biases[width] = padding_bias(prompt_lengths, width, keys.device, dtype)
        rows = torch.tensor(inverse, device=keys.device)
        self.layers = []
        for index, layer in enumerate(prefilled.layers):
            if isinstance(layer, LinearAttentionLayer):  # recurrent and convolution states: one per row, from here on
                layer.reorder_cache(rows)
                self.layers.append(layer)
            elif isinstance(layer, DummyLayer):  # nothing stored (a layer reading another's keys: aliased below)
                self.layers.append(layer)
            else:
                self.layers.append(PrefixLayer(layer.keys, layer.values, prefix_columns, biases[layer.keys.shape[-2]],
                                               getattr(layer, "sliding_window", None) if layer.is_sliding else None))
        for index, source in enumerate(sources or []):  # Gemma 4: a layer that reuses another layer's keys and values
            if source != index:
                self.layers[index] = SharedPrefixLayer(self.layers[source])


class SharedPrefixLayer(DummyLayer):
    """
    A layer that stores nothing and reads another layer's keys and values (Gemma 4's KV sharing: the model hands it
    its source layer's, in the same step): the stored prompt and the count of decoded positions are its source's.
    """

    def __init__(self, source: PrefixLayer):
        super().__init__()
        self.source = source

    prefix_keys = property(lambda self: self.source.prefix_keys)
    prefix_values = property(lambda self: self.source.prefix_values)
    prefix_bias = property(lambda self: self.source.prefix_bias)
    prefix_columns = property(lambda self: self.source.prefix_columns)
    own_length = property(lambda self: self.source.own_length)
    own_bias = property(lambda self: self.source.own_bias)


def kv_sources(config) -> list[int]:
    """For each layer of a text `config`, the layer whose keys and values it attends to: itself, or for Gemma 4's
    layers that reuse ("reuse" in `kv_sharing_modes`), the one of their layer type that stores them ("store")."""
    modes = getattr(config, "kv_sharing_modes", None) or [None] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    store = {layer_type: index for index, (layer_type, mode) in enumerate(zip(types, modes)) if mode == "store"}
    return [store[layer_type] if mode == "reuse" else index
            for index, (layer_type, mode) in enumerate(zip(types, modes))]  # fmt: skip


def kv_token_bytes(config, element_size: int) -> int:
    """The bytes of one token's keys and values as a cache stores them, over the layers of a text `config` that store
    them, from the config: not a layer reading another's (Gemma 4's), a recurrent one (its state is per sequence, not
    per token) nor one without attention (Nemotron-H's MLP layers); per layer where it varies by layer (Gemma 4's global
    layers); multi-head latent attention's (DeepSeek-V3, Kimi-Linear) latents."""
    return sum(held_token_values(config)) * element_size


def held_token_values(config) -> tuple[int, int]:
    """What a held prompt keeps of one token ([`attention.held.Capture`]) over the layers of a text `config` that store
    keys and values (as [`kv_token_bytes`]), in values: `(keys and values as attention reads them, multi-head latent
    attention's latents)`, the latter held in the dtype they come in ([`attention.held.Capture.latents`])."""
    configs = getattr(config, "per_layer_config", None) or [config] * config.num_hidden_layers
    layers = DynamicCache(config=config).layers
    stores = [isinstance(layer, DynamicLayer) for layer in layers]  # (a hybrid's attention layers only)
    if len(stores) != config.num_hidden_layers:  # (a config whose cache has no layer per layer): every layer charged
        stores = [True] * config.num_hidden_layers
    keys = latents = 0
    for index, source in enumerate(kv_sources(config)):
        if source == index and stores[index]:
            layer = configs[index]
            if getattr(layer, "kv_lora_rank", None) and getattr(layer, "qk_rope_head_dim", None):  # latent attention
                latents += layer.kv_lora_rank + layer.qk_rope_head_dim
                continue
            heads = getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads
            keys += 2 * heads * (getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads)
    return keys, latents


def prefix_cache_unsupported_reason(model: nn.Module) -> str | None:
    """Why the once-per-group prompt cache cannot be exact for `model`, or None (a length limit is checked per batch
    by [`cache_limit`])."""
    config = model.config.get_text_config(decoder=True)
    layers = DynamicCache(config=config).layers
    modes, types = getattr(config, "kv_sharing_modes", None) or [], getattr(config, "layer_types", None) or []
    stored = {layer_type for layer_type, mode in zip(types, modes) if mode == "store"}
    if any(mode == "reuse" and layer_type not in stored for layer_type, mode in zip(types, modes)):
        # Gemma 4's assistant-style configs: every layer reads keys and values another model stores
        return "a layer reuses keys and values that no layer of this model stores"
    if any(isinstance(layer, LinearAttentionLayer) and isinstance(layer, DynamicLayer) for layer in layers):
        # Falcon-H1's parallel blocks keep keys and states in one layer: the prefill is shared, the cache fanned out
        return "its cache layers hold attention keys and recurrent states together (Falcon-H1's parallel blocks)"
    return attention_reason(model)


def cache_limit(model: nn.Module) -> int | None:
    """
    The longest sequence `generate` keeps its cache for, or None. Phi-3's `prepare_inputs_for_generation` drops the
    cache once the sequence passes `original_max_position_embeddings` and forwards the whole sequence again, which a
    cache holding the prompt once cannot serve (stock's own cache, fanned out, can).
    """
    config = model.config.get_text_config()
    if config.model_type == "phi3":
        return getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings
    return None


# -- kept once or fanned out: the cost model -------------------------------------------------------------------------
# Per device type, the bytes of prompt keys and values a layer's decoding step must skip reading (the fanned-out
# copies) before keeping the prompt once pays for its split attention (a second kernel call and the merge, about ten
# operators). Measured with experiments/bench_decode_cost.py and bench_generation.py (results/decode_cost.md,
# results/gpu.md):
# - cpu (this machine, float32): one layer's step kept once was 2.6x the fanned-out time at 0.23 MB skipped and faster
#   from 3.67 MB; whole runs put the break-even lower: at 1.8 MB (the reasoning shape, bench_tree.py) kept once was
#   1.02x stock's generation and fanned out 1.12x, and generate alone 0.88x and 0.94x (bench_generation.py, P=512):
#   1 MB;
# - cuda, eager steps (generate's own loop; an H200, bf16, Qwen3-0.6B's shape, k=8): decoding is bound by the host's
#   launches; kept once was 1.27x the fanned-out time with 88 MB skipped per layer and step (~190 us more per layer
#   and step, against ~20 us of reads at 4.3 TB/s), so even needs ~900 MB. Across prompt lengths
#   (bench_decode_cost.py, the same GPU, 16/8 heads of 128, k=8; results/gpu_session/decode_cost_k8.txt): kept once
#   9.7x, 7.1x, 5.5x and 1.10x the fanned-out time per layer and step at 7, 29, 117 and 470 MB skipped: still slower
#   at 470 MB, so 900 MB stands.
# Other accelerators take CUDA's figure.
BREAK_EVEN_BYTES = {"cpu": 1e6, "cuda": 900e6}
# The same where decoding replays each step from a captured graph (static decoding, the default on CUDA), so that the
# split attention's extra operators cost the device their kernels' time and the host nothing:
# - cuda (an H200, bf16, Qwen3-0.6B's shape, P=3072, k=8: 88 MB skipped per layer and step; gpu_session.sh step
#   static_once_0.6b, results/gpu_session/static_once_0.6b.txt): kept once 5.67 ms per token against 7.81 fanned out
#   (0.73x; the whole call 0.75x) and 0.22x the call's tensor peak; the trainer's step 0.76x, its generation 0.74x
#   (bench_gpu_0.6b_once.md). What kept once adds is a fixed number of kernels per layer and what it saves grows
#   with the bytes skipped, so it is faster from there up; below 88 MB nothing is measured yet (gpu_session.sh step
#   static_once_sweep), and the prompt is fanned out there.
REPLAYED_BREAK_EVEN_BYTES = {"cuda": 88e6}
# On an accelerator, fanned-out copies of the prompts (all layers) above this share of its memory: kept once whatever
# the time, as the previous default did (a batch of long prompts must not need k times their cache to decode)
MEMORY_SHARE = 0.1


def keep_prompt_once(prefilled: DynamicCache, rows: int, device: torch.device, replayed: bool = False) -> bool:
    """
    Whether decoding should keep the prompts of `prefilled` (one cache row per distinct prompt, `U`) once rather than
    fan them out to the `rows` that share them: where the fanned-out copies a layer's decoding step would read, `(rows
    - U) / U` times each layer's prompt keys and values (their real sizes: windows, latents and dtypes as cached),
    average at least the device's break-even ([`REPLAYED_BREAK_EVEN_BYTES`] where the steps are `replayed` from a
    captured graph, kept once or fanned out alike; [`BREAK_EVEN_BYTES`] otherwise), or where on an accelerator all
    the copies would take more than [`MEMORY_SHARE`] of its memory. From shapes alone, on the host: the same prompts,
    model and device give the same choice on every process and every run.
    """
    sizes = [layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
             for layer in prefilled.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]  # fmt: skip
    if not sizes:
        return False
    distinct = next(layer.keys.shape[0] for layer in prefilled.layers if getattr(layer, "keys", None) is not None)
    copies = sum(sizes) * (rows - distinct) / distinct
    if device.type == "cuda" and copies > MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory:
        return True
    eager = BREAK_EVEN_BYTES.get(device.type, BREAK_EVEN_BYTES["cuda"])
    break_even = REPLAYED_BREAK_EVEN_BYTES.get(device.type, eager) if replayed else eager
    return copies / len(sizes) >= break_even
