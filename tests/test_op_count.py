"""Operator and host-sync counting, and what it shows over a whole run: ours launches at most 1.1x stock TRL's kernels
and no more host synchronizations (the issue's measurement: P=256, C=32, k=16, 4 layers). With completions of several
lengths the prefix tree's calls are views and gathers of the flat sequence: at most 1.2x stock's dispatches in all."""

import numpy as np
import pytest
import torch
import trl

from rloo_efficient import RLOOTrainer
from rloo_efficient.demo.workload import WorkloadConfig, build_dataset, build_model_dir, build_tokenizer, vowel_reward
from rloo_efficient.profiling.op_count import OpCounter

from .conftest import training_args


def test_counter_counts_host_syncs_and_views():
    x = torch.arange(6.0)
    with OpCounter() as ops:
        y = x.view(2, 3).t()  # two views: no kernel
        (y * 2).sum().item()  # mul, sum, and a read back to the host
        torch.nonzero(x)
    assert ops.host_syncs == 2 and ops.counts["aten::nonzero"] == 1
    assert ops.total - ops.launching == 2


def test_a_whole_run_dispatches_at_most_a_tenth_more_than_stock(model_cache, tmp_path, monkeypatch):
    # Each kernel configuration's first-use check runs once per process, not per step: left out of the count
    from torch.utils._python_dispatch import _disable_current_modes

    import rloo_efficient.core.attention.checks as checks

    check = checks.check_kernel

    def uncounted(config):
        with _disable_current_modes():
            return check(config)

    monkeypatch.setattr(checks, "check_kernel", uncounted)
    workload = WorkloadConfig(prompt_length=256, num_hidden_layers=4, hidden_size=32, intermediate_size=64,
                              max_position_embeddings=512, model_cache_dir=str(model_cache))  # fmt: skip
    path, dataset = build_model_dir(workload), build_dataset(workload)
    settings = dict(per_device_train_batch_size=16, num_generations=16, max_completion_length=32, max_steps=2,
                    steps_per_generation=1, model_init_kwargs=None)  # fmt: skip
    counts = {}
    for name, trainer_class, config_class in [("stock", trl.RLOOTrainer, trl.RLOOConfig),
                                              ("ours", RLOOTrainer, None)]:  # fmt: skip
        extra = {} if config_class else {"profile_memory": False}  # the profiler is ours alone: leave it out
        args = training_args(tmp_path / name, **({"config_class": config_class} if config_class else {}), **settings,
                             **extra)  # fmt: skip
        trainer = trainer_class(model=path, reward_funcs=vowel_reward, args=args, train_dataset=dataset,
                                processing_class=build_tokenizer())  # fmt: skip
        with OpCounter() as ops:
            trainer.train()
        counts[name] = ops
    stock, ours = counts["stock"], counts["ours"]
    print(f"ops: stock {stock.total}, ours {ours.total} ({ours.total / stock.total:.3f}x); launching: stock "
          f"{stock.launching}, ours {ours.launching}; host syncs: stock {stock.host_syncs}, ours {ours.host_syncs}")  # fmt: skip
    assert ours.launching <= 1.1 * stock.launching, (ours.launching, stock.launching)
    assert ours.total <= 1.2 * stock.total, (ours.total, stock.total)
    assert ours.host_syncs <= stock.host_syncs, (ours.host_syncs, stock.host_syncs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_one_row_per_chunk_dispatches_per_layer_what_stocks_padded_row_does(model_cache, arch):
    """At one row per micro-batch each forward is bound by its launches on a GPU (experiments/bench_held_overhead.py):
    one row's tree is a path, whose attention is one call (issue 51: at most stock's operators per layer). Its own
    forward and its prompt's source forward dispatch at most stock's per layer; a row reading its held prompt one
    more (the held keys and values joined before its own: two concatenations, where stock's call takes one view)."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from rloo_efficient.core.forward.packing import pack_rows
    from rloo_efficient.core.forward.scope import HeldScope, chunk_tables
    from rloo_efficient.core.layers.install import install
    from rloo_efficient.core.tree.holds import plan_holds
    from rloo_efficient.core.tree.rows import row_groups
    from rloo_efficient.profiling.op_count import ModuleOpCounter

    # 3 layers: the first builds what a forward builds once (the held read's mask), the others are each layer's own
    workload = WorkloadConfig(arch=arch, prompt_length=48, num_hidden_layers=3, hidden_size=32, intermediate_size=64,
                              max_position_embeddings=256, model_cache_dir=str(model_cache))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(build_model_dir(workload), dtype=torch.float32).eval()
    add_fused_lm_head(model, outputs=("log_probs",))
    install(model)
    prompt, width = list(range(3, 51)), 12
    completions = [[7 + i + j % 5 for j in range(width)] for i in range(3)]
    rows = row_groups([prompt] * 3, [width] * 3, None, completions)
    ids = torch.tensor([prompt + c for c in completions])
    labels = ids.masked_fill(torch.arange(ids.shape[1]) < ids.shape[1] - width, -100)
    plan = plan_holds(chunk_tables(rows, [np.array([row]) for row in range(3)]), full=False)
    scope = HeldScope(plan, training=False)
    call = lambda **inputs: model(**inputs, fused_lm_head=True)  # noqa: E731
    forwards = {
        "stock": lambda: model(input_ids=ids[1:2], attention_mask=torch.ones_like(ids[1:2]), labels=labels[1:2],
                               fused_lm_head=True),  # fmt: skip
        "own": lambda: call(**pack_rows(ids[1:2], width, rows[1:2], recurrent=False).model_inputs()),
        "source": lambda: scope.forward_source(plan.chunks[0].source, call, ids.shape[1] - width, ids.device,
                                               recurrent=False),  # fmt: skip
        "held": lambda: call(**scope.pack(1, ids[1:2], width, rows[1:2], recurrent=False).model_inputs()),
    }
    per_layer = {}
    with torch.no_grad():
        for name, forward in forwards.items():
            forward()  # each kernel's first-use check, once per process: not counted
            with ModuleOpCounter(model.model.layers) as ops:
                forward()
            per_layer[name] = ops.calls
    stock = per_layer["stock"]
    assert len(set(stock)) == 1, stock
    assert max(per_layer["own"]) <= stock[0] and max(per_layer["source"]) <= stock[0], per_layer
    assert max(per_layer["held"][1:]) <= stock[0] + 1, per_layer
