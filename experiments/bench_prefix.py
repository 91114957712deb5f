"""
The training forward/backward of one micro-batch (one prompt group), stock TRL's layout vs the packed shared-prefix
layout: bytes saved for backward (exact, through `torch.autograd.graph.saved_tensors_hooks`), tokens forwarded,
peak memory above the start of the pass, and time (median of --repeats after a burn-in), next to the ideal ratio
(P + kC) / (k(P + C)) of tokens processed.

    python experiments/bench_prefix.py --prompt_lengths 512 2048 --completion_length 64 --ks 2 4 8
"""

import statistics
import sys
import time

import torch
from bench_common import parser_for
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from rloo_efficient.core.forward.packing import pack_rows
from rloo_efficient.core.layers.install import install
from rloo_efficient.core.tree.rows import row_groups
from rloo_efficient.demo.workload import WorkloadConfig, build_model_dir
from rloo_efficient.profiling.memory import get_memory_stats, headline_peak_stat, synchronize


def stock_inputs(prompt_length, completion_length, k, vocab, device):
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (prompt_length,), generator=generator)
    completions = torch.randint(3, vocab, (k, completion_length), generator=generator)
    input_ids = torch.cat([prompt.expand(k, -1), completions], dim=1).to(device)
    return input_ids, torch.ones_like(input_ids)


def forward(model, packed, input_ids, attention_mask, completion_length):
    if packed is None:  # stock TRL's _get_per_token_logps_and_entropies
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-completion_length] = -100
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        return out.log_probs[:, -completion_length:], out.entropy[:, -completion_length:]
    out = model(**packed.model_inputs(), fused_lm_head=True)
    return packed.unpack(out.log_probs), packed.unpack(out.entropy)


def measure(model, packed, input_ids, attention_mask, completion_length, repeats):
    device = input_ids.device
    saved = {}

    def pack_hook(tensor):
        # Count each storage once: views of one buffer share it
        saved[(tensor.untyped_storage().data_ptr(), tensor.dtype)] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda tensor: tensor):
        logps, entropy = forward(model, packed, input_ids, attention_mask, completion_length)
    (logps.sum() + entropy.sum()).backward()
    model.zero_grad(set_to_none=True)
    saved_bytes = sum(saved.values())

    times, peaks = [], []
    for _ in range(repeats):
        get_memory_stats(device)  # resets the peak window
        synchronize(device)  # (on an accelerator: the kernels' time, not their launches')
        start = time.perf_counter()
        logps, entropy = forward(model, packed, input_ids, attention_mask, completion_length)
        (logps.sum() + entropy.sum()).backward()
        synchronize(device)
        times.append(time.perf_counter() - start)
        peaks.append(get_memory_stats(device)[headline_peak_stat(device)])
        model.zero_grad(set_to_none=True)
        del logps, entropy
    return saved_bytes, statistics.median(times), statistics.median(peaks)


def main(argv=None):
    parser = parser_for(__doc__, prompt_lengths=[512, 2048], completion_length=64, ks=[2, 4, 8], repeats=3)
    parser.add_argument("--gradient_checkpointing", action="store_true", help="as TRL's RLOO default")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = build_model_dir(WorkloadConfig())  # the default tiny model
    model = AutoModelForCausalLM.from_pretrained(path).to(device)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install(model)  # the packed forward's layout is read by our attention function
    model.train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = model.config.vocab_size

    print(f"# {' '.join(['python', 'experiments/bench_prefix.py', *(argv if argv is not None else sys.argv[1:])])}")
    print(f"# device {device}, torch {torch.__version__}, model {path}, gradient checkpointing "
          f"{args.gradient_checkpointing}; time and peak: median of {args.repeats} after a burn-in")  # fmt: skip
    print("| P | C | k | tokens stock | tokens ours | ideal ratio | saved-for-backward stock (MiB) | ours (MiB) | "
          "ratio | fwd+bwd peak ratio | fwd+bwd time stock (s) | ours (s) | ratio |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    c = args.completion_length
    for p in args.prompt_lengths:
        for k in args.ks:
            input_ids, attention_mask = stock_inputs(p, c, k, vocab, device)
            rows = row_groups([list(range(p))] * k, [c] * k)  # one group: k rows of one p-token prompt
            packed = pack_rows(input_ids, c, rows)
            stock = measure(model, None, input_ids, attention_mask, c, args.repeats)
            ours = measure(model, packed, input_ids, attention_mask, c, args.repeats)
            # peaks are absolute on CPU: report the ratio of increments over idle
            idle = get_memory_stats(device)[headline_peak_stat(device)]
            ideal = (p + k * c) / (k * (p + c))
            mib = 1024**2
            print(f"| {p} | {c} | {k} | {k * (p + c)} | {packed.num_tokens} | {ideal:.3f} | {stock[0] / mib:.1f} | "
                  f"{ours[0] / mib:.1f} | {ours[0] / stock[0]:.3f} | {(ours[2] - idle) / max(stock[2] - idle, 1e-9):.3f} | "
                  f"{stock[1]:.3f} | {ours[1]:.3f} | {ours[1] / stock[1]:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
