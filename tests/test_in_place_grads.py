"""
The LM head's weight gradient added to `.grad` as TRL's fused head makes it ([`core.forward.in_place_grads`]): the
same bits as autograd's addition of the whole gradient, engaged from a step's second micro-batch on, with no
vocabulary x hidden transient, and left to autograd where it would sum parts first.
"""

import contextlib

import pytest
import torch
import trl.kernels.chunked_logprob as chunked_logprob
import trl.trainer.utils as trl_utils
from transformers import TrainerCallback

from rloo_efficient import GRPOTrainer, RLOOTrainer
from rloo_efficient.core.forward import in_place_grads, passes
from rloo_efficient.core.forward.passes import PassCounts
from rloo_efficient.demo.workload import (
    build_dataset,
    build_model_dir,
    build_processing_class,
    build_tokenizer,
    vowel_reward,
)
from rloo_efficient.profiling.live_bytes import LiveBytes

from .conftest import tiny_workload, training_args
from .helpers import grpo_args


class _Gradients(TrainerCallback):
    """Every parameter's gradient at each optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


class _WholeGradients(LiveBytes):
    """The most bytes alive at once, after any operator while `weight` has a `.grad`, of float32 tensors in its shape
    made by `op` that are not that `.grad`: a whole gradient, made to be added to it (the first micro-batch's becomes
    the `.grad`). Per `(weight, op)` given."""

    def __init__(self, *watched):
        super().__init__(sites=False)
        self.watched, self.most = watched, [0] * len(watched)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for i, (weight, op) in enumerate(self.watched):
            if weight.grad is not None:
                made = sum(t["bytes"] for t in self.live_tensors() if tuple(t["shape"]) == tuple(weight.shape)
                           and t["dtype"] == "float32" and t["op"] == op
                           and t["storage"] != id(weight.grad.untyped_storage()))  # fmt: skip
                self.most[i] = max(self.most[i], made)
        return out


@pytest.fixture(scope="module", params=["untied", "tied"])
def qwen3(request, tmp_path_factory):
    """A tiny Qwen3 saved in float32, its input embedding untied from the LM head (as Qwen3-8B's) or tied (as Qwen3-0.6B
    to 4B's), and its prompts (48 tokens each)."""
    cfg = tiny_workload(tmp_path_factory.mktemp("models"), arch="qwen3", model_dtype="float32", prompt_length=48,
                        prompt_length_min=None, tie_word_embeddings=request.param == "tied")  # fmt: skip
    return request.param == "tied", build_model_dir(cfg), build_dataset(cfg)


@pytest.mark.parametrize("token_chunk", [None, 5])
def test_the_heads_gradient_added_in_place_is_autograds(qwen3, tmp_path, monkeypatch, token_chunk):
    """
    TRL's defaults (float32 weights under bf16 autocast, gradient checkpointing), one row per micro-batch, four
    micro-batches a step: from the second on (tied: from the first, where the two whole gradients would be alive at
    once), the head's gradient is added to `.grad` one vocabulary chunk at a time, and the input embedding's on the rows
    its tokens touch: neither is made whole. Every parameter's gradient is, bit for bit, the one autograd's addition
    gives (the same run with both left to autograd, which makes each whole every time). With five-token chunks, each
    vocabulary chunk's gradient is first summed over several token chunks, as TRL sums them.
    """
    tied, path, dataset = qwen3
    if token_chunk is not None:
        monkeypatch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", token_chunk)
    _assert_added_in_place_as_autograd(path, dataset, tmp_path, monkeypatch, tied)


# Families whose configs tie the LM head to the input embedding: the head's logit softcapping (Gemma 2), its logit
# scale (Cohere 2), convolution layers beside attention (LFM2), experts and their load-balancing loss (ERNIE 4.5 MoE)
TIED_FAMILIES = ["gemma2", "cohere2", "lfm2", "ernie4_5_moe"]


@pytest.mark.parametrize("arch", TIED_FAMILIES)
def test_a_tied_familys_gradients_added_in_place_are_autograds(arch, tmp_path, monkeypatch):
    """The same, for each tied family's own modeling code."""
    cfg = tiny_workload(tmp_path / "models", arch=arch, model_dtype="float32", prompt_length=48, prompt_length_min=None,
                        tie_word_embeddings=True)  # fmt: skip
    _assert_added_in_place_as_autograd(build_model_dir(cfg), build_dataset(cfg), tmp_path, monkeypatch, tied=True)


# Multimodal checkpoints whose LM head is tied as the real small ones' (Gemma 3 4B, Qwen3-VL 2B and 4B, LFM2-VL): image
# tokens in the lookup's ids, their embeddings replaced by the vision tower's features
TIED_VLMS = ["gemma3_vlm", "qwen3_vl", "lfm2_vl"]


@pytest.mark.parametrize("arch", TIED_VLMS)
def test_a_tied_vlms_gradients_added_in_place_are_autograds(arch, tmp_path, monkeypatch):
    """The same, for a tied multimodal checkpoint with an image in every prompt (TRL's vision path)."""
    # (8x8 images: a few image tokens each; 8 prompts: the two steps' groups)
    cfg = tiny_workload(tmp_path / "models", arch=arch, model_dtype="float32", image_size=8, num_prompts=8,
                        tie_word_embeddings=True)  # fmt: skip
    _assert_added_in_place_as_autograd(build_model_dir(cfg), build_dataset(cfg), tmp_path, monkeypatch, tied=True,
                                       processing_class=lambda: build_processing_class(cfg))  # fmt: skip


def test_grpos_defaults_add_a_tied_weights_gradients_in_place_as_autograd(qwen3, tmp_path, monkeypatch):
    """GRPO's own defaults (beta 0: no reference pass, the training forward the first through the model)."""
    tied, path, dataset = qwen3
    _assert_added_in_place_as_autograd(path, dataset, tmp_path, monkeypatch, tied, grpo=True)


def _assert_added_in_place_as_autograd(path, dataset, tmp_path, monkeypatch, tied: bool, grpo: bool = False,
                                       processing_class=build_tokenizer) -> None:
    # 5 vocabulary chunks of the 259 byte tokens (and a family's image tokens)
    monkeypatch.setattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 64)
    settings = dict(bf16=True, use_cpu=True, per_device_train_batch_size=1, gradient_accumulation_steps=4,
                    steps_per_generation=4, max_steps=2, gradient_checkpointing=True)  # fmt: skip
    trainer_class, arguments = (GRPOTrainer, grpo_args) if grpo else (RLOOTrainer, training_args)
    runs = {}
    for in_place in (True, False):
        if not in_place:
            monkeypatch.setattr(passes, "adding_in_place", lambda *args: contextlib.nullcontext())
        gradients = _Gradients()
        trainer = trainer_class(model=path, reward_funcs=vowel_reward, train_dataset=dataset,
                                args=arguments(tmp_path / str(in_place), **settings),
                                processing_class=processing_class(), callbacks=[gradients])  # fmt: skip
        model = trainer.model
        whole = _WholeGradients((model.get_output_embeddings().weight, "zeros"),
                                (model.get_input_embeddings().weight, "embedding_dense_backward"))  # fmt: skip
        with whole:
            trainer.train()
        counts = trainer._counts
        runs[in_place] = gradients.steps, (counts.in_place_head_grads, counts.in_place_embedding_grads), whole.most
    (on, added, made_on), (off, none, made_off) = runs[True], runs[False]
    # Three of each step's four micro-batches (tied: four); the embedding's also in the held prompt's backward (through
    # its alias)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    micro_batches = 4 if tied else 3
    assert added == (2 * micro_batches, 2 * (micro_batches + 1)) and none == (0, 0)
    size = model.get_output_embeddings().weight.numel() * 4
    assert made_on == [0, 0] and made_off == [size, size]  # autograd's way: each whole, in float32, every time
    for step_on, step_off in zip(on, off, strict=True):
        assert step_on.keys() == step_off.keys()
        for name in step_on:
            assert torch.equal(step_on[name], step_off[name]), name


