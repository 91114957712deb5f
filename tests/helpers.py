"""
Helpers that several test modules share (a test module imports none from another): a tiny Llama and stock TRL's
batch, attention over a tree against a dense mask, tiny models and prompts for generation and a tool loop, GRPO's
run-against-run comparison, a vLLM stand-in, reward models, and accelerate's shipped configs on CPU processes.
Building prefix trees and their rows: `tests/trees.py`.
"""

import json
import math
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import (
    AutoModelForSequenceClassification,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rloo_efficient import GRPOConfig
from rloo_efficient.core.attention.backend import prefix_attention
from rloo_efficient.core.generation.generate import generate_with_shared_prefill
from rloo_efficient.core.generation.turn_cache import TurnCaches
from rloo_efficient.core.tree.layout import tree_layout
from rloo_efficient.demo.tiny_models import model_config
from rloo_efficient.demo.workload import build_tokenizer

from . import trees
from .conftest import per_micro_batch, training_args


HEADS, KV_HEADS, DIM = 6, 2, 8  # 3 query heads per key/value head, 2 key/value heads: a wrong mapping is caught
VOCAB = 64  # tiny vocabulary: the logits compared per step are (B, 64)


# -- a tiny Llama and stock TRL's batch (test_prefix_attention, test_attention_kernels, test_fake_cuda) ----------------
def stock_batch(prompt_lengths, group_of_row, scored, width_c, seed):
    """Stock TRL's (B, P + C) batch of left-padded prompts (one per group) and right-padded completions, and its rows'
    structure."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (p,), generator=g).tolist() for p in prompt_lengths]
    completions = [torch.randint(3, VOCAB, (width_c,), generator=g).tolist() for _ in group_of_row]
    ids, _, _, rows = trees.stock_batch([prompts[group] for group in group_of_row], completions, scored)
    return ids, rows


def tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                         **overrides)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


# -- attention over a tree against a dense mask (test_tree, test_attention_kernels) ------------------------------------
def dense_mask(tree, window=None):
    """`(N, N)`: token i sees token j when j's node is an ancestor of i's, or they share a node and j <= i; under a
    sliding `window`, only where i's position is within `w` of j's. Read from the tree's parent links."""
    node_of = np.repeat(np.arange(len(tree.start)), tree.length)
    above = np.zeros((len(tree.start), len(tree.start)), dtype=bool)  # above[a, b]: b is an ancestor of a
    for node in range(len(tree.start)):
        up = tree.parent[node]
        while up >= 0:
            above[node, up] = True
            up = tree.parent[up]
    index = np.arange(tree.num_tokens)
    same = (node_of[:, None] == node_of[None, :]) & (index[None, :] <= index[:, None])
    allowed = torch.from_numpy(above[node_of[:, None], node_of[None, :]] | same)
    if window is not None:
        position = torch.from_numpy(tree.token_position)
        allowed &= position[:, None] - position[None, :] < window
    return allowed


def dense_attention(q, k, v, allowed, scale, sinks=None):
    scores = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
    probs = torch.softmax(scores, -1)[..., : allowed.shape[-1]]
    return (probs @ v.repeat_interleave(q.shape[1] // v.shape[1], 1)).transpose(1, 2)


def check_against_dense(tree, seed, window=None, sinks=False, magnitude=1.0, layout=None):
    layout = layout or tree_layout(tree, torch.device("cpu"))[0]
    n = tree.num_tokens
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, h, DIM, generator=g, dtype=torch.float64).transpose(1, 2).mul(magnitude)
               .requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    s_aux = torch.randn(HEADS, generator=g, dtype=torch.float64).requires_grad_() if sinks else None
    weights = torch.randn(1, n, HEADS, DIM, generator=g, dtype=torch.float64)
    ours, _ = prefix_attention(None, q, k, v, None, scaling=0.3, rloo_prefix_layout=layout, sliding_window=window,
                               s_aux=s_aux)  # fmt: skip
    (ours * weights).sum().backward()
    grads = [x.grad for x in (q, k, v, s_aux) if x is not None]
    leaves = [x.detach().requires_grad_() for x in (q, k, v, s_aux) if x is not None]
    reference = dense_attention(*leaves[:3], dense_mask(tree, window), 0.3, *leaves[3:])
    (reference * weights).sum().backward()
    torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-12)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12 * magnitude**2)


