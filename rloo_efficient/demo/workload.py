"""
The offline default workload that tests, scripts and benchmarks share: a tiny causal LM with random weights, a
byte-level tokenizer built in code, a dataset of long "summarize this report" prompts, and a programmatic reward.
Nothing comes from the Hub.

The tokenizer maps each byte to one token, so a prompt of `n` ASCII characters is exactly `n` tokens: prompt lengths
are set in tokens directly.
"""

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .tiny_models import (
    ARCHITECTURES,
    IMAGE_PLACEHOLDER,
    MULTIMODAL,
    image_tokens,
    model_config,
    model_from_config,
    ties_by_default,
)
from .tiny_processors import build_processor


SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
PROMPT_HEADER = "Summarize the following report:\n"
# A minimal chat template for conversational prompts: role tags are plain bytes for the byte-level tokenizer
# Content as a string, or as a multimodal processor's blocks (TRL hands a processor its prompts' text as blocks), an
# image written as the family's placeholder (`chat_template(arch)`)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% elif part['type'] == 'image' %}IMAGE{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_template(arch: str | None) -> str:
    return CHAT_TEMPLATE.replace("IMAGE", IMAGE_PLACEHOLDER.get(arch, ""))
# Random-weight models shaped like real ones, for measurements on a GPU: the shapes of Qwen3-0.6B, 1.7B, 4B and 8B
# (vocabulary padded to theirs, so the LM head costs what it costs there), the input embedding tied to the LM head as
# theirs are (up to 4B), bf16
PRESETS = {
    "qwen3-0.6b": dict(arch="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                       max_position_embeddings=40960, model_dtype="bfloat16", tie_word_embeddings=True),
    "qwen3-1.7b": dict(arch="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                       max_position_embeddings=40960, model_dtype="bfloat16", tie_word_embeddings=True),
    "qwen3-4b": dict(arch="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
                     max_position_embeddings=40960, model_dtype="bfloat16", tie_word_embeddings=True),
    "qwen3-8b": dict(arch="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     max_position_embeddings=40960, model_dtype="bfloat16"),
}  # fmt: skip


@dataclass
class WorkloadConfig:
    """The offline workload: a tiny model built from a config, a tokenizer built in code, long prompts, a reward."""

    prompt_length: int = field(default=512, metadata={"help": "Prompt length in tokens (1 token per character)."})
    prompt_length_min: int | None = field(
        default=None,
        metadata={"help": "If set, prompt lengths are drawn uniformly from [prompt_length_min, prompt_length]."},
    )
    num_prompts: int = field(default=64, metadata={"help": "Number of distinct prompts in the dataset."})
    system_prompt_length: int = field(
        default=0,
        metadata={"help": "A system prompt of this many tokens before every prompt, the same for all (as agent datasets "
                  "render instructions and tool docs before each task); prompt_length counts the task after it."},
    )
    conversational: bool = field(default=False, metadata={"help": "Chat-format prompts, rendered by a chat template."})
    image_size: int | None = field(
        default=None,
        metadata={"help": "Give each prompt an image of this many pixels a side (chat prompts, TRL's `image` column), "
                  "random and seeded; every other one twice as wide unless image_width is set (a multimodal arch)."},
    )
    image_width: int | None = field(default=None, metadata={"help": "The width of every image (with image_size)."})
    arch: str = field(default="llama", metadata={"help": "Tiny model architecture.", "choices": list(ARCHITECTURES)})
    hidden_size: int = field(default=128, metadata={"help": "Tiny model hidden size."})
    num_hidden_layers: int = field(default=2, metadata={"help": "Tiny model layers."})
    num_attention_heads: int = field(default=4, metadata={"help": "Tiny model attention heads."})
    num_key_value_heads: int = field(default=2, metadata={"help": "Tiny model key/value heads (GQA)."})
    intermediate_size: int = field(default=256, metadata={"help": "Tiny model MLP size."})
    max_position_embeddings: int = field(default=8192, metadata={"help": "Tiny model context length."})
    head_dim: int | None = field(default=None, metadata={"help": "Attention head size (default hidden/heads)."})
    sliding_window: int | None = field(
        default=None,
        metadata={"help": "A sliding window for the architectures that have one: every other layer for gemma3 and "
                  "gpt_oss (default 512 and 128, as the real models), all layers for mistral and phi3 (default none)."},
    )
    tie_word_embeddings: bool | None = field(
        default=None,
        metadata={"help": "true or false: the LM head's weight is the input embedding's, as in Qwen3 up to 4B, Llama "
                  "3.2 and Gemma (default: as the preset's model, else as the family's config: Gemma's, Cohere 2's, "
                  "SmolLM3's, LFM2's and ERNIE 4.5 MoE's tie it, and of the multimodal ones Gemma 3's and 4's, "
                  "InternVL's, Mistral 3's and LFM2-VL's)."},
    )
    vocab_size: int | None = field(
        default=None,
        metadata={"help": "Pad the byte tokenizer's vocabulary to this size with unused tokens (a real-size LM head)."},
    )
    preset: str | None = field(
        default=None,
        metadata={"help": "A model shape that overrides the size fields above.", "choices": [None, *PRESETS]},
    )
    preset_layers: int | None = field(
        default=None,
        metadata={"help": "The preset's widths with this many layers (a CPU stand-in for the whole model's memory)."},
    )
    model_dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32 or float64."})
    workload_seed: int = field(default=0, metadata={"help": "Seed for the prompts and the model's random weights."})
    model_cache_dir: str = field(
        default=os.environ.get("RLOO_EFFICIENT_CACHE", str(Path.home() / ".cache" / "rloo_efficient")),
        metadata={"help": "Where the tiny model is saved (stock TRL reloads the reference model from its path)."},
    )

    def __post_init__(self):
        if self.preset is not None:
            if self.preset not in PRESETS:
                raise ValueError(f"Unknown preset {self.preset!r}: use one of {', '.join(PRESETS)}.")
            preset = dict(PRESETS[self.preset])
            tied = preset.pop("tie_word_embeddings", None)
            for key, value in preset.items():
                setattr(self, key, value)
            if self.tie_word_embeddings is None:
                self.tie_word_embeddings = tied
            if self.preset_layers is not None:
                self.num_hidden_layers = self.preset_layers
        if self.tie_word_embeddings is None and self.arch in ARCHITECTURES:
            self.tie_word_embeddings = ties_by_default(self.arch)
        if self.vocab_size is not None and self.vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be at least {BYTE_VOCAB_SIZE} (the byte tokenizer's own tokens).")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"Unknown arch {self.arch!r}: use one of {', '.join(ARCHITECTURES)}.")
        if self.model_dtype not in ("float32", "float64", "bfloat16"):
            raise ValueError(f"Unknown model_dtype {self.model_dtype!r}: use float32, float64 or bfloat16.")
        if self.prompt_length < len(PROMPT_HEADER) + 1:
            raise ValueError(f"prompt_length must be at least {len(PROMPT_HEADER) + 1} (the header plus one token).")
        if self.prompt_length_min is not None and not len(PROMPT_HEADER) < self.prompt_length_min <= self.prompt_length:
            raise ValueError(
                f"prompt_length_min must lie in ({len(PROMPT_HEADER)}, prompt_length={self.prompt_length}]."
            )
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be at least 1.")
        if self.system_prompt_length < 0:
            raise ValueError("system_prompt_length must be 0 or more.")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "hidden_size must be divisible by num_attention_heads, and num_attention_heads by num_key_value_heads."
            )

    def check_fits(self, max_completion_length: int) -> None:
        """Fails early when a prompt plus its completion cannot fit the model's context."""
        longest = self.system_prompt_length + self.prompt_length + max_completion_length + (
            32 if self.conversational else 0)  # fmt: skip
        if longest > self.max_position_embeddings:
            raise ValueError(
                f"prompt_length ({self.prompt_length}) + max_completion_length ({max_completion_length}) exceeds the "
                f"model's context (max_position_embeddings={self.max_position_embeddings}). Shorten the prompt or "
                f"completion, or raise max_position_embeddings."
            )


BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256


def build_tokenizer(vocab_size: int | None = None, arch: str | None = None) -> PreTrainedTokenizerFast:
    """
    A byte-level tokenizer: three special tokens, then one token per byte. Deterministic across processes. With
    `vocab_size`, unused tokens `<unused_i>` pad the vocabulary (never produced by encoding; a sampled one decodes to
    its name). With a multimodal `arch`, the family's image tokens follow the bytes, named as its processor reads them.
    """
    # ByteLevel.alphabet() returns a set-ordered list that changes from process to process: sort it
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    extra = [f"<unused_{i}>" for i in range((vocab_size or BYTE_VOCAB_SIZE) - BYTE_VOCAB_SIZE)]
    family_tokens, roles = image_tokens(arch) if arch is not None else ([], {})
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *alphabet, *extra, *family_tokens])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    if family_tokens:
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in family_tokens])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        padding_side="left",
        truncation_side="left",
        **({"extra_special_tokens": roles} if roles else {}),
    )
    tokenizer.chat_template = chat_template(arch)
    return tokenizer