class _Model(torch.nn.Module):
    """An input embedding and an LM head (tied or not), as a causal LM names them."""

    def __init__(self, vocab: int, hidden: int, tied: bool = False, bias: bool = False):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab, bias=bias)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def _heads_backward(model, heads: int, in_place: bool) -> tuple:
    """`heads` calls of TRL's fused head on one weight in one graph (3 vocabulary chunks), backpropagated onto a
    `.grad` already there (with the head's bias, where it has one): the weight's and the inputs' gradients, and the
    in-place additions counted."""
    weight = model.head.weight
    generator = torch.Generator().manual_seed(1)
    weight.grad = torch.randn(weight.shape, generator=generator)
    hidden = torch.randn(heads, 6, weight.shape[1], generator=generator, requires_grad=True)
    targets = torch.randint(weight.shape[0], (heads, 6), generator=generator)
    counts = PassCounts()
    with in_place_grads.adding_in_place(model, counts) if in_place else contextlib.nullcontext():
        loss = 0
        for head in range(heads):
            logps, entropy, *_ = trl_utils._ChunkedLogProbFunction.apply(hidden[head], weight, model.head.bias,
                                                                         targets[head], 0.7, 16, None, 1.0,
                                                                         ("entropy",))  # fmt: skip
            loss = loss + logps.sum() + 0.1 * entropy.sum()
    loss.backward()
    return weight.grad, hidden.grad, counts.in_place_head_grads