# -- tiny models and prompts for generation (test_shared_generation, test_turn_cache, test_static_decode) --------------
PAD = 0
# tiny: the tests compare numbers, not quality. 6 query heads on 2 key/value heads: GQA with rep (3) != kv heads (2),
# so a query head mapped to the wrong key head is caught
SMALL = dict(vocab_size=VOCAB, max_position_embeddings=256, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=2)  # fmt: skip


ALTERNATING = ["sliding_attention", "full_attention"]
FAMILIES = {  # each family's own configuration, shrunk (6 query heads of 8 dims on 2 key/value heads, as SMALL)
    "gemma3_sliding": ("Gemma3TextConfig", "Gemma3ForCausalLM",  # a window of 8 on every other layer
                       dict(head_dim=8, query_pre_attn_scalar=4, sliding_window=8, layer_types=ALTERNATING)),
    "gpt_oss_sliding": ("GptOssConfig", "GptOssForCausalLM",  # sinks, a window of 8 on every other layer, experts
                        dict(head_dim=8, sliding_window=8, layer_types=ALTERNATING, num_local_experts=4,
                             num_experts_per_tok=2, max_position_embeddings=131072)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(attention_multiplier=0.5, embedding_multiplier=2.0,
                                                           residual_multiplier=0.5, logits_scaling=2.0)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=32)),
}  # fmt: skip
# Families built as the workload builds them (rloo_efficient.demo.tiny_models), each from its own config class, with a
# window of 8 where the family has one; the multimodal ones as their checkpoints load (`*ForConditionalGeneration`)
WORKLOAD_FAMILIES = {"cohere2": dict(sliding_window=8), "olmo3": dict(sliding_window=8), "seed_oss": {}, "glm4_moe": {},
                     "ernie4_5_moe": {}, "minimax_m2": {}, "deepseek_v3": {}, "gemma3_vlm": dict(sliding_window=8),
                     "qwen2_vl": {}, "qwen2_5_vl": {}, "gemma4": dict(sliding_window=8),
                     # Hybrids: each recurrent and convolution state fanned out to the rows, attention's prompt once
                     "qwen3_next": {}, "olmo_hybrid": {}, "nemotron_h": dict(num_hidden_layers=3),
                     "granitemoehybrid": {}, "falcon_h1": {}, "lfm2": {}, "qwen3_5": {}, "qwen3_5_moe": {},
                     "mixtral": dict(sliding_window=8), "qwen2_moe": {}, "olmoe": {},
                     "exaone4": dict(sliding_window=8), "ministral3": {}, "phi4_mini": {},
                     "gemma2": dict(sliding_window=8), "qwen3_vl": {}, "glm4v": {},
                     "glm4v_moe": {}, "kimi_linear": {}, "internvl": {}}  # fmt: skip
# Mixture-of-experts layers multiply through torch._grouped_mm, which has no float64: these run in float32
FLOAT32 = ("gpt_oss_sliding", "qwen3_moe", "glm4_moe", "ernie4_5_moe", "minimax_m2", "deepseek_v3", "qwen3_next",
           "qwen3_5_moe", "nemotron_h", "mixtral", "qwen2_moe", "olmoe",
           "glm4v_moe", "kimi_linear",
           "gemma2")  # Gemma 2: stock's eager attention gives NaN for float64 rows with left padding
# The token types a multimodal family's processor returns with text-only prompts (all zero), which TRL passes on
TOKEN_TYPES = {"gemma3_vlm": "token_type_ids", "qwen2_vl": "mm_token_type_ids", "qwen2_5_vl": "mm_token_type_ids",
               "gemma4": "mm_token_type_ids", "qwen3_5": "mm_token_type_ids", "qwen3_5_moe": "mm_token_type_ids",
               "qwen3_vl": "mm_token_type_ids", "glm4v": "mm_token_type_ids",
               "glm4v_moe": "mm_token_type_ids"}


