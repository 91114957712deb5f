"""
Each model family, shrunk and built offline from its own config class (transformers 5.23 and 5.24), so that its own modeling
code runs: its attention module, its cache layers, its router. What reaches attention differently in the real models is
kept (windows, sinks, q/k norms, partial rotary, shared keys and values, latent attention, experts). Multimodal
families are built as their `*ForConditionalGeneration` checkpoints are (a tiny vision tower beside the language
model), with a processor made of the workload's byte tokenizer and the family's image processor.
"""

import functools
import types

import torch


# arch -> (config class, multimodal); the kwargs are in `_family_kwargs`
ARCHITECTURES = {
    "llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
    "gemma3": "Gemma3TextConfig", "phi3": "Phi3Config", "olmo2": "Olmo2Config", "smollm3": "SmolLM3Config",
    "granite": "GraniteConfig", "qwen3_moe": "Qwen3MoeConfig", "gpt_oss": "GptOssConfig",
    "glm4_moe": "Glm4MoeConfig", "cohere2": "Cohere2Config", "olmo3": "Olmo3Config",
    "ernie4_5_moe": "Ernie4_5_MoeConfig", "minimax_m2": "MiniMaxM2Config", "seed_oss": "SeedOssConfig",
    "deepseek_v3": "DeepseekV3Config", "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "olmoe": "OlmoeConfig",
    "exaone4": "Exaone4Config", "ministral": "MinistralConfig", "ministral3": "Ministral3Config",
    "phi4_mini": "Phi3Config",  # Phi-3 with LongRoPE (Phi-3.5-mini, Phi-4-mini)
    "gemma2": "Gemma2Config",
    # Hybrids: recurrent layers (Gated DeltaNet, Mamba2, short convolutions) among attention layers
    "qwen3_next": "Qwen3NextConfig", "olmo_hybrid": "OlmoHybridConfig", "nemotron_h": "NemotronHConfig",
    "granitemoehybrid": "GraniteMoeHybridConfig", "falcon_h1": "FalconH1Config", "lfm2": "Lfm2Config",
    "kimi_linear": "KimiLinearConfig",
    # Multimodal checkpoints, as TRL loads them (`config.architectures[0]`: `*ForConditionalGeneration`)
    "gemma3_vlm": "Gemma3Config", "qwen2_vl": "Qwen2VLConfig", "qwen2_5_vl": "Qwen2_5_VLConfig", "gemma4": "Gemma4Config",
    "qwen3_5": "Qwen3_5Config", "qwen3_5_moe": "Qwen3_5MoeConfig", "qwen3_vl": "Qwen3VLConfig",
    "qwen3_vl_moe": "Qwen3VLMoeConfig", "glm4v": "Glm4vConfig",
    "glm4v_moe": "Glm4vMoeConfig", "internvl": "InternVLConfig", "llava": "LlavaConfig",
    "llava_next": "LlavaNextConfig", "idefics3": "Idefics3Config", "smolvlm": "SmolVLMConfig",
    "mistral3": "Mistral3Config", "lfm2_vl": "Lfm2VlConfig",
}  # fmt: skip
MULTIMODAL = ("gemma3_vlm", "qwen2_vl", "qwen2_5_vl", "gemma4", "qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe",
              "glm4v", "glm4v_moe", "internvl", "llava", "llava_next",
              "idefics3", "smolvlm", "mistral3", "lfm2_vl")
MOE = ("qwen3_moe", "gpt_oss", "glm4_moe", "ernie4_5_moe", "minimax_m2", "deepseek_v3", "qwen3_next", "qwen3_5_moe",
       "nemotron_h", "mixtral", "qwen2_moe", "olmoe")
