"""
Each model family, shrunk and built offline from its own config class (transformers 5.23 and 5.24), so that its own modeling
code runs: its attention module, its cache layers, its router. What reaches attention differently in the real models is
kept (windows, sinks, q/k norms, partial rotary, shared keys and values, latent attention, experts). Multimodal
families are built as their `*ForConditionalGeneration` checkpoints are (a tiny vision tower beside the language
model), with a processor made of the workload's byte tokenizer and the family's image processor
([`demo.tiny_processors`]).
"""

import functools

import torch

# (build_processor and lfm2_vl_image_processor were this module's until 2026-12-07: still here for the deprecated name
# rloo_efficient.tiny_models, which is this module)
from .tiny_processors import LLAVA_PINPOINTS, LLAVA_TILE, build_processor, lfm2_vl_image_processor  # noqa: F401


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