@pytest.mark.parametrize("heads", [1, 2])
def test_a_head_is_added_in_place_only_alone_in_its_graph(heads):
    """One head in a graph: added in place, the same bits as autograd's addition. Two heads on one weight in one graph
    (autograd sums their gradients before adding them): both left to autograd, and the same bits again."""
    torch.manual_seed(0)
    model = _Model(40, 8)
    grad, hidden_grad, added = _heads_backward(model, heads, in_place=True)
    stock_grad, stock_hidden_grad, _ = _heads_backward(model, heads, in_place=False)
    assert added == (1 if heads == 1 else 0)
    assert torch.equal(grad, stock_grad) and torch.equal(hidden_grad, stock_hidden_grad)
    assert not in_place_grads._pending  # every recorded head released with its graph


@pytest.mark.parametrize("token_chunk", [2, 6])  # (2: three token chunks, whose sum's order shows past two terms)
def test_a_heads_gradient_with_a_bias_over_token_chunks_under_autocast_is_autograds(monkeypatch, token_chunk):
    """
    A head with a bias (Phi-2's), under TRL's bf16 autocast, its six tokens in one or three token chunks: added in
    place, the weight's, bias's and inputs' gradients are autograd's bit for bit (each vocabulary chunk's gradient
    summed over the token chunks in TRL's order, the bias's in float32 as TRL sums it).
    """
    monkeypatch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", token_chunk)
    torch.manual_seed(0)
    model = _Model(40, 8, bias=True)
    results = {}
    for in_place in (True, False):
        model.head.bias.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            grad, hidden_grad, added = _heads_backward(model, 1, in_place)
        results[in_place] = grad, hidden_grad, model.head.bias.grad.clone(), added
    (grad, hidden_grad, bias_grad, added), (stock_grad, stock_hidden_grad, stock_bias_grad, _) = results.values()
    assert added == 1
    assert torch.equal(grad, stock_grad) and torch.equal(hidden_grad, stock_hidden_grad)
    assert torch.equal(bias_grad, stock_bias_grad)


@pytest.mark.parametrize("hook", ["tensor", "post_accumulate"])
def test_a_head_whose_weight_a_hook_watches_is_left_to_autograd(hook):
    """A hook on the head's weight (a tensor hook, as per-parameter gradient clipping registers, or a post-accumulate
    hook) sees what autograd adds to `.grad`, where an in-place addition would pass it by: left to autograd, the hook
    sees the gradient it sees without us, and `.grad` is the same bits."""
    torch.manual_seed(0)
    model, seen = _Model(40, 8), []
    if hook == "tensor":
        model.head.weight.register_hook(lambda grad: seen.append(grad.clone()))
    else:
        model.head.weight.register_post_accumulate_grad_hook(lambda weight: seen.append(weight.grad.clone()))
    grad, _, added = _heads_backward(model, 1, in_place=True)
    ours = seen.copy()
    seen.clear()
    stock_grad, _, _ = _heads_backward(model, 1, in_place=False)
    assert added == 0 and len(ours) == len(seen) == 1
    assert torch.equal(ours[0], seen[0]) and torch.equal(grad, stock_grad)


