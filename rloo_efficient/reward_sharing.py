"""
The reward phase inside the group: each group's shared prefix scored once, and Hydra reward adapters.

Stock TRL scores completions with a reward model by rendering prompt + completion as text, tokenizing it with the
reward model's tokenizer and running the model on the `B` rows: `k` copies of each prompt. Here the rows of a group
(the same prompt) are tokenized as stock tokenizes them, their longest common token prefix is found (never assumed to
be the prompt: a tokenizer may merge tokens across the prompt/completion boundary), and the batch is packed as the
policy's forwards pack it ([`prefix_sharing`]): the common prefix less its last token once per group, then each row's
remainder opened by a copy of that last token, attending through [`prefix_attention`]. Each row's score is read where
stock's sequence-classification pooling reads it, at the row's last non-padding token, and the model's score head is
applied there.

Hydra (arXiv 2309.00754): when the policy is a PEFT LoRA model and a reward function is the directory of a PEFT
sequence-classification adapter on the same base (as TRL's `RewardTrainer` saves it), the adapter is loaded onto the
policy's own base as a second, frozen adapter, with its score head, instead of loading a second copy of the base.
Rewards are computed with it active and the policy's adapter off, under no gradient, and the policy's adapter and
every parameter's `requires_grad` are restored afterwards, also when the computation raises.
"""

import contextlib
import copy
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig

from .prefix_attention import LAYOUT_KWARG, NO_MASK, PackedLayout
from .prefix_attention import unsupported_reason as attention_reason
from .prefix_sharing import host_layout, is_multimodal, rope_reason


