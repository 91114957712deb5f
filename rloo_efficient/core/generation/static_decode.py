"""
Decoding from static buffers: `generate`'s decoding loop with every step's shapes and addresses fixed.

`generate`'s loop grows each layer's keys and values by a concatenation every step, builds the step's attention mask
from a 2-D mask one column longer each time, and reads a device value back every step to decide whether to stop: on
a GPU, allocations and a stall per token, and nothing a captured graph could replay. [`static_sample`] is that loop
as `generate`'s `custom_generate` (so the logits processors and stopping criteria are the ones `generate` prepared
from the generation config, unchanged), over buffers sized for the call once, after the shared prefill:

- each layer's keys and values in `(B, Hkv, W - 1 + N, D)` buffers (the prefilled `W - 1` prompt columns copied in),
  each step's written in place at a device index; with the prompt kept once per group
  ([`generation.prompt_cache.PrefixCache`]), the rows' own `N` positions alone, masked where not written yet (the
  layers in [`generation.static_buffers`]);
- the attention mask a `(B, 1, 1, W - 1 + N)` buffer, its column opened in place each step, handed to the model as a
  prepared 4-D mask (transformers uses such a mask as it is); the position ids (the multimodal rope's `(3 or 4, B,
  1)` alike) and the step's input token likewise; image prompts' features and pixels are inputs `generate` hands the
  prefill alone, and their token types grow by zeros (the step's a buffer: the prompt's last, then zero);
- the sequences a `(B, W + N)` buffer, the processors reading a view of its first columns as `generate`'s growing
  `input_ids`.

A step reads nothing back from the device: whether every row has finished is written to a device flag per step and
read every [`STOP_CHECK_EVERY`] steps. The steps run past the one where every row finished are undone: their tokens
cut from the output, and the random generator put back to its state after that step, so the next draw anyone makes
is the one it would have been after stock's `generate` (which stops right there).

Equal to `generate`'s loop up to the attention's sums over masked columns (a masked column adds an exact zero: the
same terms, in a kernel's order for a longer row): the same logits to floating-point rounding, the same samples.
On CUDA the step is captured once per call as a graph and replayed ([`GraphedStep`]). Where a call cannot be exact
this way (a window over a prompt kept once, a model preparing its own decoding inputs or taking per-step ones, an
attention implementation that takes no prepared mask, a streamer, attentions returned), it runs `generate`'s own
loop, with one warning naming why ([`generation.static_checks`]).
"""

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from ..graphs import REPLAY_ATOL, REPLAY_RTOL, capture, warm_up
from ..transformers_compat import CACHE_KWARG
from .prompt_cache import PrefixCache, PrefixLayer, mask_dtype
from .static_buffers import (
    StaticLayer,
    StaticPrefixLayer,
    deferred_rows,
    fan_out_deferred,
    layer_states,
    layer_tensors,
    layer_windows,
    static_cache,
)
from .static_checks import (
    FIRST_STEP_TYPES,
    PREPARED_MASKS,
    ZERO_GROWN,
    dropout_active,
    inputs_owner,
    kept_once_reason,
    static_decode_reason,
    warn_off,
)


# How often (in steps) the loop reads back whether every row has finished: each read waits for the device to catch
# up, each step past the finish is a forward spent for nothing. Not yet measured on a GPU (issue 41): 8 steps cost at
# most 7 wasted forwards per call against one stall per token
STOP_CHECK_EVERY = 8


def static_sample(model: nn.Module, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
                  synced_gpus: bool = False, streamer=None, **model_kwargs) -> torch.Tensor:  # fmt: skip
    """
    `generate`'s `_sample` (its `custom_generate` signature; the caller checks
    [`generation.static_checks.static_call_reason`]) from a cache holding the first `W - 1` columns of the `(B, W)`
    batch `input_ids`, decoded from static buffers (see the module's text). Returns the sequences, as `generate` does.
    Runs `generate`'s own loop where [`generation.static_checks.static_decode_reason`] says why it cannot.
    """
    reason = static_decode_reason(model, input_ids, stopping_criteria, generation_config, model_kwargs)
    if reason is None and stopping_criteria.max_length is None:
        reason = "no max_length or max_new_tokens bounds the buffers"
    if reason is not None:
        warn_off(reason)
        fan_out_deferred(model_kwargs.get(CACHE_KWARG))  # generate's loop: its rows now
        return GenerationMixin._sample(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                       synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)  # fmt: skip
    optimized = getattr(model, "_optimize_model_for_decode", contextlib.nullcontext)
    # (LongRoPE's factors: each step chooses them on the device, as in generate's loop, into the same buffer)
    with optimized():
        return _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)


