"""
The LM head's and the input embedding's weight gradients added to their `.grad` as they are made, instead of as one
more vocabulary x hidden float32 tensor each per micro-batch ([`adding_in_place`]).

From a step's second micro-batch on, a parameter has a `.grad`, and autograd adds each new gradient to it in place
(`grad += new`, torch's AccumulateGrad with grad mode off). Two of those new gradients are made whole although few of
their rows matter at a time: TRL's fused head (`trl.kernels.chunked_logprob`) builds its weight gradient in full in its
backward (`torch.zeros(weight.shape, dtype=torch.float32)`), and the embedding's backward returns a dense `[V, H]`
gradient for the few hundred tokens of a row. At Qwen3-0.6B's vocabulary each is 593.5 MiB: the largest transients of a
one-row micro-batch's backward, stock's and ours alike.

- The head ([`_InPlaceHead`]): TRL's backward with its two loops swapped (vocabulary chunks outside, token chunks
  inside). Every tile, fold and product is TRL's; each vocabulary chunk's gradient is summed over the token chunks in
  TRL's order, and then added to that chunk's rows of `.grad`.
- The embedding ([`_InPlaceEmbedding`]): torch's own dense backward over the distinct tokens renamed by rank (each
  row's sum as torch makes it), added to those rows of `.grad` ([`embedding_rows.add_rows`]).

The same additions, elementwise, as autograd's: the same bits, with one chunk alive instead of the whole.

Only where autograd would add that gradient alone, in one step: a leaf weight that already has a `.grad` of its own
shape and dtype (the first micro-batch's gradient is taken as it is, with no copy), no hooks, no other use of the weight
pending in a graph, and a backward that accumulates into it (`backward()`; not `autograd.grad`, nor
`backward(inputs=...)` without it, which leave `.grad` as it is). A tied weight (Qwen3 up to 4B, Llama 3.2, Gemma), read
by one lookup and then one head in a graph, gets their sum as autograd makes it ([`embedding_rows.Tied`]): the head adds
its gradient to the rows the lookup's tokens do not touch, and the lookup writes the touched rows as `grad + (head's +
lookup's)`; from the first micro-batch on, as the two whole gradients would otherwise be alive at once. The caller
decides the rest: one process and no torch.compile (DDP, DeepSpeed and FSDP hook the accumulation). Elsewhere, and for a
TRL whose backward is not the one read here, torch's and TRL's own.
"""

import contextlib
import functools
import hashlib
import inspect
import weakref

import torch
import trl.kernels.chunked_logprob as chunked_logprob
import trl.trainer.utils as trl_utils
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

from ..once import WarnOnce
from .embedding_rows import Tied, add_rows
from .param_alias import alias_of, watched


# SHA-256 of TRL's backward as read (trl 1.16.0): another one is left as it is
READ_BACKWARDS = {"be5711d605117b7c667abe874d233868e36f6399311fe09159dc6197ccb33f08"}


_WARNINGS = WarnOnce()  # (this process's: the installed TRL)


@functools.cache
def reason() -> str | None:
    """Why the head's gradient cannot be added in place with the installed TRL, or None."""
    digest = hashlib.sha256(inspect.getsource(ChunkedLogProbFunction.backward).encode()).hexdigest()
    if digest not in READ_BACKWARDS:
        return ("the installed TRL's fused LM head backward (trl.kernels.chunked_logprob) is not the one rloo_efficient "
                "read: the LM head's gradient is made in full each micro-batch, as stock's")
    return None


# Heads recorded for backward and not yet freed, by their weight's id: a weight with two is left to autograd
_pending: dict[int, int] = {}


# Tied embeddings' lookups recorded in this forward and not yet read by a head, by their weight's id
_unpaired: dict[int, Tied] = {}


def _release(key: int) -> None:
    _pending[key] -= 1
    if not _pending[key]:
        del _pending[key]


