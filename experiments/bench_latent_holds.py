"""
What a prompt held across micro-batches keeps per token under multi-head latent attention: its latents (ours), against
the keys and values they expand to (what it kept before: the recording `expand_kv` taken off the modules, so that the
source holds what attention reads). Each is measured from a source forward (the bytes of what it holds) of a DeepSeek-V3
model at real attention widths with a few layers and a small dense MLP (the attention is what is held), under bf16
autocast over float32 weights as TRL trains on a GPU; then the prompt tokens the default budget (a quarter of an 80 GiB
device) holds at once in a no-grad pass at the full model's layer count, and the time of a one-row chunk reading the
held prompt both ways (each reader expands the latents again through `kv_b_proj`; on CPU, a rough guide only).

    python experiments/bench_latent_holds.py
    python experiments/bench_latent_holds.py --prompt_length 1024 --widths deepseek_v3
"""

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from trl.trainer.utils import add_fused_lm_head

from rloo_efficient.core.attention.backend import install_attention
from rloo_efficient.core.forward.scope import HeldScope, chunk_tables
from rloo_efficient.core.layers.install import install
from rloo_efficient.core.tree.holds import plan_holds
from rloo_efficient.core.tree.rows import row_groups


# Attention widths (a DeepseekV3Config's fields) and the full model's layer count
WIDTHS = {
    "deepseek_v3": (dict(hidden_size=7168, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536,
                         qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128), 61),
    "hidden_2048_16_heads": (dict(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None,
                                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128), 27),
}  # fmt: skip
BUDGET = 80 * 2**30 // 4  # the default `held_prefix_budget_gib` on an 80 GiB device


def build(widths: dict, layers: int) -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config(**widths, num_key_value_heads=widths["num_attention_heads"], num_hidden_layers=layers,
                              first_k_dense_replace=layers, intermediate_size=256, vocab_size=1024,
                              max_position_embeddings=8192, rope_interleave=True)  # fmt: skip
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    add_fused_lm_head(model, outputs=("log_probs",))
    install(model)
    return model


def median_seconds(function, repeats: int = 5) -> float:
    function()  # burn-in
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def held(model, prompt_length: int, completion_length: int, latents: bool) -> tuple[int, float]:
    """(bytes held per prompt token per layer, seconds of a one-row chunk's forward reading the held prompt)."""
    if latents:
        install_attention(model)  # (the recording expand_kv back on every module)
    else:
        for module in model.modules():
            vars(module).pop("expand_kv", None)  # the class's: the source holds the keys and values attention reads
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 1000, prompt_length).tolist()
    completions = [rng.integers(3, 1000, completion_length).tolist() for _ in range(2)]
    rows = row_groups([prompt] * 2, [completion_length] * 2, None, completions)
    ids = torch.tensor([prompt + c for c in completions])
    plan = plan_holds(chunk_tables(rows, [np.array([0]), np.array([1])]), full=False, min_saved=0)
    scope = HeldScope(plan, training=False)
    call = lambda **inputs: model(**inputs, fused_lm_head=True)  # noqa: E731
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        tokens = scope.forward_source(plan.chunks[0].source, call, prompt_length, "cpu", recurrent=False)
        nbytes = scope.sources[plan.chunks[0].source].nbytes
        reading = scope.pack(1, ids[1:2], completion_length, rows[1:2], recurrent=False)
        seconds = median_seconds(lambda: call(**reading.model_inputs()))
    scope.close()
    return nbytes // (tokens * model.config.num_hidden_layers), seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt_length", type=int, default=512)
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    args = parser.parse_args(argv)
    print(f"# python experiments/bench_latent_holds.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# bf16 autocast over float32 weights, {args.layers} layers; P={args.prompt_length}, "
          f"C={args.completion_length}, one row per chunk; CPU, {torch.get_num_threads()} threads\n")
    print("| widths | held | bytes per token and layer | prompt tokens the default budget holds (full model) | "
          "a reading chunk's forward (s) |\n|---|---|---:|---:|---:|")
    for name in args.widths:
        widths, full_layers = WIDTHS[name]
        model = build(widths, args.layers)
        results = {}
        for latents in (False, True):
            per_layer, seconds = held(model, args.prompt_length, args.completion_length, latents)
            results[latents] = per_layer
            label = "latents (ours)" if latents else "keys and values (before)"
            print(f"| {name} ({full_layers} layers) | {label} | {per_layer} | {BUDGET // (per_layer * full_layers)} | "
                  f"{seconds:.3f} |", flush=True)
        print(f"| {name} | ratio | {results[False] / results[True]:.1f}x fewer bytes | | |")
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