# Each multimodal family's special tokens, added after the byte tokenizer's vocabulary, by the tokenizer attribute its
# processor reads them from (None: a token the processor finds by its text)
_GEMMA_IMAGE = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
_QWEN = {None: ("<|vision_start|>", "<|vision_end|>"), "image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
_GLM = {None: ("<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>"),
        "image_token": "<|image|>", "video_token": "<|video|>"}
IMAGE_TOKENS = {
    "gemma3_vlm": {**_GEMMA_IMAGE, "image_token": "<image_soft_token>"},
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_5": _QWEN,
    "qwen3_5_moe": _QWEN,
    "qwen3_vl": _QWEN,
    "qwen3_vl_moe": _QWEN,
    "glm4v": _GLM,
    "glm4v_moe": _GLM,
    "internvl": {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                 "video_token": "<video>"},
    "gemma4": {**_GEMMA_IMAGE, "image_token": "<|image|>", "video_token": "<|video|>", "audio_token": "<|audio|>",
               "boa_token": "<start_of_audio>", "eoa_token": "<end_of_audio>"},
    "llava": {"image_token": "<image>"},
    "llava_next": {"image_token": "<image>"},
    # Idefics3 and SmolVLM: each tile's tokens between fake tokens, the global image tagged (its row and column tags,
    # plain text here, are split into bytes by the byte tokenizer)
    "idefics3": {None: ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")},
    "smolvlm": {None: ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")},
    # Mistral 3: each row of an image's tokens closed by a break token, the last by the end token
    "mistral3": {None: ("[IMG]", "[IMG_BREAK]", "[IMG_END]")},
    # LFM2-VL: an image's tokens between start and end tokens (a split image's tiles tagged by plain-text row and
    # column tags, its thumbnail by its own token)
    "lfm2_vl": {None: ("<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"), "image_token": "<image>"},
}
# What a family's chat template writes for an image (its processor expands it into the image's tokens)
IMAGE_PLACEHOLDER = {"gemma3_vlm": "<start_of_image>", "gemma4": "<|image|>", "llava": "<image>", "llava_next": "<image>",
                     **dict.fromkeys(("glm4v", "glm4v_moe"), "<|begin_of_image|><|image|><|end_of_image|>"),
                     "internvl": "<IMG_CONTEXT>",
                     "idefics3": "<image>", "smolvlm": "<image>", "mistral3": "[IMG]", "lfm2_vl": "<image>",
                     **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"),
                                     "<|vision_start|><|image_pad|><|vision_end|>")}  # fmt: skip
LLAVA_TILE = 8  # LLaVA's tiny CLIP tower: 8x8 images in patches of 2 (16 tokens); LLaVA-Next's tiles of that size
LLAVA_PINPOINTS = [[8, 8], [8, 16], [16, 8], [16, 16]]


def image_tokens(arch: str) -> tuple[list[str], dict[str, str]]:
    """`(tokens, roles)`: a multimodal family's special tokens, and those its processor reads by attribute."""
    tokens, roles = [], {}
    for role, value in IMAGE_TOKENS.get(arch, {}).items():
        tokens += list(value) if role is None else [value]
        if role is not None:
            roles[role] = value
    return tokens, roles


def alternating(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def hybrid(layers: int, recurrent: str = "linear_attention") -> list[str]:
    """A recurrent layer, then an attention layer, alternating (the real models have 3 recurrent layers to 1)."""
    return [recurrent if i % 2 == 0 else "full_attention" for i in range(layers)]


# Gated DeltaNet heads (2 key heads, 4 value heads, as the real models' 16/32), a 4-tap convolution
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4)
# Mamba2 (Nemotron-H's names): 4 heads of 8 in 2 groups, a state of 8, chunks of 16 (shorter than the prompts)
_MAMBA = dict(mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=16)


def _longrope(head_dim: int, partial: float, original: int) -> dict:
    """LongRoPE's parameters: a short and a long factor per rotary frequency (rising as Phi-4-mini's do)."""
    count = int(head_dim * partial) // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "original_max_position_embeddings": original, "short_factor": [1.0 + 0.05 * i for i in range(count)],
            "long_factor": [1.0 + 0.5 * i for i in range(count)]}  # fmt: skip


# Ministral 3's YaRN, and queries scaled by log(1 + floor(position / original length)) (Llama 4's scaling); the
# original length shrunk to 16 so that the scale changes inside a row
_MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "original_max_position_embeddings": 16, "llama_4_scaling_beta": 0.1}


