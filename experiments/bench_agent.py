"""
The agent workload's generation, turn by turn: stock `generate` against ours ([`generate_with_shared_prefill`]), on
the same inputs each turn. Every prompt is a 2,048-token system prompt (instructions and tool docs) and a 200-token
task, k = 8 rows a task, 4 tasks; each turn samples 64 tokens a row, and after it every row that goes on calls a tool
whose answer (100 to 300 tokens, the template around it included) joins its history; a quarter of the rows stop after
each tool turn, as rows that answer do. Tiny llama (hidden 128, 2 layers), float32 (or --dtype float64), CPU.

Per turn it reports the prompt tokens each side forwards before decoding (what the embedding is given, minus the
decoding steps), against two limits: the tree (the turn's histories as a radix tree, each shared run once) and the
continued cache (each row's tokens added since its previous turn: its last sampled token and the tool's answer; the
tree on the first turn). Ours continues each row's cache from its previous turn (`turns=`, what the trainers pass in a
tool loop; `--no_continue`: each later turn prefilled as its tree instead). Then the keys and values held across the
tool call, the tensor peak above the loaded model and what was held before the call, the time, and whether the samples
agree.

    python experiments/bench_agent.py --output results/agent.md
"""

import argparse
import dataclasses
import sys
import time

import numpy as np
import torch
from bench_generation import peak_tensor_bytes
from transformers import AutoModelForCausalLM, GenerationConfig

from rloo_efficient.core.generation.generate import generate_with_shared_prefill
from rloo_efficient.core.generation.turn_cache import TurnCaches
from rloo_efficient.core.tree.radix import build_tree
from rloo_efficient.demo.workload import WorkloadConfig, build_model_dir


