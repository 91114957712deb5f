"""
The reward phase with a reward model the size of the policy (the default tiny model's shape, its own random weights,
a one-label score head), stock TRL's call vs ours: one group of k rows (a P-token prompt, C-token completions),
scored as stock scores them (k padded rows) and packed (the group's common token prefix once). Reports tokens
forwarded, the peak of live tensor bytes during the call (on CPU from the profiler's allocation events; on an
accelerator the allocator's peak), time (median of --repeats after a burn-in), and that the scores are the same.
Then the memory of loading the reward: a second model (stock) vs a Hydra adapter on the policy's base (ours):
parameter bytes, and the resident set of a process after building each trainer.

    python experiments/bench_reward.py --prompt_length 2048 --completion_length 64 --ks 2 4 8
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from bench_generation import peak_tensor_bytes  # the same measure as the generation benchmark's
from transformers import AutoModelForSequenceClassification

from rloo_efficient.core.forward.reward import pack_reward_rows, packed_scores
from rloo_efficient.core.layers.install import install
from rloo_efficient.demo.workload import (
    WorkloadConfig,
    build_dataset,
    build_model_dir,
    build_reward_adapter_dir,
    build_reward_model_dir,
    build_tokenizer,
)
from rloo_efficient.profiling.memory import current_rss_gib, is_accelerator


MIB = 1024**2


def timed(fn, repeats, device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if is_accelerator(device):
            torch.accelerator.synchronize()
        start = time.perf_counter()
        fn()
        if is_accelerator(device):
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def phase(args, device):
    workload = WorkloadConfig(prompt_length=args.prompt_length)
    model = AutoModelForSequenceClassification.from_pretrained(build_reward_model_dir(workload)).to(device).eval()
    install(model)
    tokenizer = build_tokenizer()
    prompt = build_dataset(workload)[0]["prompt"]
    rng = random.Random(0)
    print("| P | C | k | method | tokens forwarded | ideal ratio | same scores | tensor peak (MiB) | ratio | time (s) "
          "| ratio |")  # fmt: skip
    print("|---:|---:|---:|---|---:|---:|:---:|---:|---:|---:|---:|")
    for k in args.ks:
        completions = ["".join(rng.choice("abcdefghij klmnop.") for _ in range(args.completion_length)) for _ in range(k)]
        texts = [prompt + completion for completion in completions]
        padded = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                           add_special_tokens=False).to(device)  # fmt: skip
        rows = tokenizer(text=texts, add_special_tokens=False)["input_ids"]

        def stock():
            with torch.inference_mode():
                return model(**padded).logits[:, 0]

        def ours():
            with torch.inference_mode():
                batch = pack_reward_rows(rows, [0] * k, tokenizer.pad_token_id, device)
                return packed_scores(model, model, None, batch)

        batch = pack_reward_rows(rows, [0] * k, tokenizer.pad_token_id, device)
        same = "yes" if torch.allclose(stock(), ours(), rtol=1e-4, atol=1e-5) else "NO"
        tokens = {"stock": padded["input_ids"].numel(), "ours": batch.num_tokens}
        results = {name: (peak_tensor_bytes(fn, device), timed(fn, args.repeats, device)) for name, fn in
                   (("stock", stock), ("ours", ours))}  # fmt: skip
        p, c = args.prompt_length, args.completion_length
        ideal = (p + k * c) / (k * (p + c))
        for name, (peak, seconds) in results.items():
            print(f"| {p} | {c} | {k} | {name} | {tokens[name]} | {ideal:.3f} | {same} | {peak / MIB:.1f} | "
                  f"{peak / results['stock'][0]:.3f} | {seconds:.3f} | {seconds / results['stock'][1]:.3f} |",
                  flush=True)  # fmt: skip


# -- loaded memory: a second model vs a Hydra adapter ----------------------------------------------------------------
def load_child(method: str, base: str, adapter: str, prompts: str) -> None:
    """In its own process: builds the trainer (stock: the adapter as a second model; ours: Hydra) and prints memory."""
    import warnings

    import trl
    from peft import LoraConfig

    from rloo_efficient import RLOOConfig, RLOOTrainer
    from rloo_efficient.trainers.hydra import HydraReward

    warnings.filterwarnings("ignore")
    before = current_rss_gib()
    args = RLOOConfig(output_dir=tempfile.mkdtemp(), bf16=False, report_to=[], per_device_train_batch_size=2,
                      num_generations=2, max_steps=1)  # fmt: skip
    trainer_class, args = (RLOOTrainer, args) if method == "ours" else (trl.RLOOTrainer, args.to_stock())
    trainer = trainer_class(model=base, reward_funcs=[adapter], args=args,
                            train_dataset=build_dataset(WorkloadConfig(num_prompts=int(prompts))),
                            processing_class=build_tokenizer(),
                            peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    reward = trainer.reward_funcs[0]
    if isinstance(reward, HydraReward):
        name = reward.adapter_name
        tensors = [p for n, p in reward.policy.named_parameters() if f".{name}." in n] + [reward.score.weight]
    else:
        tensors = list(reward.parameters())
    # Weights are memory-mapped until read: read every parameter of the process's models, as a training step would
    for module in (trainer.model, *(f for f in trainer.reward_funcs if isinstance(f, torch.nn.Module))):
        for parameter in module.parameters():
            parameter.detach().sum()
    print(json.dumps({"reward_bytes": sum(t.numel() * t.element_size() for t in tensors),
                      "rss_gib": current_rss_gib() - before}))  # fmt: skip


def loading(args):
    # A larger model than the default tiny one, so that one copy of its weights stands out of the resident set's noise
    workload = WorkloadConfig(hidden_size=args.loading_hidden_size, intermediate_size=4 * args.loading_hidden_size,
                              num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
    base = build_model_dir(workload)
    base_bytes = sum(p.numel() * p.element_size() for p in AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=1).parameters())  # fmt: skip
    adapter = build_reward_adapter_dir(workload)
    print("\n| method | reward held in memory (MiB) | resident set after building the trainer (MiB) |")
    print("|---|---:|---:|")
    for method in ("stock", "ours"):
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--_load_child", method, base, adapter, "4"],
                                 capture_output=True, text=True, check=True)  # fmt: skip
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        rss = statistics.median(r["rss_gib"] for r in runs) * 1024
        print(f"| {method} ({'a second model' if method == 'stock' else 'Hydra adapter'}) | "
              f"{runs[0]['reward_bytes'] / MIB:.2f} | {rss:.1f} |", flush=True)  # fmt: skip
    print(f"\nThat model (hidden {args.loading_hidden_size}, {workload.num_hidden_layers} layers): one copy of its "
          f"weights is {base_bytes / MIB:.2f} MiB.")  # fmt: skip


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_load_child"]:
        return load_child(*argv[1:5])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt_length", type=int, default=2048)
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loading_hidden_size", type=int, default=1024, help="the model whose loading is compared")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"# python experiments/bench_reward.py {' '.join(argv)}")
    print(f"# device {device}, torch {torch.__version__}; reward model shaped like the default policy; time: median "
          f"of {args.repeats} after a burn-in; tensor peak: live tensor bytes above the loaded model")  # fmt: skip
    phase(args, device)
    loading(args)


if __name__ == "__main__":
    main()