def build_processing_class(cfg: WorkloadConfig):
    """What TRL would load as the processing class: the tokenizer, or a multimodal family's processor around it."""
    tokenizer = build_tokenizer(cfg.vocab_size, cfg.arch)
    return build_processor(cfg, tokenizer) if cfg.arch in MULTIMODAL else tokenizer


def build_model_dir(cfg: WorkloadConfig) -> str:
    """
    Builds the tiny model with seeded random weights and saves it, with the tokenizer, to a directory named after
    its settings (reused when it exists). Returns the path: stock TRL re-creates the reference model from it.
    """
    model_keys = ("arch", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "max_position_embeddings", "model_dtype", "workload_seed")  # fmt: skip
    settings = {key: getattr(cfg, key) for key in model_keys}
    settings.update({key: getattr(cfg, key) for key in ("head_dim", "vocab_size", "sliding_window")
                     if getattr(cfg, key) is not None})  # fmt: skip
    if cfg.tie_word_embeddings:  # (absent when untied: an untied model's directory name does not depend on it)
        settings["tie_word_embeddings"] = True
    if cfg.arch in MULTIMODAL:  # tied by the checkpoint's own flag since 2026-12-07: not a directory built before
        settings["tie_flag"] = "checkpoint"
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    path = Path(cfg.model_cache_dir) / f"{cfg.preset or 'tiny-' + cfg.arch}-{digest}"

    def build():
        tokenizer = build_tokenizer(cfg.vocab_size, cfg.arch)
        # The weights must not depend on the global RNG state of the caller
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.workload_seed)
            model = model_from_config(cfg, model_config(cfg, tokenizer), getattr(torch, cfg.model_dtype))
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return model, tokenizer

    return _built_once(path, ("config.json", "tokenizer.json"), build)


