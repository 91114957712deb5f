"""
Why a `generate` call, or its decoding loop, cannot run from static buffers ([`generation.static_decode`]): each check
returns a reason (the warning's words) or None, and a call with a reason runs `generate`'s own loop, with one warning
naming it ([`warn_off`]). Also what a static step reproduces of `generate`'s per-step inputs ([`ZERO_GROWN`],
[`FIRST_STEP_TYPES`]) and which attention implementations take its prepared mask ([`PREPARED_MASKS`]).
"""

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerationMixin


try:  # the image inputs `generate`'s own input preparation passes to the prefill alone (transformers 5)
    from transformers.generation.utils import MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL
except ImportError:  # pragma: no cover - older transformers: every such input is a per-step one
    MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL = ()

from ..once import WarnOnce
from ..transformers_compat import CACHE_KWARG
from .prompt_cache import PrefixCache, PrefixLayer
from .static_buffers import EMPTY_LAYERS, FIXED_LAYERS, HYBRID_LAYERS, KV_LAYERS, filled_positions, layer_windows


# Attention implementations that take a prepared 4-D mask as it is: boolean (True attends) for SDPA, additive for
# eager. Flash attention and the Hub's kernels read a 2-D mask or none
PREPARED_MASKS = {"sdpa": "bool", "eager": "additive"}
# What `generate` hands its decoding loop that one static step reproduces (the rest: another loop's, or a model's own)
_STEP_INPUTS = {"attention_mask", "position_ids", "logits_to_keep", CACHE_KWARG, "use_cache",
                *MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL}
# Causal LMs whose own `prepare_inputs_for_generation` is `generate`'s until a sequence first reaches the config's
# `original_max_position_embeddings` + 1, where it drops the cache (to forward every row again with LongRoPE's long
# factors): Phi-3's family. Within that context, static decoding is exact
_OWN_INPUTS_PAST_CONTEXT = ("Phi3ForCausalLM",)
# Causal LMs whose own `prepare_inputs_for_generation` is `generate`'s but for `logits_to_keep`, which a step of one
# token does not change (Falcon-H1's, from its config)
_OWN_LOGITS_TO_KEEP = ("FalconH1ForCausalLM",)
# Models whose own `prepare_inputs_for_generation` is `generate`'s but for image token types it hands the first step
# alone (the whole sequence's, for the bidirectional mask among an image's tokens, which a text token's query does not
# read: the step's query is the prompt's last token, never an image's, then generated text) and drops after it: the
# step's prepared mask is the same, and these inputs are not passed
FIRST_STEP_TYPES = {"Gemma3ForConditionalGeneration": ("token_type_ids",),
                    "Gemma4ForConditionalGeneration": ("mm_token_type_ids", "per_layer_inputs")}
# Per-step inputs `generate` grows by a column of zeros each step (`_update_model_kwargs_for_generation`): a step's
# value is the prompt's last column at the first step, zeros after it
ZERO_GROWN = ("mm_token_type_ids",)
_warnings = WarnOnce()  # static decoding's reasons, once per process


def static_call_reason(generation_config, synced: bool, kwargs: dict) -> str | None:
    """
    Why a `generate` call with these keyword arguments must not be handed [`generation.static_decode.static_sample`], or
    None: `generate` gives a `custom_generate` callable neither `synced_gpus` nor a streamer (only the parameters its
    signature adds to `_sample`'s), and runs it in place of every decoding mode. `synced`: every forward gathers
    parameters from all ranks (ZeRO-3, FSDP), so that ranks must decode in step.
    """
    if synced or kwargs.get("synced_gpus"):
        return "ranks decode in step (synced_gpus: ZeRO-3 or FSDP)"
    if kwargs.get("streamer") is not None:
        return "a streamer reads every token on the host"
    if kwargs.get("assistant_model") is not None or kwargs.get("custom_generate") is not None:
        return "generate decodes another way (an assistant model or a custom_generate)"
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH):
        return f"generation mode {mode.name.lower()}"
    return None