class _InPlaceHead(ChunkedLogProbFunction):
    """TRL's fused head, its weight gradient added to `.grad` as it is computed where that is autograd's addition."""

    counts = None  # the active `adding_in_place` block's counter (a `PassCounts`), read at backward

    @staticmethod
    def forward(ctx, hidden, weight, *args):
        outputs = ChunkedLogProbFunction.forward(ctx, hidden, weight, *args)
        ctx.counts, ctx.tied = _InPlaceHead.counts, None
        if ctx.needs_input_grad[1]:
            ctx.key, ctx.read = id(weight), weight
            tied = _unpaired.pop(ctx.key, None)  # the tied embedding's lookup before it in this forward ...
            ctx.tied = tied if _pending.get(ctx.key) == 1 else None  # ... and the weight's only other use in a graph
            _pending[ctx.key] = _pending.get(ctx.key, 0) + 1
            weakref.finalize(ctx, _release, ctx.key)  # (the graph freed, backward run or not)
        return outputs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *rest):
        weight = ctx.saved_tensors[1]
        tied = ctx.tied if ctx.needs_input_grad[1] and _adds_with(ctx, weight) else None
        if tied is None and (not ctx.needs_input_grad[1] or not _adds_alone(ctx, weight)):
            return ChunkedLogProbFunction.backward(ctx, grad_logprobs, grad_entropy, *rest)
        grad_hidden, grad_bias = _backward_adding(ctx, weight, grad_logprobs, grad_entropy, tied)
        if ctx.counts is not None:
            ctx.counts.in_place_head_grads += 1
        return grad_hidden, None, grad_bias, *(None,) * 6


def _accumulates(weight: torch.Tensor, read: torch.Tensor) -> bool:
    """Whether autograd, in this backward, would add a new gradient to `weight.grad` in place (`grad += new`), or take
    it as `weight.grad` where there is none (`read`: the leaf the forward read, `weight` or its alias)."""
    grad = weight.grad
    # (a `grad_dtype` other than the weight's, torch's option for gradients wider than the weight: a `.grad` made or
    # added here in the weight's dtype would not be autograd's)
    return (weight.grad_fn is None and not torch.is_grad_enabled() and not watched(weight)
            and getattr(weight, "grad_dtype", weight.dtype) == weight.dtype
            and (grad is None or grad.shape == weight.shape and grad.dtype == weight.dtype
                 and grad.layout == torch.strided)
            and _runs_accumulator(read))  # fmt: skip


def _runs_accumulator(read: torch.Tensor) -> bool:
    """Whether this backward runs the gradient accumulation of `read` (the leaf a forward read: a parameter, or its
    alias): `backward()` does; `autograd.grad`, and `backward(inputs=...)` without it, leave its `.grad` as it is."""
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(read).node)
    except RuntimeError:  # (torch cannot tell within `autograd.grad` given leaves, which accumulates none)
        return False


def _adds_alone(ctx, weight: torch.Tensor) -> bool:
    """Whether autograd would add this head's (or lookup's) weight gradient, and only it, to `weight.grad` now, in
    place."""
    return weight.grad is not None and _pending.get(ctx.key) == 1 and _accumulates(weight, ctx.read)


def _adds_with(ctx, weight: torch.Tensor) -> bool:
    """Whether autograd would add this head's weight gradient and its tied embedding's, summed, and only them, to
    `weight.grad`, or take their sum as `weight.grad` where it has none: the two are the only uses of the weight
    pending in a graph, the lookup (earlier in the forward) is still to be backpropagated, and its tokens are few
    enough (a quarter of the vocabulary: the rows held per token cost less than the two whole gradients)."""
    tied = ctx.tied
    return (tied is not None and tied.parameter is weight and tied.head_rows is None and _pending.get(ctx.key) == 2
            and tied.indices.numel() * 4 <= weight.shape[0] and _accumulates(weight, ctx.read))  # fmt: skip