_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "der", "pan", "tel", "gor", "shi", "bu", "fen")


def _report_text(rng: random.Random, length: int) -> str:
    words = []
    total = 0
    while total < length:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.1:
            word += "."
        words.append(word)
        total += len(word) + 1
    return " ".join(words).ljust(length)[:length]  # exactly `length` characters


def build_dataset(cfg: WorkloadConfig) -> Dataset:
    """`num_prompts` prompts of exactly `prompt_length` tokens (or lengths drawn from a range), seeded."""
    rng = random.Random(cfg.workload_seed)
    # The same for every prompt, ending in a newline
    system = _report_text(random.Random(-1 - cfg.workload_seed), cfg.system_prompt_length - 1) + "\n" if (
        cfg.system_prompt_length) else ""  # fmt: skip
    prompts = []
    for _ in range(cfg.num_prompts):
        length = cfg.prompt_length if cfg.prompt_length_min is None else rng.randint(cfg.prompt_length_min,
                                                                                     cfg.prompt_length)  # fmt: skip
        text = PROMPT_HEADER + _report_text(rng, length - len(PROMPT_HEADER))
        if cfg.conversational or cfg.image_size:
            prompts.append(([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": text}])  # fmt: skip
        else:
            prompts.append(system + text)
    if not cfg.image_size:
        return Dataset.from_dict({"prompt": prompts})
    from datasets import Image as ImageFeature
    from PIL import Image

    pixels = np.random.default_rng(cfg.workload_seed)
    widths = [cfg.image_width or cfg.image_size * (1 + i % 2) for i in range(cfg.num_prompts)]
    images = [Image.fromarray(pixels.integers(0, 256, (cfg.image_size, width, 3), np.uint8)) for width in widths]
    return Dataset.from_dict({"prompt": prompts, "image": images}).cast_column("image", ImageFeature())


def completion_text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def vowel_reward(completions, **kwargs) -> list[float]:
    """Fraction of a completion's characters that are vowels: cheap, deterministic, and varies across samples."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        rewards.append(sum(ch in "aeiou" for ch in text) / max(len(text), 1))
    return rewards


def describe(cfg: WorkloadConfig) -> dict:
    return asdict(cfg)


def build_reward_model_dir(cfg: WorkloadConfig) -> str:
    """A one-label sequence classifier shaped like the workload's policy, with its own seeded random weights, saved
    beside it with the tokenizer (stock TRL loads a reward model from its path)."""
    path = Path(cfg.model_cache_dir) / f"reward-{Path(build_model_dir(cfg)).name}"

    def build():
        from transformers import AutoModelForSequenceClassification

        tokenizer = build_tokenizer(cfg.vocab_size)
        config = model_config(cfg, tokenizer)
        config.num_labels = 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.workload_seed + 1)
            model = AutoModelForSequenceClassification.from_config(config, dtype=getattr(torch, cfg.model_dtype))
        return model, tokenizer

    return _built_once(path, ("config.json",), build)


def build_reward_adapter_dir(cfg: WorkloadConfig, rank: int = 16) -> str:
    """A LoRA sequence-classification adapter (with its score head) on the workload's policy, saved as TRL's
    `RewardTrainer` saves one: the Hydra reward. Seeded random weights."""
    base = build_model_dir(cfg)
    path = Path(cfg.model_cache_dir) / f"reward-adapter-r{rank}-{Path(base).name}"

    def build():
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForSequenceClassification

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.workload_seed + 2)
            model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype="auto")
            config = LoraConfig(task_type="SEQ_CLS", r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
            return get_peft_model(model, config), build_tokenizer(cfg.vocab_size)

    return _built_once(path, ("adapter_config.json",), build)


def _built_once(path: Path, markers: tuple[str, ...], build) -> str:
    """
    `path`, saved from `build()` (a model and its tokenizer) unless its `markers` files exist. Under a process group,
    rank 0 builds while the others wait (transformers writes weights from rank 0 only); without one, each process
    builds and the first to finish wins.
    """
    if all((path / marker).exists() for marker in markers):
        return str(path)
    group = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not group or torch.distributed.get_rank() == 0:
        _save_atomically(path, *build())
    if group:
        torch.distributed.barrier()
        if not all((path / marker).exists() for marker in markers):
            raise FileNotFoundError(f"{path} was built by rank 0 and is not visible here: put model_cache_dir on a "
                                    "file system all nodes share.")  # fmt: skip
    return str(path)


def _save_atomically(path: Path, model, tokenizer) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another process finished first: theirs is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