def build(arch: str, dtype=torch.float64, attention="sdpa"):
    torch.manual_seed(0)
    if arch in WORKLOAD_FAMILIES:
        from rloo_efficient.demo.tiny_models import model_config, model_from_config
        from rloo_efficient.demo.workload import WorkloadConfig, build_tokenizer

        sizes = {key: value for key, value in SMALL.items() if key != "vocab_size"}  # the workload's byte vocabulary
        cfg = WorkloadConfig(arch=arch, **{**sizes, **WORKLOAD_FAMILIES[arch]}, model_cache_dir="unused")
        dtype = torch.float32 if arch in FLOAT32 else dtype
        return model_from_config(cfg, model_config(cfg, build_tokenizer(arch=arch)), dtype).eval()
    if arch in FAMILIES:
        import transformers

        config_name, model_name, extra = FAMILIES[arch]
        config = getattr(transformers, config_name)(**{**SMALL, **extra}, pad_token_id=PAD, eos_token_id=1,
                                                    bos_token_id=2)  # fmt: skip
        model = getattr(transformers, model_name)(config)
        if arch in FLOAT32:
            dtype = torch.float32
        return model.to(dtype).eval()
    if arch == "gpt2":  # absolute positions: the prefix's position ids must be generate's own
        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=256, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        model = GPT2LMHeadModel(config)
    elif arch == "mistral_sliding":  # a window shorter than the prompts and the sequences
        config = MistralConfig(sliding_window=8, **SMALL)
        model = MistralForCausalLM(config)
    elif arch == "mistral":  # a window (4096) longer than the sequences: the prompt's cache can stay once per group
        config = MistralConfig(**SMALL)
        model = MistralForCausalLM(config)
    elif arch == "qwen3":  # per-head q/k norms before the cache
        config = Qwen3Config(head_dim=8, **SMALL)
        model = Qwen3ForCausalLM(config)
    else:
        config = LlamaConfig(**SMALL)
        model = LlamaForCausalLM(config)
    model.config._attn_implementation = attention
    return model.to(dtype).eval()


def load_as_trl(cfg, dtype: torch.dtype | None = None):
    """The model of `cfg`'s saved directory as TRL loads it (the class `config.architectures[0]` names, so that a
    multimodal checkpoint is its `*ForConditionalGeneration`), in `dtype` (default: `cfg.model_dtype`), with TRL's
    fused log-prob head and our layers installed."""
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    from rloo_efficient.core.layers.install import install
    from rloo_efficient.demo.workload import build_model_dir

    path = build_model_dir(cfg)
    architecture = getattr(transformers, transformers.AutoConfig.from_pretrained(path).architectures[0])
    model = architecture.from_pretrained(path, dtype=dtype or getattr(torch, cfg.model_dtype))
    add_fused_lm_head(model, outputs=("log_probs",))
    install(model)
    return model


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def prompts_for(layout: str) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (20, 13, 1))
    system = torch.randint(2, VOCAB, (SYSTEM,), generator=g).tolist()
    return {
        # A system prompt before each task (the third task is one token: its prefix is the system prompt alone)
        "system_prompt": [system + a] * 2 + [system + b] * 2 + [system + c] * 2,
        "equal_lengths": [a] * 3 + [a[::-1]] * 3,  # no padding: the mask is dropped, attention is causal
        "mixed_lengths": [a] * 2 + [b] * 2 + [c] * 2,  # left padding; a one-token prompt's prefix is all padding
        "one_apart": [a] * 3 + [a[:0:-1]] * 3,  # one column of padding, in the shorter prompt's rows only
        "interleaved": [a, b, a, b, a],  # a prompt's rows need not be adjacent nor equally many
        # Adjacent but not equally many (a prompt drawn twice in a row, a tool turn's rows that dropped out)
        "uneven_groups": [a] * 3 + [b] + [c] * 2,
    }[layout]


SYSTEM = 70  # a system prompt's tokens: shared by every prompt, more than tree.MIN_SAVED_TOKENS saved


def generation_config(**overrides):
    settings = dict(max_new_tokens=6, do_sample=True, pad_token_id=PAD, eos_token_id=1, top_k=0)
    settings.update(overrides)
    return GenerationConfig(**settings)


