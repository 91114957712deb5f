"""The names that differ between the transformers releases we support (5.23 to 5.25), in one place."""

import inspect

from transformers import GenerationMixin


# transformers 5.24 renamed the `past_key_values` of every model's forward, of `generate`, of the mask builders and of
# model outputs to `cache` (the old name still works in 5.24, with a warning; 5.23 ignores `cache=` in a forward and
# refuses it in `generate`): the name must follow the installed release
CACHE_KWARG = ("cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
               else "past_key_values")  # fmt: skip


def output_cache(output):
    """The cache a model's or `generate`'s output holds."""
    return getattr(output, CACHE_KWARG)
