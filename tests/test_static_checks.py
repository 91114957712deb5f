"""Why a `generate` call cannot decode from static buffers ([`core.generation.static_checks`])."""

import pytest

from rloo_efficient.core.generation import static_checks

from .helpers import generation_config


@pytest.mark.parametrize("kwargs, config, reason", [
    (dict(synced=True), {}, "ranks decode in step"),
    (dict(streamer=object()), {}, "a streamer"),
    (dict(assistant_model=object()), {}, "an assistant model"),
    ({}, dict(do_sample=False, num_beams=2), "generation mode beam_search"),
])  # fmt: skip
def test_calls_static_decoding_cannot_take(kwargs, config, reason):
    """What `generate` would not hand a `custom_generate` (ranks kept in step, a streamer) or runs in place of another
    decoding mode (an assistant's, beam search's)."""
    synced = kwargs.pop("synced", False)
    assert reason in static_checks.static_call_reason(generation_config(**config), synced, kwargs)
    assert static_checks.static_call_reason(generation_config(do_sample=False), False, {}) is None


@pytest.mark.parametrize("arch, layers, reason", [
    ("llama", ["PrefixLayer"], None),
    ("llama", ["PrefixLayer", "LinearAttentionLayer"], None),  # a hybrid's recurrent states, updated in place
    ("llama", ["PrefixLayer", "DynamicLayer"], "layers other than keys and values (DynamicLayer)"),
    ("gemma3_sliding", ["PrefixLayer"], "a sliding window over the prompt kept once"),
])  # fmt: skip
def test_a_prompt_kept_once_decodes_static_with_key_and_value_layers_and_no_window(arch, layers, reason):
    """A cache keeping the prompt once decodes from static buffers when every layer holds keys and values (or fixed
    recurrent states) and no layer's window masks the prompt: its positions are counted on the host."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    from rloo_efficient.core.generation.prompt_cache import PrefixLayer

    from .helpers import build

    kinds = {"PrefixLayer": PrefixLayer, "DynamicLayer": DynamicLayer, "LinearAttentionLayer": LinearAttentionLayer}
    found = static_checks.kept_once_reason(build(arch), [kinds[name] for name in layers])
    assert found is None if reason is None else reason in found
