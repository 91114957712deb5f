"""
One rank of tests/test_distributed.py's FSDP2 check, launched with `torch.distributed.run` on CPU (gloo): a tiny
model sharded with `fully_shard` (layers and root, as accelerate's FSDP2 wraps it) runs our packed forward and
backward, our shared-prefill generation with the prompt cache kept once per group, and our packed reward scoring;
each is compared with the same model unsharded. Transformers' Trainer does not shard on CPU, so the sharded model is
built here directly. Writes `<out>/fsdp_rank<r>.json` with the largest differences seen.
"""

import contextlib
import functools
import json
import os
import sys
import warnings
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from rloo_efficient.core.forward.packing import pack_rows
from rloo_efficient.core.forward.reward import pack_reward_rows, packed_scores  # noqa: E402
from rloo_efficient.core.forward.scope import HeldScope, chunk_tables  # noqa: E402
from rloo_efficient.core.forward.sharded import nested_units  # noqa: E402
from rloo_efficient.core.generation.generate import generate_with_shared_prefill  # noqa: E402
from rloo_efficient.core.layers.install import install  # noqa: E402
from rloo_efficient.core.tree.holds import plan_holds  # noqa: E402
from rloo_efficient.core.tree.rows import row_groups


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
    install(model)
    return model


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def image_prompts(directory: Path) -> dict:
    """
    A tiny Qwen2-VL sharded as accelerate's FSDP2 wraps it (each decoder layer and vision block, then the root): the
    shared prefill with images, rank 0's four rows two prompts, rank 1's three, each image encoded once per distinct
    prompt; `synced` keeps the ranks on the same forwards. Then the ranks' agreement on the image prefill
    ([`trainers.ranks.Ranks.can`]): one rank that cannot makes both take stock's `generate`.
    """
    import functools
    from types import SimpleNamespace

    import numpy
    from PIL import Image
    from trl.data_utils import prepare_multimodal_messages

    from rloo_efficient.demo.tiny_models import model_config, model_from_config
    from rloo_efficient.demo.workload import WorkloadConfig, build_processing_class, build_tokenizer
    from rloo_efficient.trainers.ranks import Ranks

    cfg = WorkloadConfig(arch="qwen2_vl", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=512, model_dtype="float64",
                         model_cache_dir=str(directory / f"models{dist.get_rank()}"))  # fmt: skip
    torch.manual_seed(0)
    config = model_config(cfg, build_tokenizer(cfg.vocab_size, cfg.arch))
    model = model_from_config(cfg, config, torch.float64).eval()
    reference = model_from_config(cfg, config, torch.float64).eval()
    reference.load_state_dict(model.state_dict())
    for layer in (*model.model.language_model.layers, *model.model.visual.blocks):
        fully_shard(layer)
    fully_shard(model)
    install(model)
    encoded = []
    encode = model.model.get_image_features

    @functools.wraps(encode)
    def recorded(pixel_values, *args, **kwargs):
        encoded.append(len((kwargs["image_grid_thw"] if "image_grid_thw" in kwargs else args[0])))
        return encode(pixel_values, *args, **kwargs)

    model.model.get_image_features = recorded

    pixels = torch.Generator().manual_seed(3)
    one, two = (Image.fromarray(torch.randint(0, 256, (8, 16, 3), generator=pixels, dtype=torch.uint8).numpy())
                for _ in range(2))  # fmt: skip
    if dist.get_rank() == 0:
        texts, images = ["Describe it.", "Describe it.", "What colour?", "What colour?"], [one, one, two, two]
    else:  # rows 0 and 3 are one prompt; row 1 has row 0's tokens and other pixels
        texts, images = ["Describe it.", "Describe it.", "What colour?", "Describe it."], [one, two, one, one]
    processor = build_processing_class(cfg)
    conversations = [prepare_multimodal_messages([{"role": "user", "content": text}], images=[image])
                     for text, image in zip(texts, images, strict=True)]  # fmt: skip
    batch = processor.apply_chat_template(conversation=conversations, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)  # fmt: skip
    prompt_ids, pad = [list(row) for row in batch.pop("input_ids")], processor.tokenizer.pad_token_id
    width = max(map(len, prompt_ids))
    batch = {key: (torch.tensor([[0] * (width - len(row)) + list(row) for row in value]) if key.endswith("type_ids")
                   else torch.as_tensor(numpy.asarray(value))) for key, value in batch.items()}  # fmt: skip
    batch["input_ids"] = torch.tensor([[pad] * (width - len(row)) + row for row in prompt_ids])  # left, as TRL pads
    batch["attention_mask"] = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in prompt_ids])
    generation = GenerationConfig(max_new_tokens=5, do_sample=True, pad_token_id=pad, eos_token_id=None, top_k=0)
    kwargs = dict(generation_config=generation, output_logits=True, return_dict_in_generate=True, **batch)
    torch.manual_seed(3)
    ours, tokens = generate_with_shared_prefill(model, prompt_ids=prompt_ids, prompt_cache_once=True, synced=True,
                                                synced_gpus=True, images=[[image] for image in images], **kwargs)  # fmt: skip
    torch.manual_seed(3)
    stock = reference.generate(**kwargs)
    distinct = 2 if dist.get_rank() == 0 else 3
    out = {"image_prefill_tokens": tokens == distinct * (batch["input_ids"].shape[1] - 1),
           "images_encoded": encoded == [distinct],
           "image_generate_same_tokens": bool(torch.equal(ours.sequences, stock.sequences)),
           "image_generate_logits": max((a - b).abs().max().item() for a, b in zip(ours.logits, stock.logits,
                                                                                    strict=True))}  # fmt: skip

    # The agreement, on the sharded model as the trainer sees it
    ranks = Ranks(SimpleNamespace(num_processes=dist.get_world_size(), device=torch.device("cpu")), lambda: model)
    out["ranks_agree"] = [ranks.can(can) for can in (True, dist.get_rank() == 1)]
    return out