MIB = 1024**2


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, mask)` of rows left-padded with 0 (no row's token is 0)."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    return ids, (ids != 0).long()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", type=int, default=2048)
    parser.add_argument("--task", type=int, default=200)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--tool_turns", type=int, default=3)
    parser.add_argument("--answer", type=int, nargs=2, default=[100, 300])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--arch", default="llama", help="a tiny family of rloo_efficient.demo.tiny_models")
    parser.add_argument("--preset", default=None, help="a model shape of rloo_efficient.demo.workload.PRESETS (its dtype)")
    parser.add_argument("--sliding_window", type=int, default=None, help="the family's window, where it has one")
    parser.add_argument("--no_continue", action="store_true", help="later turns prefilled as their tree")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    generator = np.random.default_rng(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(preset=args.preset) if args.preset else dict(arch=args.arch, model_dtype=args.dtype,
                                                               sliding_window=args.sliding_window)  # fmt: skip
    path = build_model_dir(WorkloadConfig(**shape))
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").to(device).eval()
    vocab = model.config.vocab_size
    tokens = lambda n: generator.integers(3, vocab, n).tolist()  # noqa: E731  (never 0: the padding)
    system = tokens(args.system)
    histories = [system + task for task in (tokens(args.task) for _ in range(args.tasks)) for _ in range(args.k)]
    added = [len(history) for history in histories]  # the tokens each row's next prefill adds to its cache
    config = GenerationConfig(max_new_tokens=args.completion, min_new_tokens=args.completion, do_sample=True,
                              pad_token_id=0, eos_token_id=None)  # fmt: skip
    embedded = []
    model.get_input_embeddings().register_forward_pre_hook(lambda module, inputs: embedded.append(inputs[0].numel()))

    carried = {"held": None}  # ours' caches held from the previous turn (each of a turn's calls starts from them)

    def run(method, ids, mask, prompts):
        torch.manual_seed(1)
        ids, mask = ids.to(device), mask.to(device)
        if method == "stock":
            return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        turns = None if args.no_continue else TurnCaches(budget=1 << 50)
        if turns is not None and carried["held"] is not None:  # a copy: the call drops what it held once copied
            held = carried["held"]
            turns.held = dataclasses.replace(held, own=list(held.own), prefix=list(held.prefix))
        output = generate_with_shared_prefill(model, ids, mask, prompt_ids=prompts, prompt_cache_once=None,
                                              generation_config=config, turns=turns)[0]  # fmt: skip
        run.held = turns.held if turns is not None else None
        return output

    lines = [f"# python experiments/bench_agent.py {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"# torch {torch.__version__}, {args.preset or 'tiny ' + args.arch} (hidden {model.config.hidden_size}, "
             f"{model.config.num_hidden_layers} layers, {model.dtype}, window "
             f"{getattr(model.config, 'sliding_window', None)}), {device}; prefill: prompt tokens "
             "forwarded before decoding; peak: tensors above the loaded model; time: one call",
             "| turn | rows | prefill stock | prefill ours | tree | continued cache | ours / tree | "
             "ours / continued | held (MiB) | peak stock (MiB) | peak ours (MiB) | time stock (s) | time ours (s) | "
             "ratio | same samples |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]  # fmt: skip
    print("\n".join(lines), flush=True)
    totals = dict(stock=0, ours=0, tree=0, continued=0)
    for turn in range(args.tool_turns + 1):
        ids, mask = left_pad(histories)
        tree = build_tree([history[:-1] for history in histories], shift=False, min_saved=0).real_tokens
        tree += len(histories)  # each row's last prompt token: generate's first input
        continued = tree if turn == 0 else sum(added)
        results = {}
        for method in ("stock", "ours"):
            run(method, ids, mask, histories)  # burn-in
            embedded.clear()
            synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            synchronize()
            start = time.perf_counter()
            output = run(method, ids, mask, histories).cpu()
            synchronize()
            elapsed = time.perf_counter() - start
            prefill = sum(embedded) - len(histories) * (args.completion - 1)  # the decoding steps' one token a row
            peak = peak_tensor_bytes(lambda: run(method, ids, mask, histories), device)
            results[method] = (output, prefill, peak, elapsed)
        (out_s, pre_s, peak_s, t_s), (out_o, pre_o, peak_o, t_o) = results["stock"], results["ours"]
        held = carried["held"].nbytes if carried["held"] is not None else 0  # live before ours' call: part of its peak
        peak_o += held
        carried["held"] = run.held
        for key, value in (("stock", pre_s), ("ours", pre_o), ("tree", tree), ("continued", continued)):
            totals[key] += value
        label = "first" if turn == 0 else f"tool {turn}"
        line = (f"| {label} | {len(histories)} | {pre_s:,} | {pre_o:,} | {tree:,} | {continued:,} | {pre_o / tree:.2f}x | "
                f"{pre_o / continued:.2f}x | {held / MIB:.1f} | {peak_s / MIB:.1f} | {peak_o / MIB:.1f} | {t_s:.2f} | {t_o:.2f} | "
                f"{t_o / t_s:.2f}x | {'yes' if torch.equal(out_s, out_o) else 'NO'} |")  # fmt: skip
        lines.append(line)
        print(line, flush=True)
        if turn == args.tool_turns:
            break
        # Every row's completion (ours', as in a run of ours: in float32 a sample may part from stock's at a rounding,
        # and both sides get the same histories either way) and, for the rows that go on, a tool's answer; a quarter
        # stop
        completions = out_o[:, ids.shape[1]:].tolist()
        keep = [row for row in range(len(histories)) if row % 4 != turn % 4]
        answers = {row: tokens(int(generator.integers(args.answer[0], args.answer[1] + 1))) for row in keep}
        histories = [histories[row] + completions[row] + answers[row] for row in keep]
        added = [1 + len(answers[row]) for row in keep]  # the last sampled token, then the answer
    lines.append(f"| whole run | | {totals['stock']:,} | {totals['ours']:,} | {totals['tree']:,} | "
                 f"{totals['continued']:,} | {totals['ours'] / totals['tree']:.2f}x | "
                 f"{totals['ours'] / totals['continued']:.2f}x | | | | | | | |")  # fmt: skip
    print(lines[-1])
    if args.output:
        with open(args.output, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
