"""
Hydra (arXiv 2309.00754): when the policy is a PEFT LoRA model and a reward function is the directory of a PEFT
sequence-classification adapter on the same base (as TRL's `RewardTrainer` saves it), the adapter is loaded onto the
policy's own base as a second, frozen adapter, with its score head, instead of loading a second copy of the base.
Rewards are computed with it active and the policy's adapter off, under no gradient, and the policy's adapter and
every parameter's `requires_grad` are restored afterwards, also when the computation raises.
"""

import contextlib
import copy
import functools
import inspect
import warnings

import torch
from accelerate.utils import is_peft_model
from torch import nn
from transformers import AutoTokenizer, PreTrainedModel
from trl.trainer.utils import get_config_model_id

from .hydra_checks import (
    adapter_weights,
    hydra_reason,
    loads_on_cpu,
    policy_hydra_reason,
    quantized_policy_reason,
    resolved_dtype,
    reward_adapter_config,
    score_keys,
)


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

        state = adapter_weights(self.path)
        score = score_keys(state)
        score_weight = state[next(key for key in score if key.endswith("weight"))]
        for key in score:
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
                        model_init_kwargs, enabled: bool, warn, policy_configs=(), *, on_cpu: bool) -> list:  # fmt: skip
    """
    `reward_funcs` with each reward adapter that can run on the policy's base replaced by a [`HydraReward`].
    `policy_base` is None when the policy is not a PEFT model; `policy_configs` are its adapters' PEFT configs;
    `on_cpu`: the policy's layers are on the CPU.
    """
    out = list(reward_funcs)
    shared_reason = "the policy is not a PEFT model" if policy_base is None else (
        policy_hydra_reason(policy_configs) or quantized_policy_reason(policy_quantization, on_cpu))  # fmt: skip
    for index, func in enumerate(out):
        adapter = reward_adapter_config(func)
        if adapter is None or not enabled:
            continue
        reason = shared_reason or hydra_reason(
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


def hydra_reward_funcs(trl_init, model, reward_funcs, args, positional, kwargs, enabled: bool | None):
    """`reward_funcs` as TRL's trainer `__init__` (`trl_init`) is given them, with each reward adapter that can share
    the policy's base replaced by a [`HydraReward`] (`enabled`: the config's `hydra_reward_adapter`)."""
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    if not any(reward_adapter_config(func) for func in funcs):
        return reward_funcs
    bound = inspect.signature(trl_init).bind(None, model, reward_funcs, args, *positional, **kwargs)
    init_kwargs = getattr(args, "model_init_kwargs", None) or {}
    peft_config = bound.arguments.get("peft_config")
    base = dtype = quantization = None
    on_cpu = False
    if isinstance(model, str) and peft_config is not None:
        # TRL loads the policy with `model_init_kwargs` (float32 unless they say otherwise)
        base, dtype = model, resolved_dtype(init_kwargs.get("dtype", "float32"), model)
        quantization = init_kwargs.get("quantization_config") or bound.arguments.get("quantization_config")
        on_cpu = loads_on_cpu(init_kwargs.get("device_map"))  # (the Trainer leaves a quantized model where it loads)
    elif is_peft_model(model) or (peft_config is not None and isinstance(model, PreTrainedModel)):
        # A PeftModel, or a model object that TRL wraps with `peft_config` further down its constructor
        policy_base = model.get_base_model() if is_peft_model(model) else model
        base, dtype = get_config_model_id(policy_base.config), policy_base.dtype
        quantization = getattr(policy_base.config, "quantization_config", None)
        on_cpu = policy_base.device.type == "cpu"
    # The policy's adapters: the ones it comes with (a PeftModel's, or a model's loaded through transformers'
    # `load_adapter`), and the one TRL creates from `peft_config`
    configs = list(getattr(model, "peft_config", {}).values())  # a path has none
    configs += [peft_config] if peft_config is not None else []
    return split_hydra_rewards(funcs, base, dtype, quantization, init_kwargs, enabled,
                               lambda message: warnings.warn(message, stacklevel=5), configs, on_cpu=on_cpu)  # fmt: skip


def attach_hydra_rewards(reward_funcs: list, processing_classes: list, policy, trust_remote_code: bool) -> None:
    """Loads each Hydra reward adapter onto `policy` (unwrapped), and its tokenizer where none was given (as stock
    would), into `processing_classes` (the trainer's list, edited in place)."""
    for index, func in enumerate(reward_funcs):
        if not isinstance(func, HydraReward):
            continue
        func.attach(policy)
        tokenizer = processing_classes[index]
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(func.adapter["base_model_name_or_path"],
                                                      trust_remote_code=trust_remote_code)  # fmt: skip
            processing_classes[index] = tokenizer
        if tokenizer.pad_token_id is None:  # as stock does for a reward model's tokenizer, given or loaded
            tokenizer.pad_token = tokenizer.eos_token
