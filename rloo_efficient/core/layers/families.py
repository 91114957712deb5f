"""
Which models each phase can share exactly, and why the others cannot: the one list of tested families
([`MODEL_TYPES`]) and the reasons that turn a phase back to stock's path (each named in one warning by the trainer).
"""

from torch import nn

from ..attention.backend import _attention_modules
from .recurrent import recurrent_layers
from .rope import longrope_modules, pinnable


# The one list every sharing path follows (the packed forwards, the shared prefill, the once-per-group prompt cache,
# reward packing), by the text model's `model_type` (a multimodal checkpoint's language model included): families
# whose attention modules hand the interface scaled dot-product attention over queries (B, H, L, D) and keys and values
# (B, Hkv, L, D) once rotary embeddings and q/k norms are applied, with positions from `position_ids` only, and at most
# a sliding window (kwarg `sliding_window`: keys in (p - w, p]) and attention sinks (kwarg `s_aux`, one logit per
# head). Each was read in its modeling code (transformers 5.23 and 5.24), and is listed only with its tests against stock TRL
# and plain `generate` in the suite. What each brings is in the README's families table.
MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "olmo2", "smollm3", "granite", "qwen3_moe", "gpt_oss",
    "gemma4_text",  # Gemma 4: layers reusing another layer's keys and values, k = v, a 512-dim global head
    "glm4_moe", "cohere2", "olmo3", "ernie4_5_moe", "minimax_m2", "seed_oss",
    "mixtral", "qwen2_moe", "olmoe",  # experts per token (softmax routers; Qwen2-MoE's shared expert), Mixtral's windows
    "exaone4", "ministral",  # windows on some layers (EXAONE 4's full layers without rotary)
    "gemma2",  # attention logits capped (kwarg `softcap`: the math path, as stock's eager attention)
    "ministral3",  # queries scaled by their position (Llama 4's scaling), from position_ids like the rotary
    "deepseek_v3",  # multi-head latent attention: value heads narrower than key heads; latents cached
    "qwen2_vl_text", "qwen2_5_vl_text",  # Qwen2-VL and Qwen2.5-VL's language models (image batches: vision.py)
    "qwen3_vl_text", "qwen3_vl_moe_text",  # Qwen3-VL's: interleaved 3-D rotary, DeepStack features at image tokens
    "glm4v_text", "glm4v_moe_text",  # GLM-4.1V and GLM-4.5V's: 3-D rotary (GLM's own index), post-norms
    # Hybrids: recurrent layers forked along the prefix tree (recurrent.py) among attention layers
    "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid",  # Gated DeltaNet
    "nemotron_h", "granitemoehybrid", "falcon_h1",  # Mamba2 (Nemotron-H and Granite 4-H: attention without positions)
    "lfm2",  # gated short convolutions
    "kimi_linear",  # Kimi Delta Attention (a decay per channel) and latent attention
)  # fmt: skip
# Module attributes through which modeling code applies dropout as a function call (Seed-OSS's residual dropout is
# read from the config into each module when it is built: neither an nn.Dropout nor undone by TRL's disable_dropout)
DROPOUT_ATTRIBUTES = ("attention_dropout", "residual_dropout", "hidden_dropout", "dropout")


def family_reason(model: nn.Module) -> str | None:
    """Why `model`'s family is not one every sharing path is tested for ([`MODEL_TYPES`]), or None."""
    model_type = model.config.get_text_config().model_type
    if model_type not in MODEL_TYPES:
        return f"sharing is only verified for {', '.join(MODEL_TYPES)}, not {model_type}"
    return None


def forward_unsupported_reason(model: nn.Module, shared_masks: bool = False) -> str | None:
    """Why the packed forward cannot reproduce stock TRL's log-probs for `model`, or None when it can. A multimodal
    checkpoint's language model shares text batches, and image batches where [`layers.vision.vision_reason`] allows. (A
    family with absolute positions, whose left padding shifts every token's position in stock's rows, is not on the
    list; listed families have rotary positions or none at all.) `shared_masks`: see [`dropout_reason`]."""
    return (attention_reason(model) or rope_reason(model) or dropout_reason(model, shared_masks)
            or recurrent_reason(model) or jitter_reason(model))  # fmt: skip


def recurrent_reason(model: nn.Module) -> str | None:
    """
    A recurrent layer whose input projection has a bias (Nemotron-H's `use_bias`, Granite 4-H's and Falcon-H1's
    `mamba_proj_bias`, LFM2's `conv_bias`): stock's left padding is zeroed before that projection, so each pad enters
    the layer's convolution as the bias and reaches the row's first tokens, which a row without padding cannot give.
    """
    for module, _ in recurrent_layers(model):
        if getattr(getattr(module, "in_proj", None), "bias", None) is not None:
            return (f"its recurrent layers' input projection has a bias ({type(module).__name__}): stock's left padding "
                    "reaches their convolution as that bias")  # fmt: skip
    return None


