"""Our config fields ([`SharingArguments`]) on TRL's RLOO and GRPO configs: [`RLOOConfig`] and [`GRPOConfig`]."""

import os
from dataclasses import dataclass, field, fields

import torch
import trl
from trl.trainer.utils import get_config_model_id


EMPTY_CACHE_POLICIES = ("auto", "none", "after_generation", "every_phase")
# The batch key of each row's [group id, prompt length, scored length, tokens] ([`core.tree.rows.row_groups`]), a host
# array per row ([`core.tree.rows.carried`]) that the trainer adds to TRL's batch: its shuffle and split carry them
ROWS_KEY = "rloo_rows"
# A quarter of the device's memory, the default of the budgets `tool_cache_budget_gib` and `held_prefix_budget_gib`:
# the caches held across a tool call are at most the previous call's final cache, which that call held at its end; the
# next call's own prefill and decoding come on top of them
DEFAULT_BUDGET_SHARE = 0.25


def default_budget(device: torch.device) -> int:
    """[`DEFAULT_BUDGET_SHARE`] of the device's memory (the host's for the CPU, or a device that does not say), in
    bytes."""
    properties = getattr(getattr(torch, device.type, None), "get_device_properties", None)
    if device.type != "cpu" and properties is not None:
        return int(DEFAULT_BUDGET_SHARE * properties(device).total_memory)
    return int(DEFAULT_BUDGET_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

SHARING_DOC = r"""
        share_prompt_prefix (`bool`, *optional*, defaults to `True`):
            Process every real token of a micro-batch once: prompts are tokenized once per unique string, and the
            policy, reference and training forwards pack a micro-batch as its prefix tree, one flat sequence holding
            each run of tokens its rows share once (a group's prompt, a system prompt shared across groups,
            completions that open alike) and each completion at its own length, with no padding; each token attends
            to its ancestors and causally within its node through rloo_efficient's attention backend (fused kernels,
            no `(L, L)` mask; see `rloo_efficient.core.attention.tree`), whatever attention implementation the model
            was loaded with. Exact: same log-probs and gradients as the stock forward, to floating-point tolerance;
            sliding windows, attention sinks and recurrent layers included. Models where it cannot be exact (families
            other than those in `rloo_efficient.core.layers.families.MODEL_TYPES`, absolute position embeddings, rotary
            embeddings that depend on the sequence length, bidirectional attention, active dropout, a MoE router with
            jitter) use the stock path, with one warning naming the reason. A MoE model's load-balancing loss (TRL's
            default) is computed exactly from the packed tokens, each weighted by the rows holding it.
        share_generation_prefill (`bool`, *optional*, defaults to `True`):
            In `generate` (the regular transformers path), prefill each distinct prompt once and fan its KV cache out
            to its `k` rows, instead of prefilling `k` copies. Sampling draws the random generator exactly as stock
            TRL's `generate` does, so the same seed gives the same completions. Models where it cannot be exact
            (families outside `MODEL_TYPES`, encoder-decoder, active dropout, caches that are not per-row keys and
            values, a `cache_implementation` other than dynamic) use stock generation, with one warning naming the
            reason; prompts with images are prefilled once with their images where the family's vision path
            allows (docs/families.md), and otherwise go to stock's `generate` for that call, saying why. vLLM and
            continuous batching are untouched (they share prefixes already).
        share_prefill_tree (`bool`, *optional*, defaults to `True`):
            With `share_generation_prefill`, prefill each `generate` call's distinct prompts as their prefix tree,
            through the packed forward: a system prompt opening every prompt once per call, a tool turn's rows' shared
            system prompt and task once, no padding; the keys and values laid out as the padded batch's cache. For
            text prompts and models whose cache holds keys and values (or multi-head latent attention's latents; not
            recurrent states), not under ZeRO-3 or FSDP; elsewhere each distinct prompt is prefilled once, padded.
        share_prompt_kv_cache (`bool` or `None`, *optional*, defaults to `None`):
            With `share_generation_prefill`, keep each prompt's keys and values once per group while decoding,
            instead of fanning them out to its `k` rows: attention is split into the shared prompt and each row's own
            tokens and merged exactly (log-sum-exp, as in Hydragen), two fused-kernel calls per layer and step for all
            rows, sliding windows and sinks included. For the families in `MODEL_TYPES`; other models fan the cache
            out, with one warning naming the reason. `None` chooses per `generate` call by a measured cost model
            (`core.generation.prompt_cache.keep_prompt_once`): kept once where the fanned-out copies would have each layer's
            decoding step read more than the split costs (on a GPU decoding from static buffers, each step a graph
            replay, from 88 MB of copies per layer and step: Qwen3-0.6B's shape at P=3072, k=8, where kept once took
            0.73x the fanned-out time; in `generate`'s own loop, bound by launches, only for large batches of long
            prompts; both from H200 measurements). Fanned out, the
            prompt's decoding cache takes k times the memory (as stock's does): where those copies would take more
            than 10% of a CUDA device's memory, it is kept once whatever the time. `True` keeps it once always (the
            least memory), `False` never.
        tool_cache_budget_gib (`float` or `None`, *optional*, defaults to `None`):
            With `share_generation_prefill` and tools (GRPO's `tools=` or `environment_factory`), hold each row's KV
            cache across a tool call, up to this many GiB, and continue it in the row's next turn: TRL builds that
            turn's input by appending the tool's answer to the row's tokens, so only the tokens added since (the
            tool's answer and the template around it) are prefilled, instead of the row's whole history. A row's
            held tokens stop at its end-of-sequence token; the held caches are released once the next turn has
            copied what its rows continue, and all of them when the tool loop ends. Where they would take more than
            the budget, they are not held, and the next turn prefills as its prefix tree (`share_prefill_tree`).
            `None`: a quarter of the accelerator's memory (of the host's on CPU); `0`: never held. For models whose
            cache holds keys and values (or multi-head latent attention's latents; not recurrent states), text
            prompts, not under ZeRO-3 or FSDP; in a tool loop a sliding-window layer keeps its whole history while
            decoding (masked to its window). Held keys and values were computed one decoding step at a time: they
            equal a fresh prefill's to floating-point rounding.
        held_prefix_budget_gib (`float` or `None`, *optional*, defaults to `None`):
            With `share_prompt_prefix`, forward each prompt once for every micro-batch holding one of its rows, instead
            of once per micro-batch: TRL scores a generation batch in chunks of `per_device_train_batch_size` rows and
            trains on it in micro-batches of that size, so at one or two rows per micro-batch a group's prompt would
            be forwarded `k` or `k / 2` times. The first chunk (or micro-batch) holding one of its rows forwards it
            (or an earlier one, with its own, within one of stock's forwards) and holds what later tokens read of it
            (each layer's keys and values, a recurrent layer's state and convolution tail, a MoE layer's router
            logits); later ones read it. In training, within one optimizer step (and one generation), the prompt is
            forwarded with grad by its first micro-batch, its gradient from the others is banked, and its one
            backward runs inside the Trainer's backward of its last: exactly the gradient of forwarding it in each
            micro-batch, DDP, DeepSpeed and gradient checkpointing unchanged. What is held is released once the last
            micro-batch reading it, or a prompt forwarded with it, is done. Held state beyond this many GiB is not
            held (those prompts are forwarded per micro-batch, as without it). `None`: a quarter of the accelerator's
            memory (of the host's on CPU); `0`: never held. Not in training under reentrant gradient checkpointing
            (`use_reentrant=True`) or FSDP1 (FSDP2 holds).
        static_decoding (`bool` or `None`, *optional*, defaults to `None`):
            With `share_generation_prefill`, decode from the shared prefill's cache in buffers sized for the call
            (each layer's keys and values, the attention mask, positions and tokens written in place; the logits
            processors and stopping criteria `generate` prepares, unchanged), reading back whether every row has
            finished only every 8 steps: no growing cache, no host wait per token (what a captured graph needs).
            The same samples as `generate`, the random generator left as `generate` leaves it. On CUDA each call's
            step is captured once as a CUDA graph and replayed (checked against the eager step at first use; eager
            with one warning where it differs or cannot be captured). The prompt fanned out or kept once per group
            (`share_prompt_kv_cache`: then the rows' own positions alone in buffers); sliding windows take a mask per
            attention type (fanned out); a hybrid's recurrent states stay as transformers updates them (in place).
            Where a call cannot be exact this way (a window over a prompt kept once, a model preparing its own
            decoding inputs or taking per-step ones, such as Nemotron-H, Phi-3 past its original context, Gemma 4's
            shared-key layers over a prompt kept once, flash attention), `generate` decodes, with one warning naming
            why. `None`: on where the step is captured as a graph (CUDA: on an H200 generation took 0.30x
            `generate`'s time at Qwen3-0.6B's shape), off elsewhere (on CPU the eager step is about `generate`'s
            speed), decided once when the trainer is built (the accelerator's device, the policy on one device); the
            generation backend it picks: `core/generation/backends.py`.
        graph_scoring_passes (`bool`, *optional*, defaults to `True`):
            With `share_prompt_prefix`, on CUDA, the no-grad log-prob passes (the old policy's, the reference's) at one
            or two rows per chunk replay their chunks from CUDA graphs: each row packed in full (its completion's
            padding too, as stock's forward computes it), so that the chunks reading one held prompt pack alike; the
            second chunk of a layout captures the forward, the later ones copy their tokens in and replay it (one
            launch instead of a whole forward's). Checked against the eager forward on a model's first captured pass;
            eager, with one warning, where a replay differs or the forward cannot be captured. No effect elsewhere
            (CPU, training forwards, chunks of more rows, images, recurrent layers, the MoE load-balancing loss, ZeRO-3
            and FSDP, where every process must run the same forwards).
        share_reward_prefix (`bool`, *optional*, defaults to `True`):
            Score reward models over the prefix tree of their rows (in the reward model's own tokenization, chat
            template included), with no padding: each run of tokens the rows share once; each row's score read where
            the model's pooling reads it. For the sequence classifiers of the families in `MODEL_TYPES`; others are
            called as stock TRL calls them, with one warning.
        hydra_reward_adapter (`bool`, *optional*, defaults to `True`):
            When the policy is a PEFT LoRA model and a reward function is the directory of a PEFT sequence-
            classification adapter on the same base (as TRL's `RewardTrainer` saves it), load it onto the policy's
            base as a second, frozen adapter with its score head, instead of a second copy of the base model
            (Hydra-RLHF). Rewards are computed with it active and the policy's adapter off, under no gradient. An
            adapter on another base, or in another dtype or quantization than the policy's base, or on a 4-bit
            policy on a CPU with AVX512-BF16 (where bitsandbytes repacks a layer for inference for good), is loaded
            as its own model as stock TRL loads it, with one warning.
        shuffle_groups (`bool` or `None`, *optional*, defaults to `None`):
            When the generation batch is shuffled into micro-batches, move whole prompt groups instead of single
            rows, so a group's completions share a micro-batch (and so its prefix tree) wherever the batch sizes
            allow. Consumes the random generator exactly as the row shuffle does. `None` (the default) turns it on
            where keeping groups together changes only the order of a sum: every micro-batch of a generation feeds
            one optimizer step (`gradient_accumulation_steps` a multiple of `steps_per_generation`; TRL's default has
            them equal) and the loss is a sum over sequences normalized independently of the micro-batch's makeup
            (RLOO's; GRPO's `grpo`, `dr_grpo`, `dapo`, `cispo`, `sapo`, `luspo`, `vespo`), with no per-micro-batch
            term (the MoE load-balancing loss, `bnpo`, `top_entropy_quantile`, the entropy bonus). Per-micro-batch
            averages in the logs (`entropy`, the clip ratios) then average other micro-batches. `False` keeps stock's
            row shuffle exactly; `True` keeps groups together wherever the packed forwards run (the trajectory is then
            no longer stock TRL's where the rule above does not hold; where they fall back, TRL's row order).
        share_under_dropout (`bool`, *optional*, defaults to `False`):
            Share prompts while dropout is active (TRL's `ModelConfig.lora_dropout` is 0.05, so `--use_peft` runs
            with LoRA dropout unless `disable_dropout=True`), instead of every sharing path falling back to stock's:
            a token forwarded once (a prompt in the packed forwards, the shared prefill, a prompt held across
            micro-batches) draws one dropout mask for every row holding it. Each row's masks are distributed as
            stock's, so the expected loss and gradient of every row, and of their sum, are stock's; the rows' masks
            are no longer independent and the samples are not stock's, so the same seed gives other numbers. Dropout
            applied as a function (attention probabilities') still falls back. Decoding steps aside from static
            buffers where dropout is active. Never on by default.
        empty_cache_policy (`str`, *optional*, defaults to `"auto"`):
            When to return cached allocator memory to the system: `"none"`, `"after_generation"` (once per generation,
            when decoding's KV cache is dead) or `"every_phase"` (after generation, each log-prob pass, the reward, the
            training forward/backward and the optimizer step). On an accelerator this is `empty_cache()`; on CPU with
            glibc, `malloc_trim(0)`. The time spent is logged as `time/cache_release_s`; the phase profiler releases it,
            so only with `profile_memory=True` (the memory report records the policy as it ran; `"after_generation"` or
            `"every_phase"` with `profile_memory=False` is refused, and `"auto"` then releases nothing). `"auto"`:
            `"after_generation"` on CPU, where it gave 0.91x the working memory of `"none"` for 6 ms per step (P=2048,
            C=64, k=8); `"none"` on an accelerator, where the caching allocator must allocate again what was released:
            on an H200 a `generate` call right after `empty_cache()` took 1.13-1.16x the time of one on a warm
            allocator, stock's included (see README).
        profile_memory (`bool`, *optional*, defaults to `True`):
            Record each phase's peak memory and time (`memory/<phase>/<stat>` and `time/<phase>_s` in the logs) and
            write `memory_report.json` to `output_dir`. Costs a counter reset and a read per phase boundary."""


@dataclass
class SharingArguments:
    """rloo_efficient's own fields, shared by [`RLOOConfig`] and [`GRPOConfig`] (documented there)."""

    share_prompt_prefix: bool = field(
        default=True,
        metadata={"help": "Pack each micro-batch as its prefix tree: each shared run of tokens once, no padding."},
    )
    share_generation_prefill: bool = field(
        default=True,
        metadata={"help": "Prefill each distinct prompt once in generate and fan its KV cache out to its k rows."},
    )
    share_prefill_tree: bool = field(
        default=True,
        metadata={"help": "Prefill each generate call's prompts as their prefix tree (with share_generation_prefill): "
                          "a system prompt once per call, no padding."},
    )
    share_prompt_kv_cache: bool | None = field(
        default=None,
        metadata={"help": "Keep each prompt's KV cache once per group while decoding (with share_generation_prefill): "
                          "True always, False never, None (default) where a cost model says it is faster."},
    )
    tool_cache_budget_gib: float | None = field(
        default=None,
        metadata={"help": "Hold each row's KV cache across a tool call, up to this many GiB, and continue it in its "
                          "next turn (None: a quarter of the device's memory; 0: never)."},
    )
    held_prefix_budget_gib: float | None = field(
        default=None,
        metadata={"help": "Forward each prompt once for all the micro-batches (and log-prob chunks) holding its rows, "
                          "holding its state up to this many GiB (None: a quarter of the device's memory; 0: never)."},
    )
    static_decoding: bool | None = field(
        default=None,
        metadata={"help": "Decode from static buffers after the shared prefill (no growing cache, no host read per "
                          "token), each call's step captured as a CUDA graph on CUDA (with share_generation_prefill). "
                          "None (default): on CUDA, off elsewhere (decided when the trainer is built)."},
    )
    graph_scoring_passes: bool = field(
        default=True,
        metadata={"help": "On CUDA, replay the no-grad log-prob passes' chunks of one or two rows from CUDA graphs (with "
                          "share_prompt_prefix)."},
    )
    share_reward_prefix: bool = field(
        default=True,
        metadata={"help": "Score reward models over the prefix tree of their rows (each shared run once, no padding)."},
    )
    hydra_reward_adapter: bool = field(
        default=True,
        metadata={"help": "Load a reward LoRA adapter on the policy's own base instead of a second model copy."},
    )
    shuffle_groups: bool | None = field(
        default=None,
        metadata={"help": "Shuffle whole prompt groups, not rows, into micro-batches: None (default) where that only "
                          "reorders a sum, True always, False never (stock's row shuffle)."},
    )
    share_under_dropout: bool = field(
        default=False,
        metadata={"help": "Share prompts under active dropout (LoRA's lora_dropout, say): a token forwarded once draws "
                          "one dropout mask for every row holding it. Each row's masks are distributed as stock's "
                          "(the same expected gradient), but they are not stock's samples. Never on by default."},
    )
    empty_cache_policy: str = field(
        default="auto",
        metadata={"help": "When to release cached allocator memory.", "choices": list(EMPTY_CACHE_POLICIES)},
    )
    profile_memory: bool = field(
        default=True,
        metadata={"help": "Record per-phase peak memory and time in the logs and in `memory_report.json`."},
    )


OUR_FIELDS = tuple(spec.name for spec in fields(SharingArguments))
# Every switch off: what a trainer built without our `__init__` reads (see `GroupSharingMixin._constructed`)
STOCK_SETTINGS = SharingArguments(share_prompt_prefix=False, share_generation_prefill=False,
                                  share_prefill_tree=False, share_prompt_kv_cache=False, tool_cache_budget_gib=0,
                                  held_prefix_budget_gib=0, share_reward_prefix=False, hydra_reward_adapter=False,
                                  shuffle_groups=False, share_under_dropout=False, empty_cache_policy="none",
                                  profile_memory=False, graph_scoring_passes=False)  # fmt: skip


def sharing_settings(args) -> SharingArguments:
    """Our settings as `args` holds them: its own values where it is one of our configs, the defaults otherwise (a
    stock config, or none)."""
    return SharingArguments(**{name: getattr(args, name) for name in OUR_FIELDS if hasattr(args, name)})


class _SharingConfigMixin:
    """Validation and conversion shared by our configs; `_stock` is the TRL config class they extend."""

    _stock: type

    @classmethod
    def of(cls, args, model):
        """The config a trainer of `model` runs with given `args`: ours as given; a stock config as ours
        ([`from_stock`]); None as stock's default config, named as stock names it (`<model>-RLOO`), but ours."""
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            return cls(f"{name.split('/')[-1]}-{cls._stock.__name__.removesuffix('Config')}")
        return cls.from_stock(args) if type(args) is cls._stock else args

    @classmethod
    def from_stock(cls, args):
        """A copy of an already validated stock config, with our fields at their defaults."""
        config = cls.__new__(cls)
        config.__dict__.update(args.__dict__)
        config.__dict__.update(vars(SharingArguments()))
        return config

    def to_stock(self):
        """The same settings as the stock TRL config, without our fields (to run stock TRL side by side)."""
        config = self._stock.__new__(self._stock)
        config.__dict__.update({key: value for key, value in self.__dict__.items() if key not in OUR_FIELDS})
        return config

    def __post_init__(self):
        for name in OUR_FIELDS:
            value = getattr(self, name)
            kind = SharingArguments.__dataclass_fields__[name].type
            optional = kind in (bool | None, "bool | None")
            if kind in (bool, "bool", bool | None, "bool | None") and not (
                    isinstance(value, bool) or (optional and value is None)):  # fmt: skip
                # "false" would be truthy and turn the feature on
                allowed = "True, False or None" if optional else "True or False"
                raise ValueError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__}).")
        for name in ("tool_cache_budget_gib", "held_prefix_budget_gib"):
            budget = getattr(self, name)
            if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float) or budget < 0):
                raise ValueError(f"{name} must be None or a number of GiB >= 0 (0: never hold), got {budget!r}.")
        if self.empty_cache_policy not in EMPTY_CACHE_POLICIES:
            raise ValueError(
                f"Unknown empty_cache_policy {self.empty_cache_policy!r}: use one of {', '.join(EMPTY_CACHE_POLICIES)}."
            )
        if not self.profile_memory and self.empty_cache_policy in ("after_generation", "every_phase"):
            raise ValueError(
                f"empty_cache_policy={self.empty_cache_policy!r} releases the cache at the memory profiler's phase "
                "boundaries, and profile_memory=False turns the profiler off, so nothing would be released: set "
                "profile_memory=True (a counter read per phase boundary) or empty_cache_policy='none'."
            )
        try:
            super().__post_init__()  # stock TRL's checks
        except ValueError as error:
            if "must be divisible by num_generations" not in str(error):
                raise
            # Say which numbers make the generation batch, so the launch can be fixed before any model loads
            raise ValueError(
                f"{error} The generation batch is per_device_train_batch_size ({self.per_device_train_batch_size}) x "
                f"processes ({self.world_size}) x steps_per_generation ({self.steps_per_generation}): change one of "
                f"them (or num_generations) so that every prompt's {self.num_generations} completions fit whole."
            ) from error


@dataclass
class RLOOConfig(_SharingConfigMixin, SharingArguments, trl.RLOOConfig):
    __doc__ = f"""
    Configuration for [`rloo_efficient.RLOOTrainer`]: every field of [`trl.RLOOConfig`], plus the ones below. With
    `share_prompt_prefix=False`, `share_generation_prefill=False`, `share_reward_prefix=False`,
    `hydra_reward_adapter=False`, `shuffle_groups=False` and `empty_cache_policy="none"`, training is stock TRL's.

    Parameters:{SHARING_DOC}
    """

    _stock = trl.RLOOConfig


@dataclass
class GRPOConfig(_SharingConfigMixin, SharingArguments, trl.GRPOConfig):
    __doc__ = f"""
    Configuration for [`rloo_efficient.GRPOTrainer`]: every field of [`trl.GRPOConfig`], plus the ones below. With
    `share_prompt_prefix=False`, `share_generation_prefill=False`, `share_reward_prefix=False`,
    `hydra_reward_adapter=False`, `shuffle_groups=False` and `empty_cache_policy="none"`, training is stock TRL's.

    Parameters:{SHARING_DOC}
    """

    _stock = trl.GRPOConfig