def _rng_state(device: torch.device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class StaticStep:
    """
    One decoding step over static buffers: `rows` rows, `columns` cache positions (the prompt's `W - 1` prefilled and
    one per step). A call opens the step's column of the mask, forwards the step's input token and returns the float32
    logits of its next token; [`advance`] takes the sampled tokens as the next input. The same operators on the same
    addresses every step, nothing read back: what a captured graph replays.
    """

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, model_kwargs: dict, columns: int):
        rows, width = input_ids.shape
        self.model = model
        self.written = [width - 1]  # positions in the cache: the host's count, for get_seq_length
        cache = model_kwargs[CACHE_KWARG]
        self.additive = PREPARED_MASKS[model.config._attn_implementation] == "additive"
        self.windows = {}
        # generate's position ids (cumsum(mask) - 1) and input at the prompt's last column, then one further a step
        # (the multimodal rope's position ids have a leading dimension: `(3 or 4, B, W)`)
        self.position = model_kwargs["position_ids"].narrow(-1, width - 1, 1).clone()
        self.token = input_ids.narrow(1, width - 1, 1).clone()
        self.extra = {"logits_to_keep": model_kwargs["logits_to_keep"]} if "logits_to_keep" in model_kwargs else {}
        dropped = FIRST_STEP_TYPES.get(inputs_owner(model), ())
        self.extra.update({key: model_kwargs[key].narrow(-1, model_kwargs[key].shape[-1] - 1, 1).clone()
                           for key in ZERO_GROWN if model_kwargs.get(key) is not None and key not in dropped})
        if isinstance(cache, PrefixCache):  # the rows' own positions alone in buffers; the prompt stays once
            self.additive, own = True, columns - (width - 1)  # the kernels' bias: additive
            self.column = torch.zeros(1, dtype=torch.long, device=input_ids.device)
            dtype = mask_dtype(cache, next(layer.prefix_keys for layer in cache.layers if type(layer) is PrefixLayer))
            self.full = torch.full((1, 1, 1, own), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device)
            cache.layers = [StaticPrefixLayer(layer, rows, own, self.column, self.full, self.written)
                            if type(layer) is PrefixLayer else layer for layer in cache.layers]  # fmt: skip
            self.cache = cache
            self.mask = self.full  # handed to the model as prepared; the prefix attention reads `own_bias`
            return
        # This step's write position (a device index, advanced in place)
        self.column = torch.full((1,), width - 1, dtype=torch.long, device=input_ids.device)
        self.cache = static_cache(cache, columns, self.column, self.written, layer_windows(model),
                                  deferred_rows(cache))  # fmt: skip
        mask = model_kwargs.get("attention_mask")  # generate drops a mask of all ones
        if mask is None:
            mask = input_ids.new_ones(rows, width)
        attends = F.pad(mask.bool(), (0, columns - width)).view(rows, 1, 1, columns)
        self.full = self._mask(attends)
        # A window shorter than the buffers: its own mask, the column falling out of the window closed each step.
        # Column `c` reads the keys in (c - w, c]: closing `(c - w) mod columns` closes an unwritten column (after
        # `c`, still closed) until `c >= w`
        windows = {layer.sliding_window for layer in self.cache.layers if isinstance(layer, StaticLayer)
                   and layer.sliding_window is not None and layer.sliding_window < columns}  # fmt: skip
        for window in windows:
            behind = torch.arange(columns, device=attends.device) <= width - 1 - window
            closing = torch.full((1,), (width - 1 - window) % columns, dtype=torch.long, device=attends.device)
            self.windows[window] = (self._mask(attends & ~behind), closing)
        self.mask = self._model_mask()

    def _mask(self, attends: torch.Tensor) -> torch.Tensor:
        """`attends` as the model's attention takes it: boolean for SDPA, additive (the dtype's minimum) for eager."""
        if not self.additive:
            return attends.clone()
        dtype = mask_dtype(self.cache, next(layer.keys for layer in self.cache.layers if isinstance(layer, StaticLayer)))
        return torch.zeros(attends.shape, dtype=dtype, device=attends.device).masked_fill_(attends.logical_not(),
                                                                                          torch.finfo(dtype).min)

    @property
    def opened(self):
        return 0.0 if self.additive else True

    @property
    def closed(self):
        return torch.finfo(self.full.dtype).min if self.additive else False

    def _model_mask(self):
        """What the model is handed: one mask where its layers all read the same, else one per attention type (the
        models with sliding and full layers take such a mapping as their prepared masks)."""
        if not self.windows:
            return self.full
        (sliding, _), = self.windows.values()  # one window (checked: full and sliding types alone)
        if all(getattr(layer, "sliding_window", None) is not None for layer in self.cache.layers):
            return sliding
        return {"full_attention": self.full, "sliding_attention": sliding}

    def __call__(self) -> torch.Tensor:
        # The step's column opened (the first step's, the prompt's last, is open already), and a window's oldest closed
        self.full.index_fill_(-1, self.column, self.opened)
        for sliding, closing in self.windows.values():
            sliding.index_fill_(-1, self.column, self.opened)
            sliding.index_fill_(-1, closing, self.closed)
        outputs = self.model(input_ids=self.token, attention_mask=self.mask, position_ids=self.position,
                             use_cache=True, return_dict=True, **{CACHE_KWARG: self.cache}, **self.extra)  # fmt: skip
        return outputs.logits.select(1, -1).to(copy=True, dtype=torch.float32)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a step reads or writes in place (what a captured graph keeps the addresses of)."""
        masks = [self.full, *(tensor for pair in self.windows.values() for tensor in pair)]
        caches = [tensor for layer in self.cache.layers for tensor in layer_tensors(layer)]
        grown = [self.extra[key] for key in ZERO_GROWN if key in self.extra]
        return [*masks, self.position, self.token, self.column, *grown, *caches]

    def advance(self, tokens: torch.Tensor) -> None:
        """Takes the step's sampled tokens `(B,)` as the next step's input."""
        self.token.copy_(tokens.unsqueeze(1))
        self.position.add_(1)
        for key in ZERO_GROWN:
            if key in self.extra:
                self.extra[key].zero_()
        self.column.add_(1)
        for _, closing in self.windows.values():
            closing.add_(1).remainder_(self.full.shape[-1])
        self.written[0] += 1


def _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
    """The decoding loop; its output as `generate`'s: the sequences, or with `return_dict_in_generate` a
    `GenerateDecoderOnlyOutput` with the scores and logits asked for and the cache."""
    sequences, scores, logits = _loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                      model_kwargs)  # fmt: skip
    config = generation_config
    if not config.return_dict_in_generate:
        return sequences
    # (the output's field is the release's name for the cache: `cache` from transformers 5.24, `past_key_values` before)
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores if config.output_scores else None,
                                     logits=logits if config.output_logits else None,
                                     **{CACHE_KWARG: model_kwargs.get(CACHE_KWARG)})  # fmt: skip


# Devices on which a call's decoding step is captured as a graph and replayed ([`GraphedStep`]); elsewhere it runs
# eagerly. Also where `static_decoding=None` (the default) turns static decoding on. Measured on an H200 (bf16,
# Qwen3-0.6B's shape, P=3072 C=256 k=8; results/gpu.md, 2026-11-27): generation 0.30x stock's time (7.7 ms a token
# against generate's 26.0; the eager static step alone: 25.6), the trainer's step 0.34x; 1.7B at P=16384: step 0.23x.
# On CPU the eager static step is within 0.8-1.3x of generate's loop (results/static_decode.md): off there.
CAPTURE_DEVICES = ("cuda",)
# On a model's first captured call, replays checked against the eager step for this many tokens
CHECKED_STEPS = 3


def captures(model: nn.Module, device) -> bool:
    """Whether `model`'s decoding steps on `device` are captured as graphs: a [`CAPTURE_DEVICES`] device, the model
    on one device (a capture runs on one stream). Where `static_decoding=None` turns static decoding on."""
    device_map = getattr(model, "hf_device_map", None) or {"": 0}
    return torch.device(device).type in CAPTURE_DEVICES and len(set(device_map.values())) == 1


def replays_kept_once(model: nn.Module, layer_types: list[type], device: torch.device) -> bool:
    """Whether a call handed [`static_sample`] on `device` would replay captured steps with the prompt kept once in a
    cache of `layer_types` (what the cost model needs before the cache is built): the steps captured there, the model's
    attention taking a prepared mask, no capture of the model's failed, and the cache static decoding can hold. A call
    refused later for its own inputs ([`generation.static_checks.static_decode_reason`]) runs `generate`'s loop
    instead."""
    return (device.type in CAPTURE_DEVICES and model.config._attn_implementation in PREPARED_MASKS
            and getattr(model, "_rloo_graph_failed", None) is None and not dropout_active(model)
            and kept_once_reason(model, layer_types) is None)  # fmt: skip


class GraphedStep:
    """
    A [`StaticStep`] captured once as a CUDA graph and replayed: one launch for the whole forward. The first call is
    the warm-up (eager, on a side stream, as capture needs); then the step is captured (nothing runs) and every later
    call replays it over the same buffers. On the model's first captured call, [`CHECKED_STEPS`] replays are checked
    against the eager step at the same position (the eager step writes the same keys again); a mismatch, or a step that
    cannot be captured (a host read, a copy from the host), returns to the eager step with one warning naming why.
    One capture per `generate` call: the buffers are the call's, released with it (a graph kept across calls would keep
    a whole batch's cache allocated through training).
    """

    def __init__(self, step: StaticStep, device: torch.device):
        self.step, self.device, self.graph, self.calls = step, device, None, 0
        self.checking = CHECKED_STEPS if not getattr(step.model, "_rloo_graph_checked", False) else 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            return self._capture()
        if self.graph is None:
            return self.step()
        if not self.checking:
            self.graph.replay()
            return self.output.clone()  # the graph's output buffer is overwritten by the next replay
        # The eager step at the same position, from the same recurrent states (a replay advances them in place;
        # keys and values are written again at the same column, as they were)
        states = [tensor for layer in self.step.cache.layers for tensor in layer_states(layer)]
        before = [tensor.clone() for tensor in states]
        self.graph.replay()
        logits = self.output.clone()
        replayed = [tensor.clone() for tensor in states]
        for tensor, saved in zip(states, before, strict=True):
            tensor.copy_(saved)
        self.checking -= 1
        eager = self.step()
        if not torch.allclose(logits, eager, rtol=REPLAY_RTOL, atol=REPLAY_ATOL):
            difference = (logits - eager).abs().max().item()
            self._give_up(f"a replay differs from the eager step by {difference:.3g} (logits)")
            return eager  # with the eager step's states
        for tensor, saved in zip(states, replayed, strict=True):  # the replay's, as every later step's will be
            tensor.copy_(saved)
        if not self.checking:
            self.step.model._rloo_graph_checked = True
        return logits

    def _capture(self) -> torch.Tensor:
        first = warm_up(self.step, self.device, self.step.buffers)  # (read after the step: it allocates some)
        try:
            self.graph, self.output = capture(self.step, self.device)
        except Exception as error:  # noqa: BLE001 - any failure to capture: the eager step decodes, exactly
            self._give_up(f"its step cannot be captured ({type(error).__name__}: {error})")
        return first

    def _give_up(self, reason: str) -> None:
        """The eager step from here on, and for the model's later calls (not captured again): one warning."""
        self.graph = self.output = None
        self.step.model._rloo_graph_failed = reason
        warnings.warn(f"rloo_efficient: static decoding runs its steps eagerly, not from a CUDA graph: {reason}.",
                      stacklevel=3)  # fmt: skip