def jitter_reason(model: nn.Module) -> str | None:
    """A MoE router with jitter multiplies each token by fresh noise in training: a shared token would draw once where
    stock's rows draw once per copy, and every later draw would move."""
    jitter = [getattr(model.config.get_text_config(), "router_jitter_noise", 0) or 0]
    jitter += [value for module in model.modules() if isinstance(value := getattr(module, "jitter_noise", 0), float)]
    if max(jitter) > 0:
        return (f"its router adds random jitter in training (router_jitter_noise={max(jitter)}); shared tokens would "
                "draw other noise than stock's rows")  # fmt: skip
    return None


def rope_reason(model: nn.Module) -> str | None:
    """
    Rotary embeddings whose frequencies depend on the longest position in the call ("dynamic" NTK scaling, which also
    keeps the longest it has seen) are not the same for a packed sequence (or a prefill one token shorter) as for stock
    TRL's padded rows. LongRoPE's choice each of our calls makes as its stock call does ([`rope.rope_length`]), where
    one rope type serves every layer.
    """
    text_config = model.config.get_text_config()
    parameters = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    found = [parameters] if "rope_type" in parameters else [p for p in parameters.values() if isinstance(p, dict)]
    for params in found:
        rope_type = params.get("rope_type") or params.get("type") or ""
        pinned = rope_type == "longrope" and "rope_type" in parameters and longrope_modules(model) and pinnable(model)
        if "dynamic" in rope_type or (rope_type == "longrope" and not pinned):
            return f"its rotary embedding ({rope_type!r}) changes with the longest position in each forward"
    return None


def position_period(model: nn.Module) -> int | None:
    """Llama 4's attention scaling (Ministral 3): queries scaled by `1 + beta * log(1 + floor(position / period))`, so
    that a position counts beyond its differences with the others once a row reaches `period`. The period, or None."""
    parameters = getattr(model.config.get_text_config(), "rope_parameters", None) or {}
    if parameters.get("llama_4_scaling_beta"):
        return int(parameters["original_max_position_embeddings"])
    return None


SHARE_UNDER_DROPOUT = ("or share_under_dropout=True (--share_under_dropout true) to share with one dropout mask per "
                       "shared token, each row's masks distributed as stock's")


def dropout_reason(model: nn.Module, shared_masks: bool = False) -> str | None:
    """Active dropout draws a mask per token: a shared forward would draw different ones than stock TRL. With
    `shared_masks` (`share_under_dropout`), dropout modules are taken as they are: a token forwarded once draws one
    mask for every row holding it (each row's mask distributed as stock's, the rows' masks no longer independent);
    dropout applied as a function (attention probabilities') is still a reason: ours' attention has none."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0 and not shared_masks:
            if ".lora_dropout." in f".{name}.":  # PEFT's LoRA: TRL's ModelConfig gives it 0.05 unless told otherwise
                return (f"LoRA's dropout is active ({name}, p={module.p}); shared rows draw different dropout masks "
                        f"(set disable_dropout=True (--disable_dropout true), or lora_dropout=0 in the LoRA config "
                        f"(--lora_dropout 0), {SHARE_UNDER_DROPOUT})")  # fmt: skip
            return (f"dropout is active ({name}, p={module.p}); shared rows draw different dropout masks "
                    f"(set disable_dropout=True (--disable_dropout true), {SHARE_UNDER_DROPOUT})")  # fmt: skip
        for key in DROPOUT_ATTRIBUTES:
            value = getattr(module, key, None)
            if isinstance(value, float) and value > 0:
                return (f"dropout is active ({name}.{key}={value}, applied as a function); load the model with "
                        f"{key}=0.0")  # fmt: skip
    if shared_masks:  # the config's dropout rates reach the model as the modules and attributes checked above
        return None
    text_config = model.config.get_text_config()
    for key in DROPOUT_ATTRIBUTES:
        value = getattr(text_config, key, 0.0)
        if isinstance(value, float) and value > 0:
            return f"dropout is active ({key}={value}); set disable_dropout=True or load the model with {key}=0.0"
    return None


def is_multimodal(model: nn.Module) -> bool:
    config = model.config
    return config.get_text_config() is not config or getattr(config, "vision_config", None) is not None


def attention_reason(model: nn.Module) -> str | None:
    """Why [`attention.backend.prefix_attention`] cannot stand in for `model`'s attention, or None when it can."""
    reason = family_reason(model)
    if reason is not None:
        return reason
    text_config = model.config.get_text_config()
    # Gemma 3's embedding variants attend both ways everywhere; Gemma 4's "vision" does so among image tokens only,
    # which the bodies' image blocks give the packed attention ([`layers.vision.body_blocks`])
    if getattr(text_config, "use_bidirectional_attention", None) in (True, "all"):
        return f"its attention is bidirectional (use_bidirectional_attention={text_config.use_bidirectional_attention!r}), not causal"
    if not any(True for _ in _attention_modules(model)):
        return f"none of {type(model).__name__}'s modules is an attention module of the shape it expects"
    return None