def _experts(cfg) -> dict:
    """Top-2 routing over experts half the MLP's width, as the mixture-of-experts families share them."""
    return dict(num_experts_per_tok=2, moe_intermediate_size=cfg.intermediate_size // 2)


def _attention_kwargs(cfg, head_dim: int) -> dict:
    """Per dense family: what its real models set that reaches attention differently (windows, scales, rotary),
    shrunk."""
    layers, window = cfg.num_hidden_layers, cfg.sliding_window
    return {
        # query_pre_attn_scalar scales the scores, embeddings are scaled, every other layer slides
        "gemma3": dict(head_dim=head_dim, query_pre_attn_scalar=head_dim // 2, sliding_window=window or 512,
                       layer_types=alternating(layers)),
        # Gemma 2: Gemma 3's scaling and windows, and attention and final logits capped (c tanh(x / c)); the caps
        # shrunk from 50 and 30 so that they bend a tiny model's logits
        "gemma2": dict(head_dim=head_dim, query_pre_attn_scalar=head_dim // 2, sliding_window=window or 512,
                       layer_types=alternating(layers), attn_logit_softcapping=0.5, final_logit_softcapping=3.0),
        # q/k norms, post-norms, three sliding layers to one full layer without rotary (every other one here)
        "exaone4": dict(sliding_window=window or 4096, layer_types=alternating(layers)),
        # Ministral 8B: Mistral with windows on every other layer
        "ministral": dict(head_dim=head_dim, sliding_window=window or 4096, layer_types=alternating(layers)),
        # Ministral 3 (Mistral 3's language model): YaRN with queries scaled by their position
        "ministral3": dict(head_dim=head_dim, **({"sliding_window": window} if window else {}),
                           rope_parameters=_MINISTRAL3_ROPE),
        "smollm3": dict(no_rope_layers=[int(i % 2 == 0) for i in range(layers)]),  # every other layer without rotary
        # the multipliers that scale the scores, embeddings, residuals and logits
        "granite": dict(attention_multiplier=0.5, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
        "phi3": dict(partial_rotary_factor=0.5, **({"sliding_window": window} if window else {})),  # fused qkv
        # Phi-4-mini: LongRoPE on three quarters of each head, its long factors once a call's longest position passes
        # the original length (64 here: prompts are shorter, prompts with completions longer)
        "phi4_mini": dict(partial_rotary_factor=0.75, original_max_position_embeddings=64,
                          rope_parameters=_longrope(cfg.hidden_size // cfg.num_attention_heads, 0.75, 64)),
        "mistral": {"sliding_window": window} if window else {},
        "qwen3": dict(head_dim=head_dim),
        # rotary on sliding layers only (full layers have none), a parallel attention/MLP block, a logit scale
        "cohere2": dict(sliding_window=window or 4096, layer_types=alternating(layers)),
        # q/k norms over the whole projection, windows on every other layer, post-norms
        "olmo3": dict(sliding_window=window or 4096, layer_types=alternating(layers)),
        # biased q/k/v; dropout on attention and residuals by default (0.1), which must be off to share
        "seed_oss": dict(head_dim=head_dim, attention_dropout=0.0, residual_dropout=0.0),
    }


def _expert_kwargs(cfg, head_dim: int) -> dict:
    """Per mixture-of-experts family: its router and experts, and what reaches attention differently, shrunk."""
    layers, window = cfg.num_hidden_layers, cfg.sliding_window
    experts = _experts(cfg)
    return {
        # attention sinks, every other layer slides, mixture of experts
        "gpt_oss": dict(head_dim=head_dim, sliding_window=window or 128, layer_types=alternating(layers),
                        num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=max(cfg.max_position_embeddings, 131072)),
        "qwen3_moe": dict(head_dim=head_dim, num_experts=4, **experts),
        # experts routed per token (softmax), a window on every layer where the workload gives one; router jitter off
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, **({"sliding_window": window} if window else {})),
        # experts and a sigmoid-gated shared expert on every layer, biased q/k/v
        "qwen2_moe": dict(num_experts=4, decoder_sparse_step=1, shared_expert_intermediate_size=cfg.intermediate_size // 2,
                          **experts),
        # q/k norms over the whole projection, experts on every layer
        "olmoe": dict(num_experts=4, num_experts_per_tok=2),
        # sigmoid router with a correction bias and group-limited selection, shared experts, per-head q/k norms, rotary
        # on half of each head; no load-balancing loss
        "glm4_moe": dict(n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                         use_qk_norm=True, **experts),
        # softmax router with a correction bias, shared experts; TRL's load-balancing loss on by default (0.001)
        "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1,
                             moe_intermediate_size=cfg.intermediate_size // 2),
        # sigmoid router with a correction bias, q/k norms over the projection, partial rotary; loss on by default
        "minimax_m2": dict(head_dim=head_dim, num_local_experts=4, num_experts_per_tok=2,
                           intermediate_size=cfg.intermediate_size // 2, rotary_dim=head_dim // 2),
        # multi-head latent attention: low-rank queries, keys and values from a cached latent, value heads narrower
        # than key heads (12 vs 24), rotary on part of each head (interleaved); sigmoid-routed experts
        "deepseek_v3": dict(num_key_value_heads=cfg.num_attention_heads, n_routed_experts=4, n_shared_experts=1,
                            n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, **experts),
    }


def _hybrid_kwargs(cfg, head_dim: int) -> dict:
    """Per hybrid family: its recurrent layers (Gated DeltaNet, Mamba2, short convolutions) among attention layers,
    shrunk."""
    layers = cfg.num_hidden_layers
    experts = _experts(cfg)
    return {
        # Gated DeltaNet and gated attention, experts with a shared expert; TRL's load-balancing loss on (0.001)
        "qwen3_next": dict(head_dim=head_dim, layer_types=hybrid(layers), num_experts=4, decoder_sparse_step=1,
                           shared_expert_intermediate_size=cfg.intermediate_size // 2, **experts, **_GDN),
        # Gated DeltaNet with negative eigenvalues allowed (beta up to 2), dense
        "olmo_hybrid": dict(layer_types=hybrid(layers), **_GDN),
        # Mamba2, attention without positions, and experts (sigmoid-routed, no load-balancing loss), one of each
        "nemotron_h": dict(head_dim=head_dim, num_hidden_layers=max(layers, 3),
                           layers_block_type=["linear_attention", "full_attention", "moe"] + ["mlp"] * (layers - 3),
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=cfg.intermediate_size // 2,
            moe_shared_expert_intermediate_size=cfg.intermediate_size // 2, **_MAMBA),
        # Granite 4-H: Mamba2 (its own names, a dt limit) and attention, dense MLPs here (its MoE variants trip TRL's
        # own load-balancing head, which reads num_experts), no positions
        "granitemoehybrid": dict(layer_types=hybrid(layers, "mamba"), num_local_experts=0, mamba_n_heads=4,
                                 mamba_d_head=cfg.hidden_size // 2, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
                                 mamba_chunk_size=16, time_step_limit=(0.05, 3.0), position_embedding_type="nope",
                                 router_aux_loss_coef=0.0),
        # Falcon-H1: Mamba2 beside attention in every layer, muP multipliers
        "falcon_h1": dict(head_dim=head_dim, mamba_d_ssm=cfg.hidden_size, mamba_n_heads=4,
                          mamba_d_head=cfg.hidden_size // 4,
                          mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=16,
                          ssm_in_multiplier=0.7, ssm_multipliers=[0.8, 1.3, 0.7, 1.1, 0.9]),
        # Kimi-Linear: Kimi Delta Attention (Gated DeltaNet with a decay per channel) and latent attention without
        # positions, one of each; experts (sigmoid-routed, a shared expert) on the second layer
        "kimi_linear": dict(num_key_value_heads=cfg.num_attention_heads, layer_types=hybrid(layers), linear_num_heads=2,
                            linear_head_dim=8, linear_conv_kernel_dim=4, kv_lora_rank=16, q_lora_rank=None,
                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_local_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=cfg.intermediate_size // 2,
                            mlp_layer_types=["dense"] + ["sparse"] * (layers - 1)),
        # LFM2: gated short convolutions (3 taps) among attention layers
        "lfm2": dict(layer_types=hybrid(layers, "conv"), conv_L_cache=3),
    }


def _family_kwargs(cfg, head_dim: int) -> dict:
    """What each family's real models set that reaches attention, the experts or the cache differently, shrunk."""
    families = {**_attention_kwargs(cfg, head_dim), **_expert_kwargs(cfg, head_dim), **_hybrid_kwargs(cfg, head_dim)}
    return families.get(cfg.arch, {})


@functools.cache
def ties_by_default(arch: str) -> bool:
    """Whether the family's config ties the LM head to the input embedding unless told (Gemma's, Cohere 2's, SmolLM3's,
    LFM2's, ERNIE 4.5 MoE's; of the multimodal checkpoints Gemma 3's and 4's, InternVL's, Mistral 3's, LFM2-VL's)."""
    import transformers

    return bool(getattr(transformers, ARCHITECTURES[arch])().tie_word_embeddings)


def model_config(cfg, tokenizer):
    """The family's config for the workload `cfg`, sized to `tokenizer`."""
    import transformers

    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    text = dict(
        vocab_size=len(tokenizer),  # the padded vocabulary with `vocab_size`, and a multimodal family's tokens
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if cfg.head_dim is not None:
        text["head_dim"] = head_dim
    config_class = getattr(transformers, ARCHITECTURES[cfg.arch])
    if cfg.arch not in MULTIMODAL:
        return config_class(**{**text, **_family_kwargs(cfg, head_dim)})
    # (the checkpoint's own flag ties its head: some families ignore the language model's, and Gemma's default wins
    # over it)
    return config_class(**_multimodal_kwargs(cfg, text, head_dim, tokenizer),
                        tie_word_embeddings=cfg.tie_word_embeddings)


def _multimodal_kwargs(cfg, text: dict, head_dim: int, tokenizer) -> dict:
    """A multimodal checkpoint's config: the language model as its family builds it, a tiny vision tower."""
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in image_tokens(cfg.arch)[0]}
    if cfg.arch == "gemma3_vlm":  # Gemma 3 4B and up: Gemma 3's language model, a SigLIP tower
        text.update(head_dim=head_dim, query_pre_attn_scalar=head_dim // 2, sliding_window=cfg.sliding_window or 512,
                    layer_types=alternating(cfg.num_hidden_layers))  # fmt: skip
        return dict(text_config=text, mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
                    eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"],
                    vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=16, patch_size=4))  # fmt: skip
    if cfg.arch in ("qwen2_vl", "qwen2_5_vl"):  # 3-D rotary positions (plain for text), the vision tower's merger
        text.update(rope_parameters={"rope_type": "mrope", "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
                                     "rope_theta": 10000.0})  # fmt: skip
        vision = (dict(depth=1, embed_dim=16, hidden_size=cfg.hidden_size, num_heads=2, mlp_ratio=2, patch_size=2,
                       spatial_merge_size=2, temporal_patch_size=2) if cfg.arch == "qwen2_vl" else
                  dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=cfg.hidden_size,
                       patch_size=2, spatial_merge_size=2, temporal_patch_size=2, window_size=8,
                       fullatt_block_indexes=[0]))  # fmt: skip
        return dict(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                    video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                    vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip
    if cfg.arch == "internvl":  # InternVL3: InternViT on 8x8 tiles in patches of 2 (16), pixel-shuffled by half: 4 tokens
        # per tile; Qwen2's language model
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      image_size=[8, 8], patch_size=[2, 2])  # fmt: skip
        return dict(text_config={**text, "model_type": "qwen2"}, vision_config=vision,
                    image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=4, downsample_ratio=0.5)  # fmt: skip
    if cfg.arch in ("llava", "llava_next"):  # a CLIP tower, a projector and a Llama; LLaVA-Next: tiles per image
        vision = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, image_size=LLAVA_TILE, patch_size=2, projection_dim=16)  # fmt: skip
        extra = {"image_grid_pinpoints": LLAVA_PINPOINTS} if cfg.arch == "llava_next" else {}
        return dict(text_config={**text, "model_type": "llama"}, vision_config=vision, image_token_id=ids["<image>"],
                    vision_feature_layer=-2, vision_feature_select_strategy="default", **extra)  # fmt: skip
    if cfg.arch in ("idefics3", "smolvlm"):  # a SigLIP tower on 8x8 tiles in patches of 2, pixel-shuffled by 2: 4 tokens
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                      patch_size=2)  # fmt: skip
        return dict(text_config={**text, "model_type": "llama"}, vision_config=vision, image_token_id=ids["<image>"],
                    scale_factor=2)  # fmt: skip
    if cfg.arch == "mistral3":  # Ministral 3 (`Mistral3ForConditionalGeneration`): a Pixtral tower on images of up
        # to 16 pixels a side in patches of 2, with 2-D rotary positions, its patches merged 2x2 (an 8x8 image: 4
        # tokens and a break after each row of 2); Ministral 3's language model (Mistral Small 3.1's is `mistral`)
        text.update(model_type="ministral3", head_dim=head_dim, rope_parameters=_MINISTRAL3_ROPE,
                    **({"sliding_window": cfg.sliding_window} if cfg.sliding_window else {}))  # fmt: skip
        vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, head_dim=8, patch_size=2, image_size=16)  # fmt: skip
        return dict(text_config=text, vision_config=vision, image_token_index=ids["[IMG]"], spatial_merge_size=2)
    if cfg.arch == "lfm2_vl":  # LFM2-VL: a SigLIP2 NaFlex tower (each image at its own size in patches of 2, padded to
        # 32 patches with a pixel mask, learned positions on a 4x4 grid resized to its shape), pixel-unshuffled by 2:
        # an 8x8 image is 4 tokens; LFM2's language model (gated short convolutions among attention layers)
        text.update(model_type="lfm2", layer_types=hybrid(cfg.num_hidden_layers, "conv"), conv_L_cache=3)
        vision = dict(model_type="siglip2_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, patch_size=2, num_patches=16, vision_use_head=False)  # fmt: skip
        return dict(text_config=text, vision_config=vision, image_token_id=ids["<image>"], downsample_factor=2,
                    projector_hidden_size=32)  # fmt: skip
    return _rope_index_kwargs(cfg, text, head_dim, ids)


def _rope_index_kwargs(cfg, text: dict, head_dim: int, ids: dict) -> dict:
    """[`_multimodal_kwargs`] of the families with their own position index or image blocks: Qwen3.5, Qwen3-VL, GLM-4V
    and Gemma 4."""
    if cfg.arch in ("qwen3_5", "qwen3_5_moe"):  # Qwen3.5: Gated DeltaNet and gated attention, 3-D rotary positions
        # on part of each head, interleaved (real: a quarter of 256 dims; here half of 16, sections [2, 1, 1], so that
        # an image's height and width positions reach the rotary)
        text.update(head_dim=max(head_dim, 16), layer_types=hybrid(cfg.num_hidden_layers),
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}, **_GDN)  # fmt: skip
        if cfg.arch == "qwen3_5_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=cfg.intermediate_size // 2,
                        shared_expert_intermediate_size=cfg.intermediate_size // 2)  # fmt: skip
        return dict(text_config=text, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                    vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                       out_hidden_size=cfg.hidden_size, patch_size=2, spatial_merge_size=2,
                                       temporal_patch_size=2))  # fmt: skip
    if cfg.arch in ("qwen3_vl", "qwen3_vl_moe"):  # Qwen3-VL: Qwen3's language model (q/k norms), 3-D rotary positions
        # interleaved over the head (sections [2, 1, 1] of a 16-dim head's 8 frequencies: real [24, 20, 20] of 64), and
        # DeepStack: the vision tower's features after each of its 2 layers added to the first 2 layers' hidden states
        # at the image tokens
        text.update(head_dim=max(head_dim, 16), rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "mrope_section": [4, 2, 2], "mrope_interleaved": True})
        if cfg.arch == "qwen3_vl_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=cfg.intermediate_size // 2,
                        decoder_sparse_step=1)  # fmt: skip
        return dict(text_config=text, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                    vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                    vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                                       out_hidden_size=cfg.hidden_size, patch_size=2, spatial_merge_size=2,
                                       temporal_patch_size=2, num_position_embeddings=64,
                                       deepstack_visual_indexes=[0, 1]))  # fmt: skip
    if cfg.arch == "glm4v":  # GLM-4.1V: 3-D rotary positions (GLM's own index), post-norms, a tower with learned
        # positions interpolated to each image's grid
        text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                                     "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]})  # fmt: skip
    if cfg.arch == "glm4v_moe":  # GLM-4.5V: GLM-4.5's experts (sigmoid router, a shared expert), rotary on half of a
        # 16-dim head; no load-balancing loss (with the config's 1e-4, TRL's head reads a `num_experts` the config
        # lacks: stock crashes)
        text.update(head_dim=max(head_dim, 16), n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                    router_aux_loss_coef=0.0,
                    moe_intermediate_size=cfg.intermediate_size // 2, first_k_dense_replace=1,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "mrope_section": [2, 1, 1]})  # fmt: skip
    if cfg.arch in ("glm4v", "glm4v_moe"):
        return dict(text_config=text, image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                    image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
                    video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
                    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, image_size=8,
                                       patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                                       out_hidden_size=cfg.hidden_size))  # fmt: skip
    # Gemma 4: the last layers read the keys and values of the last layer of their type before them, full layers have
    # a wider head (global_head_dim, 512 in the real models) with keys as values (attention_k_eq_v), per-layer token
    # embeddings, and image tokens that attend both ways (use_bidirectional_attention="vision"), text causal
    layers = max(cfg.num_hidden_layers, 4)  # a stored and a reusing layer of each type
    text.update(num_hidden_layers=layers, head_dim=head_dim, global_head_dim=2 * head_dim, attention_k_eq_v=True,
                num_global_key_value_heads=1, sliding_window=cfg.sliding_window or 512, layer_types=alternating(layers),
                num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=text["vocab_size"],
                use_bidirectional_attention="vision", final_logit_softcapping=None)  # fmt: skip
    return dict(text_config=text, audio_config=None, image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                audio_token_id=ids["<|audio|>"], boi_token_id=ids["<start_of_image>"],
                eoi_token_id=ids["<end_of_image>"], boa_token_id=ids["<start_of_audio>"],
                eoa_token_index=ids["<end_of_audio>"],
                vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                                   position_embedding_size=64))  # fmt: skip


