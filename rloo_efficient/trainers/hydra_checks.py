"""
Whether a reward adapter can run on the policy's own base ([`hydra`]) and give stock TRL's rewards and training: the
adapter's type, init, score head, base, dtype and quantization against the policy's, and what the policy's own adapters
and its quantized layers allow. Each check gives the reason it cannot, for the warning, or None.
"""

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig


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


def adapter_weights(path) -> dict[str, torch.Tensor]:
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
    return list(adapter_weights(path))


def score_keys(state) -> list[str]:
    """The keys of a sequence-classification adapter's saved score head (PEFT saves it as a module to save)."""
    return [key for key in state if key.split(".")[-2] in ("score", "classifier") or ".score." in key]


# PEFT's LoRA inits that set the adapter's own weights only (`LoraConfig.init_lora_weights`'s values through peft
# 0.22, besides True and False and those `rewrites_base` names). Compared lower-cased: PEFT lower-cases some of them,
# and gives any other string that is not a base-rewriting init the default init, which sets the adapter's own weights
ADAPTER_ONLY_INITS = ("gaussian", "eva", "orthogonal", "mica", "nora")


def rewrites_base(init, on_load: bool = False) -> bool:
    """
    Whether PEFT (0.18 to 0.22) rewrites the base layers' weights when it creates a LoRA adapter with
    `init_lora_weights=init` (`pissa_init`, `corda_init`, `astra_init`, `olora_init`, `loftq_init`, `lora_ga_init` in
    `peft/tuners/lora/layer.py` subtract the new adapter's product), matching the names as PEFT does. `on_load`: when
    the adapter is loaded from a directory, where LoRA-GA, without the gradients its preprocessing leaves on the
    layers, falls back to the default init.
    """
    if not isinstance(init, str):
        return False
    return init.startswith(("pissa", "corda", "astra")) or init.lower() == "olora" or init == "loftq" or (
        init == "lora_ga" and not on_load)  # fmt: skip


def known_init(init) -> bool:
    """Whether `init_lora_weights=init` is one of the LoRA inits classified here (`rewrites_base`, or
    `ADAPTER_ONLY_INITS`); a newer PEFT's other inits are not, and may rewrite the base."""
    if isinstance(init, bool):
        return True
    return isinstance(init, str) and (init.lower() in ADAPTER_ONLY_INITS or rewrites_base(init))


def policy_hydra_reason(policy_configs) -> str | None:
    """Why no reward adapter can run on the policy's base, given the PEFT configs of the policy's own adapters."""
    for config in policy_configs:
        peft_type = getattr(config, "peft_type", "LORA")
        peft_type = getattr(peft_type, "value", peft_type)  # PEFT's str enum: its value, for the message
        if peft_type != "LORA":  # PEFT adds a LoRA adapter only to a model whose adapters are all LoRA
            return f"the policy's adapter is {peft_type}, not LoRA"
        init = getattr(config, "init_lora_weights", True)
        if rewrites_base(init):
            # Stock's reward model loads the base as saved; the policy's base holds the residual of its adapter's init
            return f"the policy's adapter was created with init_lora_weights={init}, which rewrote its base's weights"
        if not known_init(init):
            return f"the policy's adapter was created with init_lora_weights={init}, not checked against stock TRL"
    return None