def held_training(kind: str) -> dict:
    """
    Training micro-batches of one row, each group's prompt held across them ([`core.tree.holds`]): forwarded with grad
    by its first micro-batch, read detached (its gradient banked) by the next, attached by its last, whose backward
    runs the prompt's, on the sharded model (guarded: [`core.forward.sharded`]) against the reference's micro-batches
    each packed on its own. Llama under non-reentrant gradient checkpointing, its gradients synchronized at the last
    micro-batch alone (as accelerate's accumulation does); a Mixtral with its load-balancing loss (held router logits);
    the hybrid Qwen3-Next, checkpointed too (held recurrent states and convolution tails beside keys).
    Returns the held tokens, banks added and the largest gradient difference, relative to the largest gradient.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    from rloo_efficient.core.layers.moe import recording_router_logits, weighted_aux_loss
    from rloo_efficient.core.layers.recurrent import has_recurrent_layers
    from rloo_efficient.demo.tiny_models import model_config, model_from_config
    from rloo_efficient.demo.workload import WorkloadConfig, build_tokenizer

    moe = kind == "mixtral"
    torch.manual_seed(0)
    if kind == "qwen3_next":
        cfg = WorkloadConfig(arch=kind, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64, max_position_embeddings=512, model_dtype="float64")  # fmt: skip
        config = model_config(cfg, build_tokenizer(cfg.vocab_size, cfg.arch))
        model, reference = (model_from_config(cfg, config, torch.float64) for _ in range(2))
        reference.load_state_dict(model.state_dict())
    elif moe:
        config = MixtralConfig(**CONFIG, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1)
        model = MixtralForCausalLM(config).to(torch.float64)
        reference = MixtralForCausalLM(config).to(torch.float64)
        reference.load_state_dict(model.state_dict())
    else:
        model, reference = pair(LlamaForCausalLM)
    for m in (model, reference):
        m.config._attn_implementation = "sdpa"
        m.config._experts_implementation = "eager"  # (torch._grouped_mm has no float64)
        add_fused_lm_head(m, outputs=("log_probs",))
        if not moe:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    shard(model)
    install(reference)
    recurrent = has_recurrent_layers(reference)
    g = torch.Generator().manual_seed(5 + dist.get_rank())  # each rank its own rows
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (9, 6)]
    rows, width_p, width_c = [0, 0, 0, 1, 1, 1], 9, 5
    completions = [torch.randint(3, 64, (width_c,), generator=g).tolist() for _ in rows]
    ids = torch.tensor([[0] * (width_p - len(prompts[r])) + prompts[r] + c for r, c in zip(rows, completions)])
    scored = [5, 3, 5, 2, 4, 5]
    structure = row_groups([prompts[r] for r in rows], scored, None, [c[:n] for c, n in zip(completions, scored)])
    chunks = [np.array([row]) for row in range(len(rows))]
    plan = plan_holds(chunk_tables(structure, chunks), full=moe, min_saved=0)
    weights = torch.linspace(-1, 1, len(rows) * width_c, dtype=torch.float64).view(-1, width_c)
    out, sources = {"recurrent": recurrent}, set()
    for m, hold in ((model, True), (reference, False)):
        scope = HeldScope(plan, training=True) if hold else None
        call = lambda **inputs: m(**inputs, fused_lm_head=True)  # noqa: E731
        routers = functools.partial(recording_router_logits, m) if moe else None
        for index, chunk in enumerate(chunks):
            row = torch.from_numpy(chunk)
            if hold:
                m.set_requires_gradient_sync(index == len(chunks) - 1)
                if plan.chunks[index].source is not None:
                    scope.forward_source(plan.chunks[index].source, call, width_p, ids.device, recurrent, routers,
                                         sharded=m)  # fmt: skip
            pack = dict(token_weights=moe, min_saved=0, recurrent=recurrent)
            packed = (scope.pack(index, ids[row], width_c, structure[row], **pack) if hold
                      else pack_rows(ids[row], width_c, structure[row], **pack))  # fmt: skip
            with recording_router_logits(m) if moe else contextlib.nullcontext() as logits:
                values = packed.unpack(call(**packed.model_inputs()).log_probs)
            loss = (values.double() * weights[row]).sum()
            if moe:
                held = packed.layout.held.routers() if packed.layout.held is not None else []
                loss = loss + weighted_aux_loss(logits, packed.token_weights, m.config, held, list(packed.held_weights))
            if hold:
                sources.update(scope.sources.values())
            loss.backward()
            if hold:
                scope.release(index)
        if hold:
            out["tokens"] = scope.forwarded_tokens
            out["banks_added"] = sum(source.banks_added for source in sources)
    grads = [full(p.grad) for p in model.parameters()]
    want = [p.grad for p in reference.parameters()]
    for w in want:  # FSDP averages the processes' gradients
        dist.all_reduce(w)
        w /= dist.get_world_size()
    scale = max(w.abs().max().item() for w in want)
    out["grads"] = max((a - b).abs().max().item() for a, b in zip(grads, want, strict=True)) / scale
    return out


def main():
    dist.init_process_group("gloo")
    out = {}
    # Packed forward and backward
    model, reference = pair(LlamaForCausalLM)
    for m in (model, reference):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    shard(model)
    install(reference)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (9, 6)]
    rows = [0, 0, 1, 1, 1]
    width_p, width_c = 9, 5
    completions = [torch.randint(3, 64, (width_c,), generator=g).tolist() for _ in rows]
    ids = torch.tensor([[0] * (width_p - len(prompts[r])) + prompts[r] + c for r, c in zip(rows, completions)])
    scored = [5, 3, 5, 2, 4]
    structure = row_groups([prompts[r] for r in rows], scored, None, [c[:n] for c, n in zip(completions, scored)])
    grads, logps = [], []
    for m in (model, reference):
        packed = pack_rows(ids, width_c, structure, min_saved=0)
        values = packed.unpack(m(**packed.model_inputs(), fused_lm_head=True).log_probs)
        (values * torch.linspace(-1, 1, values.numel()).view_as(values)).sum().backward()
        logps.append(values.detach())
        grads.append([full(p.grad) for p in m.parameters()])
    out["packed_logps"] = (logps[0] - logps[1]).abs().max().item()
    out["packed_grads"] = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(*grads, strict=True))

    # A no-grad pass in chunks of one row, each prompt held across them (forwarded by its first chunk, read by the
    # others: [`hold_plan`]), on the sharded model, against the reference's chunks each packed on its own (training:
    # [`held_training`])
    chunks = [np.array([row]) for row in range(len(rows))]
    plan = plan_holds(chunk_tables(structure, chunks), full=False, min_saved=0)
    logps = []
    with torch.no_grad():
        for m, hold in ((model, True), (reference, False)):
            scope = HeldScope(plan, training=False) if hold else None
            call = lambda **inputs: m(**inputs, fused_lm_head=True)  # noqa: E731
            values = torch.zeros(len(rows), width_c, dtype=torch.float64)
            for index, chunk in enumerate(chunks):
                row = torch.from_numpy(chunk)
                if hold and plan.chunks[index].source is not None:
                    scope.forward_source(plan.chunks[index].source, call, width_p, ids.device, recurrent=False)
                packed = (scope.pack(index, ids[row], width_c, structure[row], min_saved=0) if hold
                          else pack_rows(ids[row], width_c, structure[row], min_saved=0))  # fmt: skip
                values[row] = packed.unpack(call(**packed.model_inputs()).log_probs).double()
                if hold:
                    scope.release(index)
            logps.append(values)
            out["held_tokens"] = out.get("held_tokens") or (scope.forwarded_tokens if hold else None)
    out["held_logps"] = (logps[0] - logps[1]).abs().max().item()

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

    out.update(image_prompts(Path(sys.argv[1])))
    out["held_training"] = {kind: held_training(kind) for kind in ("llama", "mixtral", "qwen3_next")}
    # Units under the root alone (accelerate's wrapping) hold in training; a layer's MLP sharded apart does not
    nested, _ = pair(LlamaForCausalLM)
    for layer in nested.model.layers:
        fully_shard(layer.mlp)
    out["nested_units"] = [nested_units(model), nested_units(shard(nested))]

    # Packed reward scoring on a sharded sequence classifier, called at its root
    model, reference = pair(LlamaForSequenceClassification, num_labels=1)
    shard(model)
    texts = [prompts[0] + [7, 8, 9], prompts[0] + [7, 5], prompts[1] + [11]]
    batch = pack_reward_rows(texts, [0, 0, 1], 0, torch.device("cpu"), min_saved=0)
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
