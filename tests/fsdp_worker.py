"""
One rank of tests/test_distributed.py's FSDP2 check, launched with `torch.distributed.run` on CPU (gloo): a tiny
model sharded with `fully_shard` (layers and root, as accelerate's FSDP2 wraps it) runs our packed forward and
backward, our shared-prefill generation with the prompt cache kept once per group, and our packed reward scoring;
each is compared with the same model unsharded. Transformers' Trainer does not shard on CPU, so the sharded model is
built here directly. Writes `<out>/fsdp_rank<r>.json` with the largest differences seen.
"""

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from rloo_efficient.core import prefix_attention  # noqa: E402
from rloo_efficient.core.packing import pack_groups, row_groups  # noqa: E402
from rloo_efficient.core.reward_packing import pack_reward_rows, packed_scores  # noqa: E402
from rloo_efficient.core.shared_generation import generate_with_shared_prefill  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, pad_token_id=0)  # fmt: skip


def pair(model_class, **extra):
    """The same random model twice: one to shard, one as the reference."""
    torch.manual_seed(0)
    model = model_class(LlamaConfig(**CONFIG, **extra)).to(torch.float64)
    reference = model_class(model.config).to(torch.float64)
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):
        m.config._attn_implementation = "sdpa"
    return model, reference


def shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    prefix_attention.install(model)
    return model


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main():
    dist.init_process_group("gloo")
    out = {}
    # Packed forward and backward
    model, reference = pair(LlamaForCausalLM)
    for m in (model, reference):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    shard(model)
    prefix_attention.install(reference)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (9, 6)]
    rows = [0, 0, 1, 1, 1]
    width_p, width_c = 9, 5
    ids = torch.tensor([[0] * (width_p - len(prompts[r])) + prompts[r] + torch.randint(3, 64, (width_c,), generator=g)
                         .tolist() for r in rows])  # fmt: skip
    structure = row_groups([prompts[r] for r in rows], [5, 3, 5, 2, 4])
    grads, logps = [], []
    for m in (model, reference):
        packed = pack_groups(ids, width_c, structure, torch.float64)
        values = packed.unpack(m(**packed.model_inputs(), fused_lm_head=True).log_probs)
        (values * torch.linspace(-1, 1, values.numel()).view_as(values)).sum().backward()
        logps.append(values.detach())
        grads.append([full(p.grad) for p in m.parameters()])
    out["packed_logps"] = (logps[0] - logps[1]).abs().max().item()
    out["packed_grads"] = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(*grads, strict=True))

    # Shared prefill and the prompt cache once per group, decoding on the sharded model. Rank 0's prompts share, rank
    # 1's are all distinct: `synced` keeps both ranks on the same forwards (every one gathers from both)
    model, reference = pair(LlamaForCausalLM)
    shard(model)
    if dist.get_rank() == 0:
        prompt_ids = torch.tensor([[0, 0, 0] + prompts[1]] * 3 + [prompts[0]] * 3)
    else:
        prompt_ids = torch.tensor([[0, 0, 0] + prompts[1], prompts[0], prompts[0][::-1]])
    mask = (prompt_ids != 0).long()
    config = GenerationConfig(max_new_tokens=5, do_sample=True, pad_token_id=0, eos_token_id=None, top_k=0)
    results = []
    for m, shared in ((model, True), (reference, False)):
        torch.manual_seed(3)
        kwargs = dict(generation_config=config, output_logits=True, return_dict_in_generate=True)
        if shared:
            results.append(generate_with_shared_prefill(m, prompt_ids, mask, prompt_cache_once=True, synced=True,
                                                        synced_gpus=True, **kwargs)[0])  # fmt: skip
        else:
            results.append(m.generate(input_ids=prompt_ids, attention_mask=mask, **kwargs))
    out["generate_same_tokens"] = bool(torch.equal(results[0].sequences, results[1].sequences))
    out["generate_logits"] = max((a - b).abs().max().item() for a, b in zip(results[0].logits, results[1].logits,
                                                                            strict=True))  # fmt: skip

    # Packed reward scoring on a sharded sequence classifier, called at its root
    model, reference = pair(LlamaForSequenceClassification, num_labels=1)
    shard(model)
    texts = [prompts[0] + [7, 8, 9], prompts[0] + [7, 5], prompts[1] + [11]]
    batch = pack_reward_rows(texts, [0, 0, 1], 0, torch.device("cpu"), torch.float64)
    with torch.no_grad():
        ours = packed_scores(model, model, None, batch)
        width = max(map(len, texts))
        padded = torch.tensor([t + [0] * (width - len(t)) for t in texts])
        stock = reference(input_ids=padded, attention_mask=(padded != 0).long()).logits[:, 0]
    out["reward_scores"] = (ours - stock).abs().max().item()
    Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
    (Path(sys.argv[1]) / f"fsdp_rank{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Results written, process group left: skip the interpreter's teardown, where a thread left behind in the CPU
    # (gloo) processes aborts one run in about seven ("terminate called without an active exception", torch 2.13)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