# (0: Gemma's; -37: row 3 counted from the end, as `F.embedding` takes it from a caller that does not normalize it)
@pytest.mark.parametrize("padding_idx", [None, 0, 3, -37])
def test_an_embeddings_rows_added_in_place_are_autograds(padding_idx):
    """The input embedding's gradient added on the rows its tokens touch (repeated tokens, the padding token among
    them): bit for bit autograd's addition of the dense gradient, tied to the head or not (no head read it here)."""
    torch.manual_seed(0)
    tokens = torch.randint(12, (3, 50))  # 12 of 40 rows touched, each many times (their sums' order matters)
    results = {}
    for in_place, tied in ((True, False), (False, False), (True, True)):
        model = _Model(40, 8, tied)
        model.embed.padding_idx = padding_idx
        model.embed.weight.grad = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
        counts = PassCounts()
        with in_place_grads.adding_in_place(model, counts) if in_place else contextlib.nullcontext():
            out = model.embed(tokens)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        results[in_place, tied] = model.embed.weight.grad, counts.in_place_embedding_grads
        del out  # (its graph, and the lookup recorded in it)
    assert results[True, False][1] == results[True, True][1] == 1
    assert torch.equal(results[True, False][0], results[False, False][0])
    assert torch.equal(results[True, True][0], results[False, False][0])
    if padding_idx is not None:
        assert torch.equal(results[True, False][0][padding_idx], torch.randn(40, 8, generator=torch.Generator(
            ).manual_seed(1))[padding_idx])  # fmt: skip
    assert not in_place_grads._pending


@pytest.mark.parametrize("option", [{"scale_grad_by_freq": True}, {"max_norm": 1.0}])
def test_an_embedding_that_scales_or_renormalizes_is_left_to_torch(option):
    """A lookup that scales its gradient by the tokens' frequencies, or renormalizes the rows it reads, has a backward
    other than the dense one added in place: left to torch, the same bits, nothing added in place."""
    tokens = torch.randint(12, (3, 50), generator=torch.Generator().manual_seed(0))  # (repeated tokens: scaled)
    results = {}
    for in_place in (True, False):
        torch.manual_seed(0)
        model = _Model(40, 8)
        for name, value in option.items():
            setattr(model.embed, name, value)
        model.embed.weight.grad = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
        counts = PassCounts()
        with in_place_grads.adding_in_place(model, counts) if in_place else contextlib.nullcontext():
            out = model.embed(tokens)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        results[in_place] = model.embed.weight.grad, counts.in_place_embedding_grads
        del out
    assert results[True][1] == 0 and torch.equal(results[True][0], results[False][0])


def _tied_backward(grad: str, padding_idx: int | None, first: int, in_place: bool, vocab: int = 256,
                   heads: int = 1) -> tuple:
    """A tied embedding's lookup of 60 tokens, a layer, and TRL's fused head on the same weight (vocabulary chunks of
    16; `heads` of them, each on half the tokens where 2), in one graph, backpropagated onto no `.grad` or one already
    there (its untouched rows with some -0.0): the weight's gradient, and the in-place additions counted."""
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model = _Model(vocab, 8, tied=True)
    model.embed.padding_idx = padding_idx
    weight = model.head.weight
    if grad == "some":
        weight.grad = torch.randn(weight.shape, generator=generator)
        weight.grad[[0, 2, 30]] = -0.0
    # Repeated tokens in several vocabulary chunks (rows 0-15, 16-31, 32-47), the padding token 3 among them
    tokens = torch.tensor([first, 5, 17, 20, 33, 39, 3])[torch.randint(7, (2, 30), generator=generator)]
    mix = torch.randn(8, 8, generator=generator)
    targets = torch.randint(weight.shape[0], (60,), generator=generator)
    counts = PassCounts()
    with in_place_grads.adding_in_place(model, counts) if in_place else contextlib.nullcontext():
        hidden = torch.tanh(model.embed(tokens) @ mix).reshape(60, 8)
        loss = 0
        for part, part_targets in zip(hidden.chunk(heads), targets.chunk(heads), strict=True):
            logps, entropy, *_ = trl_utils._ChunkedLogProbFunction.apply(part, weight, None, part_targets, 0.7, 16,
                                                                         None, 1.0, ("entropy",))  # fmt: skip
            loss = loss + logps.sum() + 0.1 * entropy.sum()
    loss.backward()
    return weight.grad, (counts.in_place_head_grads, counts.in_place_embedding_grads)