def hydra_reason(adapter: dict, policy_base: str, policy_dtype, policy_quantization, model_init_kwargs,
                 path=None) -> str | None:  # fmt: skip
    """
    Why the reward adapter `adapter` (its config; saved in `path`) cannot run on the policy's base and give stock's
    rewards: stock TRL loads it on its own copy of `adapter["base_model_name_or_path"]` with `model_init_kwargs`.
    """
    if adapter.get("peft_type") != "LORA":
        return f"it is a {adapter.get('peft_type')} adapter, not LoRA"
    init = adapter.get("init_lora_weights", True)
    if rewrites_base(init, on_load=True):
        # PEFT rewrites the base layers' weights when it creates such an adapter: on the policy's own weights here,
        # on stock's separate copy there
        return f"its init_lora_weights ({init}) rewrites the base model's weights when the adapter is loaded"
    if not (isinstance(init, bool) or (isinstance(init, str) and init.lower() == "gaussian")):
        return f"its init_lora_weights ({init}) has not been checked against stock TRL"
    if path is not None and not any(key.endswith("weight") for key in score_keys(_adapter_keys(path))):
        # Stock's model gets a score head initialized from the global generator at load time: only loading it the
        # same way reproduces it
        return "it holds no score head weights (stock TRL gives such an adapter a freshly initialized one)"
    base = adapter.get("base_model_name_or_path") or ""
    if not _same_model(base, policy_base):
        return f"its base ({base}) is not the policy's ({policy_base})"
    quantization = (model_init_kwargs or {}).get("quantization_config")
    if _quantization_dict(quantization) != _quantization_dict(policy_quantization):
        return "the policy's base and the reward model stock TRL would load are not quantized alike"
    dtype = resolved_dtype((model_init_kwargs or {}).get("dtype", "auto"), base)  # transformers' default: auto
    if dtype is None:
        return f"the dtype stock TRL would load {base} in cannot be read from its config"
    if dtype != policy_dtype:
        return f"stock TRL would load the reward model in {dtype}, the policy's base is {policy_dtype}"
    return None


def _quantization_dict(quantization) -> dict | None:
    """A quantization config as `from_pretrained` takes it (a transformers `QuantizationConfigMixin`, or a dict: a
    model config's, or a user's with some fields) as the complete dict transformers makes of it, to compare two."""
    if quantization is None:
        return None
    if isinstance(quantization, dict):
        from transformers.quantizers import AutoQuantizationConfig

        try:
            quantization = AutoQuantizationConfig.from_dict(dict(quantization))
        except (ValueError, TypeError, KeyError):  # (not a config transformers reads: compared as it is)
            return dict(quantization)
    return quantization.to_dict() if hasattr(quantization, "to_dict") else {"config": repr(quantization)}


def bitsandbytes_repacks_on_cpu() -> bool:
    """Whether the installed bitsandbytes repacks a 4-bit layer on this CPU the first time the layer runs in eval mode
    without gradients (0.49 and later, where the CPU has AVX512-BF16), as its `Linear4bit` decides."""
    try:
        import bitsandbytes
    except ImportError:  # (then transformers refuses to load the model 4-bit, and says why)
        return False
    return bool(getattr(bitsandbytes.nn.Linear4bit(64, 64), "support_avx512bf16_for_cpu", False))


def loads_on_cpu(device_map) -> bool:
    """Whether `from_pretrained(..., device_map=device_map)` puts a bitsandbytes-quantized model on the CPU: a map
    naming the CPU alone, or none (or "auto") on a machine without an accelerator (bitsandbytes' quantizer places an
    unmapped model on the accelerator where there is one)."""
    named = {str(device) for device in device_map.values()} if isinstance(device_map, dict) else {str(device_map)}
    if named == {"cpu"}:
        return True
    if device_map is None or named <= {"auto", "balanced", "balanced_low_0", "sequential"}:
        return torch.accelerator.current_accelerator() is None
    return False


def quantized_policy_reason(policy_quantization, on_cpu: bool) -> str | None:
    """
    Why no reward adapter can run on the policy's quantized base (`on_cpu`: its layers are on the CPU): there,
    bitsandbytes repacks a 4-bit layer for inference the first time it runs in eval mode without gradients, for good
    ([`bitsandbytes_repacks_on_cpu`]): its scales rounded to bfloat16 and, afterwards, no gradient through it. Stock's
    reward model repacks its own copy; scored on the policy's base, the policy would train with no gradient.
    """
    if not on_cpu or not (_quantization_dict(policy_quantization) or {}).get("load_in_4bit"):
        return None
    if bitsandbytes_repacks_on_cpu():
        return ("on this CPU, bitsandbytes repacks a 4-bit layer for inference when a reward model first runs it (scales "
                "in bfloat16, no gradient through it afterwards): on the policy's base, the policy would stop learning")
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