# Adapted from trl 1.16 `ChunkedLogProbFunction.backward`; changes marked "# in place:"
def _backward_adding(ctx, weight, grad_logprobs, grad_entropy, tied: Tied | None = None) -> tuple:
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
    compute_dtype = ctx.compute_dtype
    chunk_size = ctx.chunk_size
    needs_hidden_grad, _, needs_bias_grad = ctx.needs_input_grad[:3]
    N = hidden.shape[0]
    tokens = chunked_logprob.TOKEN_CHUNK_SIZE
    with maybe_gather_lm_head_ctx(weight, bias):
        vocab = weight.shape[0]
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if needs_hidden_grad else None
        grad_bias = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32) if needs_bias_grad else None
        mm_buf = torch.empty((min(N, tokens), chunk_size), device=hidden.device, dtype=compute_dtype)
        grad_logprobs = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
        grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
        if tied is not None:  # in place: the rows the tied lookup touches wait for its gradient ([`Tied`])
            tied.hold()  # (its parameter is `weight`: [`_adds_with`])

        # in place: the vocabulary chunks outside, each one's weight gradient summed over the token chunks (TRL's
        # `grad_weight[start:end]`), then added to `.grad`
        for start in range(0, vocab, chunk_size):
            end = min(start + chunk_size, vocab)
            w_chunk = weight[start:end].to(compute_dtype)
            grad_weight = torch.zeros((end - start, weight.shape[1]), device=weight.device, dtype=torch.float32)
            for token_start in range(0, N, tokens):
                token_end = min(token_start + tokens, N)
                n = token_end - token_start
                hidden_chunk = hidden[token_start:token_end].to(compute_dtype)
                tile = mm_buf[:n, : end - start]
                torch.mm(hidden_chunk, w_chunk.t(), out=tile)
                if bias is not None:
                    tile.add_(bias[start:end].to(compute_dtype))
                fold = (
                    chunked_logprob._backward_kernel[
                        (n, chunked_logprob.triton.cdiv(end - start, chunked_logprob._BLOCK_SIZE))]
                    if chunked_logprob._use_triton(hidden.device)
                    else chunked_logprob._backward_tile
                )  # fmt: skip
                fold(
                    tile,
                    tile.stride(0),
                    targets[token_start:token_end],
                    log_z[token_start:token_end],
                    entropy[token_start:token_end],
                    grad_logprobs[token_start:token_end] if grad_logprobs is not None else log_z,
                    grad_entropy[token_start:token_end] if grad_entropy is not None else log_z,
                    start,
                    end - start,
                    HAS_LOGPROB_GRAD=grad_logprobs is not None,
                    HAS_ENTROPY_GRAD=grad_entropy is not None,
                    BLOCK_SIZE=chunked_logprob._BLOCK_SIZE,
                    **ctx.kernel_args,
                )
                if grad_hidden is not None:
                    chunked_logprob._addmm_fp32(grad_hidden[token_start:token_end], tile, w_chunk)
                chunked_logprob._addmm_fp32(grad_weight, tile.t(), hidden_chunk)
                if grad_bias is not None:
                    grad_bias[start:end] += tile.sum(dim=0, dtype=torch.float32)
            # in place: autograd's `grad += new`, on this chunk's rows (TRL returns `grad_weight.to(weight.dtype)`)
            part = grad_weight.to(weight.dtype)
            if tied is None:
                weight.grad[start:end].add_(part)
            else:
                tied.take(part, start)
            del grad_weight, part

    return (
        grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
        grad_bias.to(bias.dtype) if grad_bias is not None else None,
    )