@pytest.mark.parametrize("first", [0, 1])  # (row 0 touched or not: the spare slots write the first distinct row)
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("grad", ["none", "some"])
def test_a_tied_weights_two_gradients_are_added_as_autograd_sums_them(grad, padding_idx, first):
    """
    A tied weight's head and lookup in one graph: autograd sums their gradients, then adds the sum to `.grad` (or takes
    it as `.grad`). In place, the head adds its gradient to the rows no token touches as it makes them, and the lookup
    writes the touched rows: bit for bit autograd's, the first micro-batch's (no `.grad` yet) and a later one's.
    """
    ours, added = _tied_backward(grad, padding_idx, first, in_place=True)
    stock, none = _tied_backward(grad, padding_idx, first, in_place=False)
    assert added == (1, 1) and none == (0, 0)
    assert torch.equal(ours, stock) and torch.equal(torch.signbit(ours), torch.signbit(stock))
    assert not in_place_grads._pending and not in_place_grads._unpaired


# 60 tokens: more than a quarter of 200 rows, or exactly a quarter of 240 (cheaper to hold than two whole gradients)
@pytest.mark.parametrize("vocab, expected", [(200, (0, 0)), (240, (1, 1))])
def test_a_tied_lookup_of_many_tokens_is_left_to_autograd(vocab, expected):
    """More tokens than a quarter of the vocabulary: holding their rows would cost more than the two whole gradients
    autograd makes. Left to autograd, the same bits; at a quarter, added in place, the same bits again."""
    ours, added = _tied_backward("some", None, 1, in_place=True, vocab=vocab)
    stock, _ = _tied_backward("some", None, 1, in_place=False, vocab=vocab)
    assert added == expected and torch.equal(ours, stock)


def test_a_tied_weight_read_by_two_heads_is_left_to_autograd():
    """A tied lookup and two heads on its weight in one graph: autograd sums the three gradients before adding them, so
    neither the heads' nor the lookup's is added in place (the first head paired with the lookup would add their sum,
    then autograd the second head's). The same bits."""
    ours, added = _tied_backward("some", None, 1, in_place=True, heads=2)
    stock, _ = _tied_backward("some", None, 1, in_place=False, heads=2)
    assert added == (0, 0) and torch.equal(ours, stock)
    assert not in_place_grads._pending


def test_a_gradient_added_between_a_tied_heads_and_lookups_backwards_is_refused():
    """Another read of the tied weight's storage whose gradient reaches `.grad` between the head's backward and the
    lookup's (an alias's, [`param_alias`], recorded after the lookup: autograd runs it first) would be overwritten by
    the lookup's rows: an error, never a wrong gradient. (The trainer's held prompts are read before.)"""
    from rloo_efficient.core.forward.param_alias import aliased_parameters

    torch.manual_seed(0)
    model = _Model(256, 8, tied=True)
    weight = model.head.weight
    weight.grad = torch.randn(weight.shape)
    tokens, targets = torch.randint(10, (30,)), torch.randint(256, (30,))
    with in_place_grads.adding_in_place(model, PassCounts()):
        hidden = torch.tanh(model.embed(tokens))
        with aliased_parameters(model):
            held = model.embed(torch.randint(10, (30,)))
        logps, *_ = trl_utils._ChunkedLogProbFunction.apply(hidden + 0.1 * held.mean(0), weight, None, targets, 0.7,
                                                            16, None, 1.0, ())  # fmt: skip
    with pytest.raises(RuntimeError, match="changed between their backwards"):
        logps.sum().backward()