def model_from_config(cfg, config, dtype: torch.dtype):
    """The model TRL would load from a checkpoint with this config: the multimodal families' `*ForConditional-
    Generation`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if cfg.arch in MULTIMODAL else AutoModelForCausalLM
    return auto.from_config(config, dtype=dtype)


def build_processor(cfg, tokenizer):
    """A multimodal family's processor: `tokenizer` (the workload's, with the family's image tokens) and the family's
    image processor (the PIL one: no torchvision here). Qwen's processors demand a video processor, which transformers
    exports only with torchvision: the test processor accepts none."""
    import transformers

    template = dict(chat_template=tokenizer.chat_template)
    if cfg.arch == "gemma3_vlm":  # 16x16 images: 16 patches of 4, pooled to 4 tokens
        return transformers.Gemma3Processor(image_processor=transformers.Gemma3ImageProcessorPil(
            size={"height": 16, "width": 16}), tokenizer=tokenizer, image_seq_length=4, **template)  # fmt: skip
    if cfg.arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"):
        processor = _without_video({"qwen2_vl": transformers.Qwen2VLProcessor,
                                    "qwen2_5_vl": transformers.Qwen2_5_VLProcessor}.get(cfg.arch,
                                                                                        transformers.Qwen3VLProcessor))
        # The tiny tower's patches of 2, merged 2x2 (an 8x8 image: a grid of 4x4 patches, 4 tokens; 148x148: 1369
        # tokens, what a 1024x1024 screenshot gives the real tower), small images kept, up to 4M pixels
        image_processor = transformers.Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2,
                                                                size={"shortest_edge": 16, "longest_edge": 1 << 22})
        return processor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, **template)
    if cfg.arch in ("glm4v", "glm4v_moe"):  # the tiny tower's patches of 2, merged 2x2, as Qwen's above
        image_processor = transformers.Glm4vImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2,
                                                              size={"shortest_edge": 16, "longest_edge": 1 << 22})
        return _without_video(transformers.Glm4vProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                          video_processor=None, **template)  # fmt: skip
    if cfg.arch == "internvl":  # each image cropped to tiles of 8 (a 16x8 image: 2 and a thumbnail), 4 tokens a tile
        image_processor = transformers.GotOcr2ImageProcessorPil(size={"height": 8, "width": 8}, crop_to_patches=True,
                                                                min_patches=1, max_patches=4)  # fmt: skip
        return _without_video(transformers.InternVLProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                             video_processor=None, image_seq_length=4, **template)
    if cfg.arch in ("llava", "llava_next"):  # CLS dropped ("default"): (8 / 2)^2 = 16 tokens per image or tile
        size = dict(size={"shortest_edge": LLAVA_TILE}, crop_size={"height": LLAVA_TILE, "width": LLAVA_TILE})
        if cfg.arch == "llava":
            image_processor, processor = transformers.CLIPImageProcessorPil(**size), transformers.LlavaProcessor
        else:
            image_processor = transformers.LlavaNextImageProcessorPil(**size, image_grid_pinpoints=LLAVA_PINPOINTS)
            processor = transformers.LlavaNextProcessor
        return processor(image_processor=image_processor, tokenizer=tokenizer, patch_size=2,
                         vision_feature_select_strategy="default", num_additional_image_tokens=1, **template)
    if cfg.arch in ("idefics3", "smolvlm"):  # tiles of 8 pixels (4 tokens each) and the whole image, at most 16 a side
        size = dict(size={"longest_edge": 16}, max_image_size={"longest_edge": 8})
        if cfg.arch == "idefics3":
            return transformers.Idefics3Processor(image_processor=transformers.Idefics3ImageProcessorPil(**size),
                                                  tokenizer=tokenizer, image_seq_len=4, **template)  # fmt: skip
        processor = _without_video(transformers.SmolVLMProcessor)(
            image_processor=transformers.SmolVLMImageProcessorPil(**size), tokenizer=tokenizer, video_processor=None,
            image_seq_len=4, **template)  # fmt: skip
        # Its apply_chat_template reads the video sampling defaults even for images (SmolVLM's: 64 frames at 1 fps)
        processor.video_processor = types.SimpleNamespace(num_frames=64, fps=1)
        return processor
    if cfg.arch == "mistral3":  # Pixtral's sizes: at most 16 pixels a side, in multiples of a merged patch (4)
        return _pixtral_processor()(image_processor=transformers.PixtralImageProcessorPil(size={"longest_edge": 16}),
                                    tokenizer=tokenizer, patch_size=2, spatial_merge_size=2, **template)  # fmt: skip
    if cfg.arch == "lfm2_vl":
        return transformers.Lfm2VlProcessor(image_processor=lfm2_vl_image_processor(), tokenizer=tokenizer,
                                            **template)  # fmt: skip
    from transformers.models.gemma4 import feature_extraction_gemma4, image_processing_pil_gemma4

    return _without_video(transformers.Gemma4Processor)(
        feature_extractor=feature_extraction_gemma4.Gemma4AudioFeatureExtractor(),
        image_processor=image_processing_pil_gemma4.Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2,
                                                                            max_soft_tokens=70),
        tokenizer=tokenizer, video_processor=None, image_seq_length=4, **template,
    )  # fmt: skip


def _without_video(processor_class):
    """`processor_class` accepting `video_processor=None`: `ProcessorMixin` type-checks every part against
    `VideoProcessorMixin`, which transformers exports only with torchvision."""

    class Processor(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return type(None)
            return super().check_argument_for_proper_class(argument_name, argument)

    Processor.__name__ = Processor.__qualname__ = processor_class.__name__
    return Processor


def _pixtral_processor():
    """transformers' `PixtralProcessor` (Mistral 3's). Its export requires torchvision, and its module imports the
    torchvision image processor for one helper it reads only to count a serving request's tokens
    (`_get_num_multimodal_tokens`): the module is imported as without PIL, which skips that import alone."""
    import importlib
    import sys
    from unittest import mock

    name = "transformers.models.pixtral.processing_pixtral"
    if name not in sys.modules:
        with mock.patch("transformers.utils.is_vision_available", return_value=False):
            importlib.import_module(name)
    return sys.modules[name].PixtralProcessor


def lfm2_vl_image_processor():
    """
    LFM2-VL's image processor on PIL (transformers has only a torchvision one), as the tiny tower's: patches of 2, 2x2
    of them one token, 4 to 8 tokens an image. Each image is resized as `Lfm2VlImageProcessor.smart_resize` sizes it
    (sides in multiples of 4: the 8x8 and 16x8 test images keep theirs, whose pixel values are then the real one's),
    cut into patches and padded to 32 of them (`pixel_values`, `pixel_attention_mask`, `spatial_shapes`: one entry per
    image). Images are not split into tiles (`do_image_splitting=False`; the real processor splits only an image over
    twice its token budget).
    """
    import math

    import numpy as np
    from transformers import Siglip2ImageProcessorPil
    from transformers.image_processing_utils import BatchFeature
    from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, SizeDict
    from transformers.models.siglip2.image_processing_pil_siglip2 import convert_image_to_patches, pad_along_first_dim
    from transformers.processing_utils import ImagesKwargs

    class Lfm2VlImageProcessorKwargs(ImagesKwargs, total=False):  # what Lfm2VlProcessor and TRL pass
        downsample_factor: int
        do_image_splitting: bool
        min_tiles: int
        max_tiles: int
        use_thumbnail: bool
        min_image_tokens: int
        max_image_tokens: int
        encoder_patch_size: int
        tile_size: int
        max_pixels_tolerance: float
        return_row_col_info: bool

    class Lfm2VlImageProcessorPil(Siglip2ImageProcessorPil):
        valid_kwargs = Lfm2VlImageProcessorKwargs
        image_mean, image_std = IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
        downsample_factor, encoder_patch_size, min_image_tokens, max_image_tokens = 2, 2, 4, 8
        do_image_splitting, min_tiles, max_tiles, use_thumbnail, tile_size = False, 1, 1, True, 8
        max_pixels_tolerance, return_row_col_info = 2.0, False

        def _preprocess(self, images, resample, do_rescale, rescale_factor, do_normalize, image_mean, image_std,
                        return_tensors, downsample_factor, encoder_patch_size, min_image_tokens, max_image_tokens,
                        return_row_col_info=False, **kwargs):  # fmt: skip
            factor, patch = downsample_factor, encoder_patch_size
            total, max_patches = patch * factor, max_image_tokens * factor**2
            low, high = (tokens * patch**2 * factor**2 for tokens in (min_image_tokens, max_image_tokens))
            data = {"pixel_values": [], "pixel_attention_mask": [], "spatial_shapes": [], "image_sizes": []}
            for image in images:  # (C, H, W)
                height, width = image.shape[-2:]
                # Lfm2VlImageProcessor.smart_resize (transformers 5.24)
                h_bar, w_bar = (max(total, round(side / total) * total) for side in (height, width))
                if h_bar * w_bar > high:
                    beta = math.sqrt(height * width / high)
                    h_bar, w_bar = (max(total, math.floor(side / beta / total) * total) for side in (height, width))
                elif h_bar * w_bar < low:
                    beta = math.sqrt(low / (height * width))
                    h_bar, w_bar = (math.ceil(side * beta / total) * total for side in (height, width))
                if (h_bar, w_bar) != (height, width):  # PIL's bilinear, where the real one resizes with torchvision's
                    image = self.resize(image=image, size=SizeDict(height=h_bar, width=w_bar), resample=resample)
                if do_rescale and do_normalize:  # fused as the torchvision backend fuses them: the same float32 values
                    image = self.normalize(image.astype(np.float32), [m * (1.0 / rescale_factor) for m in image_mean],
                                           [s * (1.0 / rescale_factor) for s in image_std])  # fmt: skip
                elif do_rescale:
                    image = self.rescale(image, rescale_factor)
                elif do_normalize:
                    image = self.normalize(image, image_mean, image_std)
                patches, mask = pad_along_first_dim(convert_image_to_patches(image, patch), max_patches)
                data["pixel_values"].append(patches)
                data["pixel_attention_mask"].append(mask)
                data["spatial_shapes"].append((h_bar // patch, w_bar // patch))
                data["image_sizes"].append([h_bar, w_bar])
            if return_row_col_info:  # one tile each
                data.update(image_rows=[1] * len(images), image_cols=[1] * len(images))
            else:
                del data["image_sizes"]
            return BatchFeature(data=data, tensor_type=return_tensors)

    return Lfm2VlImageProcessorPil()
