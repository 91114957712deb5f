"""
The device path's choices on a CPU, for a CPU run that stands in for a GPU's memory (`run_rloo.py
--emulate_device_path`, `experiments/bench_device_memory.py`):

- decoding from static buffers, each step "replayed" from a captured graph, and the no-grad passes' one- and two-row
  chunks replayed from graphs: capture emulated as the tests emulate it (the warm-up runs the step, a replay runs it
  again into the captured output buffers), the rest of each path as on CUDA;
- TRL's fused LM head scoring only the valid positions, as it does on a Triton device (elsewhere it scores every
  position of the padded batch), its tiles folded a few rows at a time: TRL's torch stand-in for its Triton kernels
  computes a whole tile's softmax in float32 temporaries (256 MiB each at 2,048 tokens by 32,768 vocabulary entries),
  which the kernels, one program per row, never allocate.

Run the trainer with the prompt kept once while decoding (`share_prompt_kv_cache=True`) as the GPU's cost model
chooses at Qwen3-0.6B's shape.
"""

import trl.kernels.chunked_logprob as chunked_logprob
import trl.trainer.utils as trl_utils

from rloo_efficient.core.forward import graphed
from rloo_efficient.core.generation import static_decode


class _EmulatedDecodingGraph:
    """A captured decoding step: nothing runs at capture (the step's buffers as they were), each replay runs the step
    into the one output buffer, as a replay writes the captured output in place."""

    def __init__(self, step):
        self.step = step
        buffers = step.buffers()
        saved = [buffer.clone() for buffer in buffers]
        self.output = step()
        for buffer, value in zip(buffers, saved, strict=True):
            buffer.copy_(value)

    def replay(self):
        self.output.copy_(self.step())


class _EmulatedScoringGraph:
    """A captured scoring forward: its outputs are buffers each replay overwrites."""

    def __init__(self, step, outputs):
        self.step, self.outputs = step, outputs

    def replay(self):
        for buffer, value in zip(self.outputs, self.step(), strict=True):
            if buffer is not None:
                buffer.copy_(value)


def _capture_decoding(step, device):
    graph = _EmulatedDecodingGraph(step)
    return graph, graph.output


def _capture_scoring(step, device):
    outputs = tuple(None if value is None else value.clone() for value in step())
    return _EmulatedScoringGraph(step, outputs), outputs


# Rows of a head tile folded at once: their float32 temporaries are 4 MiB per 32,768 vocabulary entries
FOLDED_ROWS = 32


def _by_rows(fold):
    """`fold(tile, stride, *row_tensors_and_scalars, **flags)` over `FOLDED_ROWS` rows of the tile at a time: every
    positional tensor with the tile's rows is sliced alike (each row's fold is its own)."""

    def folded(tile, stride, *args, **kwargs):
        rows = tile.shape[0]
        for start in range(0, rows, FOLDED_ROWS):
            part = slice(start, min(start + FOLDED_ROWS, rows))
            sliced = [arg[part] if hasattr(arg, "shape") and arg.dim() and arg.shape[0] == rows else arg
                      for arg in args]  # fmt: skip
            fold(tile[part], stride, *sliced, **kwargs)

    return folded


def emulate_device_path() -> None:
    """Patches the modules above in this process (a benchmark's own process: nothing restores them)."""
    for module, capture in ((static_decode, _capture_decoding), (graphed, _capture_scoring)):
        module.CAPTURE_DEVICES = ("cpu",)
        module.warm_up = lambda step, device, buffers=None: step()
        module.capture = capture
    trl_utils._use_triton = lambda device: True  # the compact head; the kernels stay torch's on CPU
    chunked_logprob._forward_tile = _by_rows(chunked_logprob._forward_tile)
    chunked_logprob._backward_tile = _by_rows(chunked_logprob._backward_tile)