def _read_alone(model: torch.nn.Module, module) -> torch.Tensor | None:
    """`module`'s weight where no other parameter of `model` shares its storage (it may be two modules' one
    parameter: a tied head and embedding), else None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or type(weight) is not torch.nn.Parameter:
        return None
    storage = weight.untyped_storage().data_ptr()
    sharing = {id(p) for _, p in model.named_parameters(remove_duplicate=False)
               if p.untyped_storage().data_ptr() == storage}  # fmt: skip
    return weight if sharing == {id(weight)} else None


@contextlib.contextmanager
def adding_in_place(model: torch.nn.Module, counts=None):
    """Inside the block, `model`'s LM head (TRL's fused head, `model(..., fused_lm_head=True)`) and input embedding
    add their weight gradients to `.grad` as made, where [`_adds_alone`], or, tied, [`_adds_with`] (counted in
    `counts.in_place_head_grads` and `in_place_embedding_grads`, where given). A head patched in by someone else (a
    test's stand-in) is left as it is."""
    stock_head, stock_embedding = trl_utils._ChunkedLogProbFunction, torch.nn.functional.embedding
    if reason() is not None:
        _WARNINGS.warn(reason(), stacklevel=3)
    head = _read_alone(model, model.get_output_embeddings()) if reason() is None else None
    embedding = _read_alone(model, model.get_input_embeddings())
    if head is not None and stock_head is ChunkedLogProbFunction:
        trl_utils._ChunkedLogProbFunction = _InPlaceHead
    tied = embedding is not None and embedding is getattr(model.get_output_embeddings(), "weight", None)
    if embedding is not None and (not tied or trl_utils._ChunkedLogProbFunction is _InPlaceHead):
        # (tied to a head left as it is: autograd sums the two, the lookup's left to autograd too)
        torch.nn.functional.embedding = _embedding_adding_in_place(embedding, stock_embedding, tied)
    _InPlaceHead.counts = counts
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction, torch.nn.functional.embedding = stock_head, stock_embedding
        _InPlaceHead.counts = None
        _unpaired.clear()


class _InPlaceEmbedding(torch.autograd.Function):
    """An embedding lookup whose weight gradient is added to `.grad` on the rows the tokens touch, where that is
    autograd's addition of the dense `[V, H]` gradient `torch.embedding`'s backward makes. `weight` may be an alias of
    `parameter` ([`param_alias`]: its gradient is added to the parameter's as it arrives)."""

    @staticmethod
    def forward(ctx, indices, weight, padding_idx: int, parameter, tied: bool):
        ctx.save_for_backward(indices)
        ctx.parameter, ctx.padding_idx, ctx.counts = parameter, padding_idx, _InPlaceHead.counts
        ctx.key, ctx.read = id(weight), weight
        ctx.tied = None
        if tied:  # for the head that reads the weight next in this forward
            ctx.tied = _unpaired[ctx.key] = Tied(indices, padding_idx, parameter)
        _pending[ctx.key] = _pending.get(ctx.key, 0) + 1
        weakref.finalize(ctx, _release, ctx.key)
        return torch.embedding(weight, indices, padding_idx)

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        parameter = ctx.parameter
        held = ctx.tied is not None and ctx.tied.head_rows is not None  # (the head's backward held rows for it)
        if held and ctx.tied.add(grad_output.reshape(-1, parameter.shape[1])):
            if ctx.counts is not None:
                ctx.counts.in_place_embedding_grads += 1
            return None, None, None, None, None
        if not _adds_alone(ctx, parameter):
            return None, torch.ops.aten.embedding_backward(grad_output, indices, parameter.shape[0], ctx.padding_idx,
                                                           False, False), None, None, None  # fmt: skip
        add_rows(parameter.grad, grad_output.reshape(-1, parameter.shape[1]), indices.reshape(-1), ctx.padding_idx)
        if ctx.counts is not None:
            ctx.counts.in_place_embedding_grads += 1
        return None, None, None, None, None


def _embedding_adding_in_place(weight: torch.Tensor, stock, tied: bool):
    """`torch.nn.functional.embedding`, through [`_InPlaceEmbedding`] for `weight` while gradients are recorded
    (`tied`: `weight` is also the LM head's, read by [`_InPlaceHead`])."""

    def embedding(input, weight_, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                  sparse=False):  # fmt: skip
        ours = weight_ is weight or alias_of(weight_) is weight  # (a held prompt reads it through an alias)
        if (not ours or max_norm is not None or scale_grad_by_freq or sparse or not torch.is_grad_enabled()
                or not weight_.requires_grad or torch.overrides.has_torch_function_variadic(input, weight_)):  # fmt: skip
            return stock(input, weight_, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        if padding_idx is None:
            padding_idx = -1
        elif padding_idx < 0:
            padding_idx += weight.size(0)
        return _InPlaceEmbedding.apply(input, weight_, padding_idx, weight, tied and weight_ is weight)

    return embedding