# -- packing the reward batch ----------------------------------------------------------------------------------------
@dataclass
class RewardBatch:
    """The rows of a reward batch packed as one flat sequence, and where each row's score is read."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N)
    score_index: torch.Tensor  # (B,) flat position of each row's last non-padding token
    layout: PackedLayout
    shared_prefix_lengths: list[int]  # per group, the common token prefix of its rows

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack_reward_rows(rows: list[list[int]], prompt_groups: list[int], pad_token_id: int, device,
                     dtype) -> RewardBatch | str:  # fmt: skip
    """
    Packs reward rows (each one's unpadded tokens) whose `prompt_groups` say which share a prompt, or returns why the
    batch cannot be packed. A group whose rows share no first token is split into rows of their own. Array operations
    over all rows at once, on the host (where the tokenizer put them).
    """
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    if (lengths == 0).any():
        return "a reward text has no token"
    rows_count, longest = len(rows), int(lengths.max())
    valid = np.arange(longest)[None, :] < lengths[:, None]
    matrix = np.full((rows_count, longest), -1, dtype=np.int64)
    matrix[valid] = np.concatenate([np.asarray(row, dtype=np.int64) for row in rows])
    # Prompt groups in order of first appearance; each row's common prefix with its group's first row
    _, first_of_id, id_of_row = np.unique(np.asarray(prompt_groups), return_index=True, return_inverse=True)
    appearance = np.argsort(first_of_id)  # ids in order of their first row
    rank = np.empty(len(first_of_id), dtype=np.int64)
    rank[appearance] = np.arange(len(first_of_id))
    group_of_row = rank[id_of_row.reshape(-1)]
    leader = first_of_id[appearance][group_of_row]
    same = (matrix == matrix[leader]) & valid & valid[leader]
    common = np.where(same.all(axis=1), longest, same.argmin(axis=1))
    group_shared = np.full(len(first_of_id), longest, dtype=np.int64)
    np.minimum.at(group_shared, group_of_row, common)
    # Rows in group order (row order within); a group sharing nothing is split into rows of their own
    order = np.lexsort((np.arange(rows_count), group_of_row))
    group_sorted = group_of_row[order]
    alone = group_shared[group_sorted] == 0
    starts = np.ones(rows_count, dtype=bool)
    starts[1:] = (group_sorted[1:] != group_sorted[:-1]) | alone[1:]
    group_of_slot = np.cumsum(starts) - 1
    counts = np.bincount(group_of_slot)
    shared = np.where(alone, lengths[order], group_shared[group_sorted])[starts]
    body = shared - 1  # the shared prefix less its last token, which opens every row's segment
    opening = np.repeat(body, counts)  # each slot's segment starts at this token of its row
    body_width = int(body.max())
    row_length = int((lengths[order] - opening).max())

    body_columns = np.arange(body_width)[None, :]
    body_tokens = np.where(body_columns < body[:, None], matrix[order[starts]][:, :body_width], pad_token_id)
    columns = opening[:, None] + np.arange(row_length)[None, :]
    in_row = columns < lengths[order][:, None]
    row_tokens = np.where(in_row, matrix[order[:, None], np.minimum(columns, longest - 1)], pad_token_id)
    tokens = np.concatenate([body_tokens.reshape(-1), row_tokens.reshape(-1)])
    positions = np.concatenate([np.broadcast_to(body_columns, body_tokens.shape).reshape(-1), columns.reshape(-1)])
    # Stock's pooling: the rightmost token that is not padding (the first position when there is none)
    real = valid & (matrix != pad_token_id)
    last = np.where(real.any(axis=1), longest - 1 - real[:, ::-1].argmax(axis=1), 0)[order]
    slot_start = len(counts) * body_width + np.arange(rows_count) * row_length
    score_index = np.empty(rows_count, dtype=np.int64)
    score_index[order] = np.where(last >= opening, slot_start + last - opening, group_of_slot * body_width + last)
    layout, (tokens_t, positions_t, score_t) = host_layout(counts, body, row_length, longest,
                                                           [tokens, positions, score_index], device, dtype)  # fmt: skip
    return RewardBatch(tokens_t.view(1, -1), positions_t.view(1, -1), score_t, layout, shared.tolist())


@contextlib.contextmanager
def captured_output(module: nn.Module):
    """Within the block, `captured[0]` is `module`'s last output."""
    captured = []
    handle = module.register_forward_hook(lambda _, __, output: captured.insert(0, output))
    try:
        yield captured
    finally:
        handle.remove()


def scores_at(root: nn.Module, inner: nn.Module, score: nn.Module | None, index: torch.Tensor, **inputs) -> torch.Tensor:
    """
    First score of each row, read at the flat positions `index`. The model is called at its `root` (as prepared by
    accelerate), so that FSDP and DeepSpeed gather what they shard, and the per-position values are captured where
    `inner` (the transformers model) makes them. With `score` None, `inner` is a sequence classifier and its own score
    head is read; otherwise it is a causal LM (a Hydra policy, asked for one position's logits only) whose backbone's
    hidden states go through `score`.
    """
    if score is None:
        with captured_output(inner.score) as captured:
            root(**inputs)
        return captured[0].flatten(0, 1).index_select(0, index)[:, 0]
    with captured_output(getattr(inner, inner.base_model_prefix)) as captured:
        root(**inputs, logits_to_keep=1)
    return score(captured[0].last_hidden_state.flatten(0, 1).index_select(0, index))[:, 0]


def packed_scores(root: nn.Module, inner: nn.Module, score: nn.Module | None, batch: RewardBatch) -> torch.Tensor:
    """`(B,)` first score of each packed row (see [`scores_at`])."""
    return scores_at(root, inner, score, batch.score_index, input_ids=batch.input_ids, attention_mask=NO_MASK,
                     position_ids=batch.position_ids, use_cache=False, **{LAYOUT_KWARG: batch.layout})  # fmt: skip


def padded_scores(root, inner, score, input_ids, attention_mask, pad_token_id) -> torch.Tensor:
    """What a transformers `...ForSequenceClassification` model returns for stock's padded batch, for a Hydra policy:
    the score head at each row's last non-padding token."""
    indices = torch.arange(input_ids.shape[-1], device=input_ids.device, dtype=torch.int32)
    last = (indices * (input_ids != pad_token_id).to(torch.int32)).argmax(-1)
    flat = torch.arange(input_ids.shape[0], device=input_ids.device) * input_ids.shape[-1] + last
    return scores_at(root, inner, score, flat, input_ids=input_ids, attention_mask=attention_mask, use_cache=False)


def reward_model_reason(model: nn.Module) -> str | None:
    """Why a reward model's scores cannot be computed exactly from packed rows, or None when they can."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "score") or not hasattr(model, getattr(model, "base_model_prefix", "")):
        return f"{type(model).__name__} is not a transformers sequence-classification model"
    if config.is_encoder_decoder or is_multimodal(model):
        return f"{type(model).__name__} is not a decoder-only text model"
    reason = attention_reason(model)
    if reason is not None:
        return reason
    if config.get_text_config().pad_token_id is None:
        return "it has no padding token, which stock's pooling needs"
    return rope_reason(model)


# -- Hydra: the reward adapter on the policy's own base --------------------------------------------------------------
def reward_adapter_config(path) -> dict | None:
    """The `adapter_config.json` of a PEFT sequence-classification adapter directory, or None for anything else."""
    if not isinstance(path, (str, os.PathLike)) or not (Path(path) / "adapter_config.json").is_file():
        return None
    config = json.loads((Path(path) / "adapter_config.json").read_text())
    return config if config.get("task_type") == "SEQ_CLS" else None


def _same_model(a: str, b: str) -> bool:
    if os.path.isdir(a) and os.path.isdir(b):
        return os.path.realpath(a) == os.path.realpath(b)
    return a.rstrip("/") == b.rstrip("/")


def _adapter_weights(path) -> dict[str, torch.Tensor]:
    """The saved weights of a PEFT adapter directory (safetensors, or PEFT's older `adapter_model.bin`)."""
    from safetensors.torch import load_file

    state_file = Path(path) / "adapter_model.safetensors"
    if state_file.exists():
        return load_file(state_file)
    return torch.load(Path(path) / "adapter_model.bin", weights_only=True)


def _adapter_keys(path) -> list[str]:
    """The names of a PEFT adapter directory's saved weights, read without loading them where the format allows."""
    from safetensors import safe_open

    state_file = Path(path) / "adapter_model.safetensors"
    if state_file.exists():
        with safe_open(state_file, framework="pt") as saved:
            return list(saved.keys())
    return list(_adapter_weights(path))


def _score_keys(state) -> list[str]:
    """The keys of a sequence-classification adapter's saved score head (PEFT saves it as a module to save)."""
    return [key for key in state if key.split(".")[-2] in ("score", "classifier") or ".score." in key]


def hydra_reason(adapter: dict, policy_base: str, policy_dtype, policy_quantization, model_init_kwargs,
                 path=None) -> str | None:  # fmt: skip
    """
    Why the reward adapter `adapter` (its config; saved in `path`) cannot run on the policy's base and give stock's
    rewards: stock TRL loads it on its own copy of `adapter["base_model_name_or_path"]` with `model_init_kwargs`.
    """
    if adapter.get("peft_type") != "LORA":
        return f"it is a {adapter.get('peft_type')} adapter, not LoRA"
    if path is not None and not any(key.endswith("weight") for key in _score_keys(_adapter_keys(path))):
        # Stock's model gets a score head initialized from the global generator at load time: only loading it the
        # same way reproduces it
        return "it holds no score head weights (stock TRL gives such an adapter a freshly initialized one)"
    base = adapter.get("base_model_name_or_path") or ""
    if not _same_model(base, policy_base):
        return f"its base ({base}) is not the policy's ({policy_base})"
    quantization = (model_init_kwargs or {}).get("quantization_config")
    if (quantization is None) != (policy_quantization is None):
        return "the policy's base and the reward model stock TRL would load are not quantized alike"
    dtype = resolved_dtype((model_init_kwargs or {}).get("dtype", "auto"), base)  # transformers' default: auto
    if dtype is None:
        return f"the dtype stock TRL would load {base} in cannot be read from its config"
    if dtype != policy_dtype:
        return f"stock TRL would load the reward model in {dtype}, the policy's base is {policy_dtype}"
    return None


def resolved_dtype(spec, path: str) -> torch.dtype | None:
    """The dtype `from_pretrained(path, dtype=spec)` gives: `"auto"` reads the saved config (a local directory's, or
    the Hub's); None when it cannot be read."""
    if spec in ("auto", None):
        config = Path(path) / "config.json"
        if config.is_file():
            saved = json.loads(config.read_text())
        else:
            try:
                saved = AutoConfig.from_pretrained(path).to_dict()
            except (OSError, ValueError):
                return None
        spec = saved.get("dtype") or saved.get("torch_dtype") or "float32"
    return getattr(torch, spec) if isinstance(spec, str) else spec


class HydraReward:
    """
    A reward adapter to be scored on the policy's base. It stands in for the adapter's path in `reward_funcs`, so
    stock TRL's constructor neither loads a second model nor wraps it; [`attach`] loads it onto the policy.
    """

    def __init__(self, path: str, adapter: dict, name: str):
        self.path, self.adapter, self.adapter_name = str(path), adapter, name
        # Stock TRL names a reward model after its config's model id: the base's, for an adapter directory
        self.__name__ = adapter["base_model_name_or_path"].rstrip("/").split("/")[-1]
        self.policy = None
        self.score: nn.Linear | None = None

    def attach(self, policy) -> None:
        """
        Loads the adapter onto `policy` (a PEFT model on the same base), frozen, and its score head. A new adapter
        draws initial weights from the global generator before the saved ones replace them: the generator is left
        where stock TRL leaves it, or the completions would be sampled differently.
        """
        devices = [policy.device] if policy.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            self._load(policy)

    def _load(self, policy) -> None:
        from peft import LoraConfig, set_peft_model_state_dict

        state = _adapter_weights(self.path)
        score_keys = _score_keys(state)
        score_weight = state[next(key for key in score_keys if key.endswith("weight"))]
        for key in score_keys:
            del state[key]
        fields = {k: v for k, v in self.adapter.items() if k in LoraConfig.__dataclass_fields__}
        config = LoraConfig(**{**fields, "modules_to_save": None, "task_type": "CAUSAL_LM", "inference_mode": True})
        active = policy.active_adapter
        flags = {name: parameter.requires_grad for name, parameter in policy.named_parameters()}
        # In the saved weights' dtype, as stock's `from_pretrained` keeps them (PEFT would upcast a half base's to float32)
        policy.add_adapter(self.adapter_name, config, autocast_adapter_dtype=False)
        set_peft_model_state_dict(policy, state, adapter_name=self.adapter_name)
        for module in policy.modules():  # scored in eval mode only, where dropout is the identity: say so
            dropouts = getattr(module, "lora_dropout", None)
            if isinstance(dropouts, nn.ModuleDict) and self.adapter_name in dropouts:
                dropouts[self.adapter_name] = nn.Identity()
        # Layers the policy's adapter does not target were created with the new adapter active: activate the
        # policy's everywhere again, and leave every existing parameter as trainable as it was
        policy.set_adapter(active)
        for name, parameter in policy.named_parameters():
            parameter.requires_grad_(flags.get(name, False))
        base = policy.get_base_model()
        self.score = nn.Linear(score_weight.shape[1], score_weight.shape[0], bias=False, device="meta")
        self.score.weight = nn.Parameter(score_weight.to(device=base.device, dtype=base.dtype), requires_grad=False)
        self.policy = policy

    @contextlib.contextmanager
    def active(self):
        """
        The reward adapter active, the policy's off, and the model in eval mode (as stock's reward model runs: no
        dropout); everything as it was afterwards, whatever happens.
        """
        policy = self.policy
        previous = policy.active_adapter
        flags = [(parameter, parameter.requires_grad) for parameter in policy.parameters()]
        training = [module for module in policy.modules() if module.training]
        policy.set_adapter(self.adapter_name, inference_mode=True)
        policy.eval()
        try:
            yield policy
        finally:
            policy.set_adapter(previous)
            for parameter, flag in flags:
                parameter.requires_grad_(flag)
            for module in training:
                module.training = True

    def __call__(self, *args, **kwargs):
        raise RuntimeError("A Hydra reward adapter is scored by rloo_efficient's RLOOTrainer, not called.")


def split_hydra_rewards(reward_funcs: list, policy_base: str | None, policy_dtype, policy_quantization,
                        model_init_kwargs, enabled: bool, warn) -> list:  # fmt: skip
    """`reward_funcs` with each reward adapter that can run on the policy's base replaced by a [`HydraReward`]."""
    out = list(reward_funcs)
    for index, func in enumerate(out):
        adapter = reward_adapter_config(func)
        if adapter is None or not enabled:
            continue
        reason = "the policy is not a PEFT model" if policy_base is None else hydra_reason(
            adapter, policy_base, policy_dtype, policy_quantization, model_init_kwargs, func)  # fmt: skip
        if reason is not None:
            warn(f"rloo_efficient: the reward adapter {func} is loaded as its own model, as stock TRL does: {reason}.")
            continue
        out[index] = HydraReward(func, copy.deepcopy(adapter), name=f"rloo_reward_{index}")
    return out


@contextlib.contextmanager
def saving_policy_adapters_only(reward_funcs: list):
    """
    Within the block, `save_pretrained` of a policy carrying Hydra reward adapters (from `reward_funcs`) saves the
    policy's own adapters only, as stock TRL's policy holds them: PEFT's `selected_adapters`, which also keeps the
    reward adapter's weights out of the saved state (PEFT filters out the adapters its config lists and leaves
    unselected). Transformers' Trainer calls `save_pretrained` on the policy for every checkpoint, `save_model` and
    `push_to_hub`.
    """
    policies: dict[int, tuple] = {}
    for func in reward_funcs:
        if isinstance(func, HydraReward) and func.policy is not None:
            policies.setdefault(id(func.policy), (func.policy, set()))[1].add(func.adapter_name)
    for policy, reward_adapters in policies.values():
        own = [name for name in policy.peft_config if name not in reward_adapters]
        policy.save_pretrained = functools.partial(type(policy).save_pretrained, policy, selected_adapters=own)
    try:
        yield
    finally:
        for policy, _ in policies.values():
            del policy.save_pretrained
