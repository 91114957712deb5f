"""Why a `generate` call cannot decode from static buffers ([`core.generation.static_checks`])."""

import pytest
import torch

from rloo_efficient.core.generation import static_checks
from rloo_efficient.core.transformers_compat import CACHE_KWARG

from .helpers import build, generation_config, left_pad


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


def test_a_cache_holding_the_whole_prompt_is_refused():
    """A cache handed to `static_sample` must hold the prompt's columns but the last (the step writes at W - 1): one
    holding all W is refused with a reason, not padded by a negative width (cropped). Catches the
    `filled_positions(layer) != width - 1` check dropped."""
    from transformers import DynamicCache
    from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

    model = build("llama")
    ids, mask = left_pad([[5, 9, 13, 17, 21, 25]] * 2)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{CACHE_KWARG: cache})  # all W columns
    position_ids = mask.cumsum(-1) - 1
    criteria = StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 4)])
    reason = static_checks.static_decode_reason(model, ids, criteria, generation_config(),
                                                {CACHE_KWARG: cache, "attention_mask": mask,
                                                 "position_ids": position_ids, "use_cache": True})  # fmt: skip
    assert reason is not None and "every prompt column but the last" in reason