def assert_same_generation(stock, ours, arch: str, steps: int) -> None:
    assert torch.equal(ours.sequences, stock.sequences)
    assert len(ours.logits) == len(stock.logits) == steps
    # generate hands out float32 logits whatever the model's dtype: float32's tolerance; float32 models: theirs
    # (DeepSeek-V3's agree to 3e-7: its latents' rope part one token out of place moves them by 5e-5)
    tolerance = 1e-5 if arch == "deepseek_v3" else 1e-4 if arch in FLOAT32 else 1e-6
    for step, (a, b) in enumerate(zip(stock.logits, ours.logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=tolerance, atol=tolerance, msg=f"step {step}")


EOS = [1, 3, 5, 7, 9, 11]  # several end tokens: rows of a tiny random model then end at different steps
GENERATION_PROMPT = [4, 6, 8]  # the template's generation prompt, which ends every tool answer TRL appends


def tool_loop(arch, turns: TurnCaches | None, stale: bool = False, once: bool | None = None, static: bool = False,
              new_tokens: int = 8, synced: bool = False):  # fmt: skip
    """
    Three turns of a tool loop as TRL runs it: the first from the prompts (a system prompt, tasks in groups of two),
    each later one from every going-on row's history (its tokens, its completion up to its end token, a tool's answer
    of 2 to 14 tokens ending in the generation prompt); row `r` stops after turn `r % 3`. Each turn is generated by
    stock and by ours from the same histories (ours first: nothing stock's call leaves on the model, such as Qwen2-VL's
    rope offsets, helps ours). `once`: the first turn's prompt kept once per group while decoding (True) or as the cost
    model chooses (None: fanned out at these sizes); `static`: ours decodes from static buffers; `new_tokens`: each
    turn's most; `synced`: as where every forward gathers sharded parameters (ZeRO-3, FSDP). With `stale`, one row's history changes inside what its cache holds before the last turn. Yields
    `(stock, ours, tokens ours forwarded, the tokens a continued cache must forward, histories)` per turn.
    """
    model = build(arch)
    config = generation_config(max_new_tokens=new_tokens, eos_token_id=EOS)
    g = torch.Generator().manual_seed(3)
    histories, rows = prompts_for("system_prompt"), list(range(6))
    added = None
    for turn in range(3):
        ids, mask = left_pad(histories)
        extra = {TOKEN_TYPES[arch]: torch.zeros_like(ids)} if arch in TOKEN_TYPES else {}
        kwargs = dict(generation_config=config, output_logits=True, return_dict_in_generate=True, **extra)
        torch.manual_seed(10 + turn)
        ours, tokens = generate_with_shared_prefill(model, ids, mask, prompt_ids=histories, prompt_cache_once=once,
                                                    turns=turns, static=static, synced=synced, **kwargs)  # fmt: skip
        torch.manual_seed(10 + turn)
        stock = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        yield stock, ours, tokens, added, histories
        width, steps = ids.shape[1], ours.sequences.shape[1] - ids.shape[1]
        going = [index for index, row in enumerate(rows) if row % 3 != turn]
        completions = ours.sequences[:, width:].tolist()
        next_histories, adds = [], []
        for index in going:
            completion = completions[index]
            ends = [i for i, token in enumerate(completion) if token in EOS]
            completion = completion[: ends[0] + 1] if ends else completion  # TRL keeps a completion to its end
            answer = torch.randint(12, VOCAB, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
            history = histories[index] + completion + answer + GENERATION_PROMPT
            # held: the row's tokens and its forwarded samples (all but the last) up to its end; forwarded: the rest
            # but the new history's last token (generate's first input)
            adds.append(len(history) - 1 - len(histories[index]) - min(len(completion), steps - 1))
            next_histories.append(history)
        histories, rows = next_histories, [rows[index] for index in going]
        if stale and turn == 1:  # a token of the system prompt changed: every token but the last is forwarded
            histories[0] = histories[0][:5] + [histories[0][5] % (VOCAB - 2) + 2 - (histories[0][5] == 2)] + histories[
                0][6:]  # fmt: skip
            adds[0] = len(histories[0]) - 1
        added = sum(adds)


# -- training runs against stock TRL (test_prefix_sharing, test_held_prefix, test_grpo, test_vision, ...) --------------
# Every family beyond llama, qwen2, qwen3 and mistral (test_prefix_sharing's first tests), built from its own config
# (see tiny_models.model_config: Gemma 3's scaled embeddings and query_pre_attn_scalar, Phi-3's fused qkv and partial
# rotary, OLMo 2's q/k norms, SmolLM3's NoPE layers, Granite's multipliers, GPT-OSS's sinks), with a sliding window
# shorter than prompt + completion (40-72 tokens) where the family has one: the banded and prompt-tail paths run
TRAINING_FAMILIES = {
    "gemma3": dict(sliding_window=16),
    "gpt_oss": dict(sliding_window=16, model_dtype="float32"),
    "mistral": dict(sliding_window=16),
    "phi3": dict(sliding_window=24),
    "olmo2": {},
    "smollm3": {},
    "granite": {},
    "qwen3_moe": dict(model_dtype="float32"),
    "mixtral": dict(sliding_window=16, model_dtype="float32"),  # a window on every layer, experts
    "qwen2_moe": dict(model_dtype="float32"),  # experts and a gated shared expert
    "olmoe": dict(model_dtype="float32"),  # q/k norms over the projection, experts
    "exaone4": dict(sliding_window=16),  # full layers without rotary
    "ministral": dict(sliding_window=16),
    "ministral3": {},  # queries scaled by position (past 16: the tiny model's original length)
    "gemma2": dict(sliding_window=16, model_dtype="float32"),  # logits capped; stock eager: NaN in float64
    "phi4_mini": {},  # LongRoPE: short factors to 64 positions (the prompts), long past them (with completions)
    "cohere2": dict(sliding_window=16),  # rotary on the sliding layers only
    "olmo3": dict(sliding_window=16),
    "seed_oss": {},
    "glm4_moe": dict(model_dtype="float32"),
    "ernie4_5_moe": dict(model_dtype="float32"),  # the load-balancing loss on (TRL's default from its config)
    "minimax_m2": dict(model_dtype="float32"),  # likewise
    "deepseek_v3": dict(model_dtype="float32"),  # latent attention, value heads narrower than key heads
    # Multimodal checkpoints (`*ForConditionalGeneration`, with their processors) on text-only prompts
    "gemma3_vlm": dict(sliding_window=16),
    "qwen2_vl": {},
    "qwen2_5_vl": {},
    "qwen3_vl": {},  # interleaved 3-D rotary, DeepStack (image batches: test_vision.py)
    "glm4v": {},  # GLM's 3-D rotary, post-norms
    "glm4v_moe": dict(model_dtype="float32"),
    "internvl": {},  # Qwen2's language model under InternVL's checkpoint
    "gemma4": dict(sliding_window=16),  # keys and values shared across layers, k = v, a wider global head
    # Hybrids: recurrent layers forked after the prompt (their torch kernels compute in float32: float32 for all)
    "qwen3_next": dict(model_dtype="float32"),
    "olmo_hybrid": dict(model_dtype="float32"),
    "nemotron_h": dict(model_dtype="float32", num_hidden_layers=3),  # Mamba2, attention, experts
    "granitemoehybrid": dict(model_dtype="float32"),
    "falcon_h1": dict(model_dtype="float32"),  # keys and states in one cache layer: the prompt's cache fanned out
    "lfm2": {},  # a convolution: float64
    "kimi_linear": dict(model_dtype="float32"),  # Kimi Delta Attention, latent attention, experts
    "qwen3_5": dict(model_dtype="float32"),
    "qwen3_5_moe": dict(model_dtype="float32"),
}


# float64 with the exact head and norms (`exact_head`) for both: the same numbers to float64's resolution
RTOL, ATOL = 1e-9, 1e-12
# What GRPO logs per step that depends on every log-prob: its loss, kl, entropy, clip ratios and gradient norm
GRPO_METRICS = ("loss", "reward", "reward_std", "kl", "grad_norm", "entropy", "clip_ratio/region_mean",
                "clip_ratio/low_mean", "clip_ratio/high_mean", "cispo_clip_ratio", "vespo/phi_seq_mean", "aux_loss")


def grpo_args(output_dir, config_class=GRPOConfig, **overrides):
    # GRPO's own defaults unless a case says otherwise: beta 0, the "dapo" loss; generation every 2 steps with 1
    # accumulation step (training_args), so that TRL's old-log-prob pass runs
    return training_args(output_dir, config_class=config_class, **{"beta": 0.0, **overrides})


def assert_same_run(stock, ours, rtol=RTOL, atol=ATOL):
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    steps = [(a, b) for a, b in zip(stock.state.log_history, ours.state.log_history, strict=True) if "loss" in a]
    assert steps
    skip = per_micro_batch(ours)
    # Regrouped, the logged loss (TRL sums its micro-batches' in float32) moves by float32's rounding of its terms
    loss_atol = max(atol, 1e-7) if skip else atol
    for step, (a, b) in enumerate(steps):
        for key in (key for key in GRPO_METRICS if key not in skip):
            if key not in a:
                assert key not in b, key
                continue
            if isinstance(a[key], float) and math.isnan(a[key]):
                assert math.isnan(b[key]), (step, key)
                continue
            tolerance = atol
            if key == "loss":  # transformers sums it in a float32 `tr_loss`: float64 losses an ulp apart may round to
                # neighbouring float32 values (a loss on a float32 rounding boundary: tests/test_vision.py's LFM2-VL)
                tolerance = max(loss_atol, float(np.spacing(np.float32(max(abs(a[key]), abs(b[key]))))))
            assert b[key] == pytest.approx(a[key], rel=rtol, abs=tolerance), f"step {step} {key}: {a[key]} vs {b[key]}"


class TransformersSampling:
    """
    Stands in for TRL's vLLM generation object (`trl.generation.vllm_generation.VLLMGeneration`, which needs vLLM and
    a GPU): same constructor keywords and `generate` contract, sampling each row once with transformers' `generate`
    from the live policy (so weights need no syncing). The same stand-in serves stock TRL and ours.
    """

    calls = 0
    logprobs = False  # GRPO's stand-in also returns each sampled token's log-probability (vLLM's top-1 list per token)

    def __init__(self, model, processing_class, max_completion_length, temperature, **kwargs):
        self.model, self.tokenizer = model, processing_class
        self.max_completion_length, self.temperature = max_completion_length, temperature

    def sync_weights(self):
        pass

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler=None):
        type(self).calls += 1
        batch = self.tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
        width = batch["input_ids"].shape[1]
        output = self.model.generate(**batch, do_sample=True, temperature=self.temperature, top_k=0,
                                     max_new_tokens=self.max_completion_length, output_scores=self.logprobs,
                                     return_dict_in_generate=True, pad_token_id=self.tokenizer.pad_token_id,
                                     eos_token_id=self.tokenizer.eos_token_id)  # fmt: skip
        rows = output.sequences[:, width:].tolist()
        scores = (self.model.compute_transition_scores(output.sequences, output.scores, normalize_logits=True).tolist()
                  if self.logprobs else [[]] * len(rows))  # fmt: skip
        completions, token_logprobs = [], []
        # Up to and including the first EOS, as vLLM returns them
        for row, row_scores in zip(rows, scores, strict=True):
            end = row.index(self.tokenizer.eos_token_id) + 1 if self.tokenizer.eos_token_id in row else len(row)
            completions.append(row[:end])
            token_logprobs.append([[value] for value in row_scores[:end]])
        return prompts, completions, token_logprobs if self.logprobs else None, None


# -- reward models (test_reward_sharing, test_trainer, test_grpo, test_vision) -----------------------------------------
def build_reward_model(directory, cfg, tokenizer=None, **config_overrides) -> str:
    """A random sequence classifier with one label, the size of the tiny policy, saved with its tokenizer."""
    tokenizer = tokenizer or build_tokenizer(arch=cfg.arch)
    config = model_config(cfg, tokenizer)
    config.num_labels = 1
    for key, value in config_overrides.items():
        setattr(config, key, value)
    torch.manual_seed(7)
    model = AutoModelForSequenceClassification.from_config(config).to(getattr(torch, cfg.model_dtype))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def build_reward_adapter(directory, base_path, dropout: float = 0.0) -> str:
    """A LoRA sequence-classification adapter on `base_path` with a score head, saved as TRL's RewardTrainer saves one
    (random, non-zero LoRA weights so that the adapter changes the scores)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(11)
    model = AutoModelForSequenceClassification.from_pretrained(base_path, num_labels=1, dtype=torch.float64)
    config = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                        init_lora_weights=False, lora_dropout=dropout)  # fmt: skip
    get_peft_model(model, config).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return str(directory)


POLICY_LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


# -- accelerate's shipped configs on CPU processes (test_launchers, test_cli) ------------------------------------------
ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "accelerate_configs"


def cpu_config(name: str, directory: Path) -> Path:
    """
    The shipped accelerate config `name`, on CPU processes: `use_cpu: true` (the launcher still starts one process per
    rank, for `multi_gpu` too; gloo connects them), no mixed precision (no bf16 on these CPUs), and for DeepSpeed the
    same ZeRO stage and settings given as a DeepSpeed JSON, with ZeRO-3's persistence threshold at 0 (a tiny model's
    parameters would otherwise all stay gathered, and nothing would be sharded).
    """
    config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    config.update(use_cpu=True, mixed_precision="no", num_processes=2)
    config.pop("gpu_ids", None)
    deepspeed = config.pop("deepspeed_config", None)
    if deepspeed is not None:
        del config["mixed_precision"]  # the JSON says it (accelerate refuses both)
        zero = {"stage": deepspeed["zero_stage"]}
        for device, key in ((deepspeed.get("offload_optimizer_device"), "offload_optimizer"),
                            (deepspeed.get("offload_param_device"), "offload_param")):  # fmt: skip
            if device not in (None, "none"):
                zero[key] = {"device": device}
        if deepspeed["zero_stage"] == 3:
            zero["stage3_param_persistence_threshold"] = 0
            zero["stage3_gather_16bit_weights_on_model_save"] = deepspeed.get("zero3_save_16bit_model", False)
        settings = {"zero_optimization": zero, "bf16": {"enabled": False}, "fp16": {"enabled": False},
                    **{key: "auto" for key in ("train_micro_batch_size_per_gpu", "train_batch_size",
                                               "gradient_accumulation_steps", "gradient_clipping")}}  # fmt: skip
        (directory / f"{name}.json").write_text(json.dumps(settings))
        config["deepspeed_config"] = {"deepspeed_config_file": str(directory / f"{name}.json"),
                                      "zero3_init_flag": deepspeed.get("zero3_init_flag", False),
                                      "deepspeed_multinode_launcher": deepspeed.get("deepspeed_multinode_launcher",
                                                                                    "standard")}  # fmt: skip
    path = directory / f"{name}_cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a GRPO tool loop as TRL runs it -------------------------------------------------------------------------------
# The workload's chat template, rendering the tools offered and the calls made (TRL checks both)
TOOL_TEMPLATE = (
    "{% if tools %}<|tools|>{% for tool in tools %}[{{ tool.function.name }}]{% endfor %}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}<call>{{ call.function.name }}{{ call.function.arguments | tojson }}"
    "</call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def count_vowels(text: str) -> int:
    """
    Counts the vowels in a text.

    Args:
        text: The text to count in.

    Returns:
        The number of vowels.
    """
    return sum(ch in "aeiou" for ch in text)


def scripted_tool_calls(monkeypatch, turns: int = 1):
    """
    A tiny random model never writes a parsable tool call: TRL's response parser is replaced, for stock and ours
    alike, by one that reads a call into every first turn whose first token is even, and into each of that row's
    next turns until it has called `turns` times (then the tool's answer is followed by plain text), so that TRL's
    tool loop runs on some rows and not others.
    """
    import trl.trainer.grpo_trainer

    def parse_response(tokenizer, ids, prefix=None, tools=None):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        message = {"role": "assistant", "content": text}
        called = tokenizer.decode(prefix).count("<|tool|>") if prefix is not None else turns
        if tools and called < turns and ids and (called or ids[0] % 2 == 0):
            name = tools[0].__name__ if callable(tools[0]) else tools[0]["function"]["name"]
            message["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": {"text": text}}}]
        return message

    monkeypatch.setattr(trl.trainer.grpo_trainer, "parse_response", parse_response)


def tool_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.response_template = "scripted"  # parsing is scripted_tool_calls'; TRL only checks that one is set
    return tokenizer