@pytest.mark.parametrize("grad", ["none", "some"])
def test_aliased_parameters_add_their_gradients_as_autograd(grad):
    """A held prompt's forward through [`param_alias.aliased_parameters`]: a tied weight read by the lookup and the head
    (one alias: autograd sums its two gradients before adding them) gets autograd's bits, and a frozen parameter (a
    PEFT base's) gets no gradient."""
    from rloo_efficient.core.forward.param_alias import aliased_parameters

    tokens = torch.randint(40, (2, 20), generator=torch.Generator().manual_seed(0))
    results = {}
    for aliased in (True, False):
        torch.manual_seed(0)
        model = _Model(40, 8, tied=True, bias=True)
        model.head.bias.requires_grad_(False)
        if grad == "some":
            model.head.weight.grad = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
        with aliased_parameters(model) if aliased else contextlib.nullcontext():
            out = model.head(torch.tanh(model.embed(tokens)))
            aliases = [parameter for parameter in model.parameters() if parameter.requires_grad]
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        results[aliased] = model.head.weight.grad
        assert model.head.bias.grad is None
        if aliased:  # each alias's gradient handed to its parameter, not also kept (one more gradient held each)
            assert aliases and all(alias._alias_of is not None and alias.grad is None for alias in aliases)
    assert torch.equal(results[True], results[False])


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("call", ["autograd_grad", "backward_inputs"])
def test_a_backward_to_other_tensors_leaves_the_weights_grad_alone(tied, call):
    """A backward that accumulates into no weight (a user's `autograd.grad` of the loss by the embeddings' output, a
    gradient penalty's; or `backward(inputs=...)`): nothing is added to the weights' `.grad` in place, as autograd
    adds nothing there, and the output's gradient is autograd's."""
    tokens = torch.randint(160, (30,), generator=torch.Generator().manual_seed(0))  # (30: under a quarter of 160)
    targets = torch.randint(160, (30,), generator=torch.Generator().manual_seed(1))
    results = {}
    for in_place in (True, False):
        torch.manual_seed(0)
        model = _Model(160, 8, tied=tied)
        for parameter in model.parameters():
            parameter.grad = torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2))
        before = [parameter.grad.clone() for parameter in model.parameters()]
        counts = PassCounts()
        with in_place_grads.adding_in_place(model, counts) if in_place else contextlib.nullcontext():
            embedded = model.embed(tokens)
            logps, entropy, *_ = trl_utils._ChunkedLogProbFunction.apply(torch.tanh(embedded), model.head.weight, None,
                                                                         targets, 0.7, 16, None, 1.0,
                                                                         ("entropy",))  # fmt: skip
        loss = logps.sum() + 0.1 * entropy.sum()
        if call == "autograd_grad":
            (grad,) = torch.autograd.grad(loss, [embedded])
        else:
            embedded.retain_grad()
            loss.backward(inputs=[embedded])
            grad = embedded.grad
        after = [parameter.grad for parameter in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        results[in_place] = grad, (counts.in_place_head_grads, counts.in_place_embedding_grads)
    assert torch.equal(results[True][0], results[False][0]) and results[True][1] == (0, 0)


@pytest.mark.parametrize("grad", ["none", "some"])
def test_a_weight_with_a_wider_grad_dtype_is_left_to_autograd(grad):
    """A bfloat16 tied weight whose gradient torch keeps in float32 (`grad_dtype`): autograd's gradient is float32,
    which a `.grad` made or added to in the weight's dtype would not be (torch refuses to take one). Left to autograd,
    the same bits, nothing in place."""
    tokens = torch.randint(160, (30,), generator=torch.Generator().manual_seed(0))  # (30: under a quarter of 160)
    targets = torch.randint(160, (30,), generator=torch.Generator().manual_seed(1))
    results = {}
    for in_place in (True, False):
        torch.manual_seed(0)
        model = _Model(160, 8, tied=True).to(torch.bfloat16)
        weight = model.head.weight
        weight.grad_dtype = torch.float32
        if grad == "some":
            weight.grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(2))
        counts = PassCounts()
        with in_place_grads.adding_in_place(model, counts) if in_place else contextlib.nullcontext():
            hidden = torch.tanh(model.embed(tokens))
            logps, entropy, *_ = trl_utils._ChunkedLogProbFunction.apply(hidden, weight, None, targets, 0.7, 16, None,
                                                                         1.0, ("entropy",))  # fmt: skip
        (logps.sum() + 0.1 * entropy.sum()).backward()
        results[in_place] = weight.grad, (counts.in_place_head_grads, counts.in_place_embedding_grads)
    assert results[True][0].dtype == torch.float32 and torch.equal(results[True][0], results[False][0])
    assert results[True][1] == (0, 0)


def test_another_trls_backward_is_left_as_it_is(monkeypatch):
    """A TRL whose fused head backward is not the one read: its own, said once."""
    monkeypatch.setattr(in_place_grads, "READ_BACKWARDS", set())
    monkeypatch.setattr(in_place_grads, "_WARNINGS", in_place_grads.WarnOnce())
    in_place_grads.reason.cache_clear()
    try:
        with pytest.warns(UserWarning, match="not the one rloo_efficient read"):
            _, _, added = _heads_backward(_Model(40, 8), 1, in_place=True)
        assert added == 0
        # Tied to that head, the lookup is left to autograd too: it sums the two before adding them
        ours, added = _tied_backward("some", None, 1, in_place=True)
        stock, _ = _tied_backward("some", None, 1, in_place=False)
        assert added == (0, 0) and torch.equal(ours, stock)
    finally:
        in_place_grads.reason.cache_clear()