def _loop(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
    rows, width = input_ids.shape
    device = input_ids.device
    steps = stopping_criteria.max_length - width
    recorded = ([], [])  # each step's scores and logits, where generate returns them
    record = generation_config.return_dict_in_generate and (generation_config.output_scores or
                                                            generation_config.output_logits)  # fmt: skip
    if steps <= 0:  # nothing to decode: the cache's rows as generate's loop would leave them
        fan_out_deferred(model_kwargs.get(CACHE_KWARG))
        return input_ids, (), ()
    step = StaticStep(model, input_ids, model_kwargs, width - 1 + steps)
    graphs = device.type in CAPTURE_DEVICES and getattr(model, "_rloo_graph_failed", None) is None
    forward = GraphedStep(step, device) if graphs else step
    sequences = input_ids.new_empty(rows, width + steps)
    sequences[:, :width] = input_ids
    pad = generation_config._pad_token_tensor
    stops_at_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
    sampling = bool(generation_config.do_sample)
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    finished = torch.zeros(steps, dtype=torch.bool, device=device)  # whether every row had finished after each step
    states = {}  # the random generator's state after each step since the last check
    checked = 0
    for index in range(steps):
        logits = forward()
        length = width + index
        scores = logits_processor(sequences[:, :length], logits)
        if record:
            recorded[0].append(scores)
            recorded[1].append(logits)
        if sampling:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            states[index] = _rng_state(device)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if stops_at_eos:  # finished rows get padding, as generate gives them
            tokens = tokens * unfinished + pad * (1 - unfinished)
        sequences[:, length].copy_(tokens)
        unfinished &= ~stopping_criteria(sequences[:, : length + 1], scores)
        finished[index] = unfinished.max() == 0
        if index + 1 - checked == STOP_CHECK_EVERY or index + 1 == steps:
            done = finished[checked : index + 1].nonzero()  # the loop's one read-back, every STOP_CHECK_EVERY steps
            if done.numel():
                last = checked + int(done[0, 0])  # generate stops after this step
                if sampling and last != index:  # the draws of the steps past it undone
                    _set_rng_state(device, states[last])
                step.written[0] = width + last  # the cache's length as generate leaves it: the positions forwarded
                return sequences[:, : width + last + 1], tuple(recorded[0][: last + 1]), tuple(recorded[1][: last + 1])
            checked, states = index + 1, {}
        step.advance(tokens)
    return sequences, tuple(recorded[0]), tuple(recorded[1])