def static_decode_reason(model: nn.Module, input_ids: torch.Tensor, stopping_criteria, generation_config,
                         model_kwargs: dict) -> str | None:  # fmt: skip
    """Why [`generation.static_decode.static_sample`] would not reproduce `generate`'s loop for this call, or None."""
    if dropout_active(model):
        return "dropout is active (share_under_dropout): each step draws its masks, which a replay would not check"
    if generation_config.return_dict_in_generate and (generation_config.output_attentions or
                                                      generation_config.output_hidden_states):  # fmt: skip
        return "generate returns attentions or hidden states"
    others = sorted({type(criterion).__name__ for criterion in stopping_criteria
                     if not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria))})  # fmt: skip
    if others:
        return f"stopping criteria other than length and EOS ({', '.join(others)})"
    owner = inputs_owner(model)
    if extra := sorted(set(model_kwargs) - _STEP_INPUTS - {*ZERO_GROWN, *FIRST_STEP_TYPES.get(owner, ())}):
        return f"the model takes per-step inputs ({', '.join(extra)})"
    if owner in _OWN_INPUTS_PAST_CONTEXT:
        limit = getattr(model.config, "original_max_position_embeddings", None)
        if limit is not None and (stopping_criteria.max_length or limit + 1) > limit:
            return (f"{type(model).__name__} drops its cache when a sequence passes its original context ({limit} "
                    f"positions)")  # fmt: skip
    elif owner not in (*FIRST_STEP_TYPES, *_OWN_LOGITS_TO_KEEP) and (
            type(model).prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation):
        return f"{type(model).__name__} prepares its own decoding inputs (prepare_inputs_for_generation)"
    implementation = model.config._attn_implementation
    if implementation not in PREPARED_MASKS:
        return f"attn_implementation={implementation!r} takes no prepared 4-D mask"
    cache = model_kwargs.get(CACHE_KWARG)
    width = input_ids.shape[1]
    if not isinstance(cache, Cache) or not cache.layers:
        return "generate prefills its own cache"
    if isinstance(cache, PrefixCache):  # the prompt kept once per group: the rows' own keys in static buffers
        if reason := kept_once_reason(model, [type(layer) for layer in cache.layers]):
            return reason
        if any(layer.own_length or layer.prefix_columns != width - 1 for layer in cache.layers
               if type(layer) is PrefixLayer):  # fmt: skip
            return "the cache does not hold every prompt column but the last"
        return None
    kinds = sorted({type(layer).__name__ for layer in cache.layers
                    if type(layer) not in (*KV_LAYERS, *FIXED_LAYERS, *EMPTY_LAYERS, *HYBRID_LAYERS)})  # fmt: skip
    if kinds:
        return f"its cache has layers other than keys and values ({', '.join(kinds)})"
    if any(window is not None for window in layer_windows(model)):
        types = set(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or [])
        if not types <= {"full_attention", "sliding_attention"}:
            return f"its layers' attention types ({', '.join(sorted(types))}) are not full and sliding alone"
    if any(layer.keys is None or filled_positions(layer) != width - 1 for layer in cache.layers
           if type(layer) in (*KV_LAYERS, *HYBRID_LAYERS)):  # fmt: skip
        return "the cache does not hold every prompt column but the last"
    if model_kwargs.get("position_ids") is None:
        return "generate passed no position ids"
    return None


def dropout_active(model: nn.Module) -> bool:
    """Whether a forward of `model` now draws dropout masks (a dropout module with p > 0, in training mode)."""
    return model.training and any(isinstance(module, nn.Dropout) and module.p > 0 for module in model.modules())


def kept_once_reason(model: nn.Module, layer_types: list[type]) -> str | None:
    """Why a cache keeping the prompt once with layers of `layer_types` cannot be decoded from static buffers, or
    None."""
    kinds = sorted({kind.__name__ for kind in layer_types if kind not in (PrefixLayer, *FIXED_LAYERS)})
    if kinds:
        return f"its cache kept once has layers other than keys and values ({', '.join(kinds)})"
    if any(window is not None for window in layer_windows(model)):  # a tool loop's cache keeps whole windows
        return "a sliding window over the prompt kept once is masked from the host's count of positions"
    return None


def inputs_owner(model: nn.Module) -> str:
    """The name of the class whose `prepare_inputs_for_generation` `model` runs."""
    return type(model).prepare_inputs_for_generation.__qualname__.split(".")[0]


def warn_off(reason: str) -> None:
    """One warning per reason that static decoding is off."""
    _warnings.warn(f"rloo_efficient: static decoding is off for this call, generate decodes: {reason}.", key=reason,
                   stacklevel=2)  # fmt: skip
