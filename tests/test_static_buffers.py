"""A prefilled cache turned into static buffers ([`core.generation.static_buffers.static_cache`]): each layer's filled
columns where the model wrote them, zeros elsewhere, a deferred fan-out gathered into the buffers."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from rloo_efficient.core.generation.static_buffers import (
    StaticLayer,
    defer_fan_out,
    deferred_rows,
    layer_tensors,
    static_cache,
)


# Two distinct prompts (a deferred fan-out's), 2 heads, 5 prefilled columns, head size 3; a full layer and a sliding one
# whose window (3) kept its last 2 columns; 8 columns in the buffers (5 prefilled, 3 to decode)
PROMPTS, HEADS, FILLED, SIZE, WINDOW, COLUMNS = 2, 2, 5, 3, 3, 8


def prefilled() -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """A cache of a full and a sliding layer prefilled with distinct values, and the keys and values written."""
    keys = torch.arange(PROMPTS * HEADS * FILLED * SIZE, dtype=torch.float32).view(PROMPTS, HEADS, FILLED, SIZE) + 1
    values = -keys
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=WINDOW)]
    for layer in cache.layers:
        layer.update(keys, values)
    return cache, keys, values


@pytest.mark.parametrize("rows", [None, [1, 0, 0, 1, 1]])
def test_each_layers_filled_columns_sit_where_they_were_written_and_the_rest_are_zero(rows):
    """Fails with a sliding layer's kept columns copied to the buffers' start, or a deferred fan-out not gathered."""
    cache, keys, values = prefilled()
    index = torch.tensor(rows) if rows is not None else torch.arange(PROMPTS)
    if rows is not None:
        cache = defer_fan_out(cache, rows, "cpu")
    column, length = torch.tensor([FILLED]), [FILLED]
    static = static_cache(cache, COLUMNS, column, length, [None, WINDOW], deferred_rows(cache))
    full, sliding = static.layers
    assert type(full) is type(sliding) is StaticLayer and deferred_rows(static) is None  # (taken: asked once)
    for buffer, written in ((full.keys, keys), (full.values, values)):
        assert buffer.shape == (len(index), HEADS, COLUMNS, SIZE)
        torch.testing.assert_close(buffer[..., :FILLED, :], written[index], rtol=0, atol=0)
        assert not buffer[..., FILLED:, :].any()
    kept = WINDOW - 1  # the last columns a sliding layer keeps, at their positions in the prompt
    for buffer, written in ((sliding.keys, keys), (sliding.values, values)):
        torch.testing.assert_close(buffer[..., FILLED - kept : FILLED, :], written[index][..., -kept:, :],
                                   rtol=0, atol=0)  # fmt: skip
        assert not buffer[..., : FILLED - kept, :].any() and not buffer[..., FILLED:, :].any()
    # A full layer holds the whole history, a window's layer that kept only its window says so (a tool loop reads it)
    assert (full.window, sliding.window, sliding.sliding_window) == (None, WINDOW, WINDOW)


def test_a_step_writes_its_column_in_place_and_the_prefilled_tensors_are_released():
    """A step's keys land at the device index `column` in the same buffers (the addresses a graph replays), and the
    prefilled layers hold nothing after the buffers are built."""
    cache, _, _ = prefilled()
    originals = list(cache.layers)
    column, length = torch.tensor([FILLED]), [FILLED]
    static = static_cache(cache, COLUMNS, column, length, [None, WINDOW])
    assert all(layer.keys is None and layer.values is None for layer in originals)
    layer = static.layers[0]
    addresses = [tensor.data_ptr() for tensor in layer_tensors(layer)]
    step = torch.full((PROMPTS, HEADS, 1, SIZE), 7.0)
    returned = layer.update(step, -step)
    column.add_(1)
    layer.update(step + 1, -step - 1)
    assert [tensor.data_ptr() for tensor in layer_tensors(layer)] == addresses
    assert returned[0] is layer.keys and returned[1] is layer.values
    written = torch.cat([step, step + 1], dim=-2)
    torch.testing.assert_close(layer.keys[..., FILLED : FILLED + 2, :], written)
    torch.testing.assert_close(layer.values[..., FILLED : FILLED + 2, :], -written)
    assert not layer.keys[..., FILLED + 2 :, :].any() and not layer.values[..., FILLED + 2 :, :].any()
    assert layer.get_seq_length() == length[0] == FILLED
