"""
Which models each phase can share exactly, and why the others cannot: the one list of tested families
([`MODEL_TYPES`]) and the reasons that turn a phase back to stock's path (each named in one warning by the trainer).
"""

from torch import nn

from .prefix_attention import _attention_modules


# Families whose attention modules hand the interface scaled dot-product attention over queries (B, H, L, D) and keys
# and values (B, Hkv, L, D) once rotary embeddings and q/k norms are applied, with positions from `position_ids` only,
# and at most a sliding window (kwarg `sliding_window`: keys in (p - w, p]) and attention sinks (kwarg `s_aux`, one
# logit per head): read from each family's modeling code (transformers 5.23), and each listed only with an
# equivalence test against stock TRL in the suite
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "olmo2", "smollm3", "granite", "qwen3_moe",
               "gpt_oss")


def forward_unsupported_reason(model: nn.Module) -> str | None:
    """Why the packed forward cannot reproduce stock TRL's log-probs for `model`, or None when it can."""
    text_config = model.config.get_text_config()
    if is_multimodal(model):
        return f"{type(model).__name__} is multimodal; its image tokens are not packed"
    if getattr(text_config, "rope_parameters", None) is None and getattr(text_config, "rope_theta", None) is None:
        return (
            f"{text_config.model_type} has no rotary position embeddings; with absolute positions, stock TRL's "
            f"left padding shifts every token's position, which a packed row cannot reproduce"
        )
    return attention_reason(model) or rope_reason(model) or dropout_reason(model)


def rope_reason(model: nn.Module) -> str | None:
    """
    Rotary embeddings whose frequencies depend on the longest position in the call ("dynamic" NTK scaling, "longrope")
    are not the same for a packed sequence (or a prefill one token shorter) as for stock TRL's padded rows.
    """
    text_config = model.config.get_text_config()
    parameters = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    found = [parameters] if "rope_type" in parameters else [p for p in parameters.values() if isinstance(p, dict)]
    for params in found:
        rope_type = params.get("rope_type") or params.get("type") or ""
        if "dynamic" in rope_type or rope_type == "longrope":
            return f"its rotary embedding ({rope_type!r}) changes with the longest position in each forward"
    return None


def dropout_reason(model: nn.Module) -> str | None:
    """Active dropout draws a mask per token: a shared forward would draw different ones than stock TRL."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            return (
                f"dropout is active ({name}, p={module.p}); shared rows draw different dropout masks "
                f"(set disable_dropout=True)"
            )
    text_config = model.config.get_text_config()
    for key in ("attention_dropout", "hidden_dropout", "dropout"):
        if (getattr(text_config, key, 0.0) or 0.0) > 0:
            return f"dropout is active ({key}={getattr(text_config, key)}); set disable_dropout=True"
    return None


def is_multimodal(model: nn.Module) -> bool:
    config = model.config
    return config.get_text_config() is not config or getattr(config, "vision_config", None) is not None


def attention_reason(model: nn.Module) -> str | None:
    """Why [`prefix_attention.prefix_attention`] cannot stand in for `model`'s attention, or None when it can."""
    text_config = model.config.get_text_config()
    model_type = text_config.model_type
    if model_type not in MODEL_TYPES:
        return f"its attention is only verified for {', '.join(MODEL_TYPES)}, not {model_type}"
    if getattr(text_config, "use_bidirectional_attention", False):
        return "its attention is bidirectional (use_bidirectional_attention=True), not causal"
    if not any(True for _ in _attention_modules(model)):
        return f"none of {type(model).__name__}'s modules is an attention module of the shape it expects"
    return None
