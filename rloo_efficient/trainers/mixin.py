"""
The one mixin that binds the core to a TRL group trainer: [`trl.RLOOTrainer`], [`trl.GRPOTrainer`], or a subclass of
either (TRL's own `GMPOTrainer`, a user's). It wraps TRL's methods and calls `super()` in each; no TRL method body is
copied. The batch's rows ([`core.tree.rows.row_groups`]: each row's group, lengths and tokens) are read once per
generation batch from the token lists TRL's `_generate` returns, are active while TRL's own no-grad passes run, travel
with the batch TRL returns (TRL's shuffle and split carry them), and are active again while TRL's loss runs for each
micro-batch, which packs them as its prefix tree ([`core.tree.radix`]).
"""

import inspect
import warnings

import numpy as np
import torch
from accelerate.utils import is_peft_model
from transformers import AutoTokenizer, PreTrainedModel
from trl.trainer.utils import get_config_model_id, split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from ..core.generation.generate import (
    generation_unsupported_reason,
)
from ..core.generation.prompt_cache import prefix_cache_unsupported_reason
from ..core.generation.turn_cache import TurnCaches, continue_reason
from ..core.layers.families import forward_unsupported_reason, is_multimodal
from ..core.layers.install import install
from ..core.layers.moe import aux_loss_reason
from ..core.layers.vision import (
    VISION_FAMILIES,
    image_token_ids,
    vision_reason,
)
from ..core.once import WarnOnce
from ..core.tree.rows import group_shuffle_order, prompt_images, row_groups
from .config import ROWS_KEY, STOCK_SETTINGS, default_budget, sharing_settings
from .generation import SharedGenerationMixin
from .held_prefix import HeldPrefixMixin
from .hydra import HydraReward, resolved_dtype, reward_adapter_config, saving_policy_adapters_only, split_hydra_rewards
from .packed import PackedForwardMixin
from .rewards import RewardSharingMixin


# The modules of the losses `_group_shuffle_reason` reads
TRL_LOSSES = ("trl.trainer.rloo_trainer", "trl.trainer.grpo_trainer")


def _supported(reason: str | None, consequence: str) -> bool:
    """True when there is no `reason` against a feature; otherwise warns `consequence: reason` and returns False."""
    if reason is not None:
        warnings.warn(f"rloo_efficient: {consequence}: {reason}.", stacklevel=3)
    return reason is None


class GroupSharingMixin(PackedForwardMixin, SharedGenerationMixin, HeldPrefixMixin, RewardSharingMixin):
    """
    Each prompt once per group in every phase of a TRL group trainer. Mix it in before the trainer class,
    `class MyTrainer(GroupSharingMixin, trl.GRPOTrainer)`; [`RLOOTrainer`] and [`GRPOTrainer`] are built so. The
    switches are our config's fields ([`config.SharingArguments`]), read from `args` with their defaults where `args`
    is a stock config.

    TRL methods wrapped (each calls `super()`), and why:
    - `__init__`: a reward adapter on the policy's base attached to the policy instead of loaded as a second model
      (Hydra); our attention function installed on the policy and the reference.
    - `_tokenize_prompts`: each distinct prompt (and environment) tokenized once; its rows get copies.
    - `_generate_single_turn`: while it runs, the model's `generate` prefills each distinct prompt once
      ([`core.generation.generate`]), its images encoded once ([`core.layers.vision`]); vLLM and continuous batching go to TRL
      untouched.
    - `_generate`: the group structure, from the token lists it returns, becomes active for the no-grad passes; while
      it runs (GRPO's tool loop), each turn's KV caches are held for the rows' next turn ([`core.generation.turn_cache`],
      `tool_cache_budget_gib`), and released when it returns.
    - `_generate_and_score_completions`: the structure is added to the batch it returns; keeping groups together
      (`shuffle_groups`, by default where that only reorders a sum: [`_group_shuffle_reason`]), the
      batch is ordered so that TRL's own shuffle, drawn next, leaves each group's rows together.
    - `_compute_loss`: the micro-batch's structure is active while TRL's loss runs.
    - `_get_per_token_logps_and_entropies`: the packed forward ([`core.forward.packing`]) when the active structure matches
      the batch it is given; TRL's otherwise.
    - `_calculate_rewards` (see [`rewards.RewardSharingMixin`]): reward models scored from packed rows.
    - `_save`: a Hydra reward adapter is left out of the saved policy.
    """

    _config_class: type | None = None  # our config for this trainer: a stock config of its base class becomes one
    # What a trainer built without our `__init__` reads ([`_constructed`]): every switch off, so each wrapper passes
    # through to TRL's method
    _settings = STOCK_SETTINGS
    _share_prefix = _share_prefill = _prompt_cache_once = _keep_groups = False
    _turn_budget: int | None = None  # bytes a tool loop's held caches may take, or None: not held
    _turns = None  # a tool loop's held caches, while TRL's `_generate` runs
    _active_rows: torch.Tensor | None = None

    def __init__(self, model, reward_funcs=None, args=None, *positional, **kwargs):
        if self._config_class is not None and type(args) is self._config_class._stock:
            args = self._config_class.from_stock(args)
        self._settings = sharing_settings(args)
        self._warnings = WarnOnce()  # this run's fallbacks, each said once
        self._active_rows: torch.Tensor | None = None  # the group structure TRL's current forwards use
        self.packed_forward_tokens = 0  # tokens the packed forward processed (deterministic; read by tests)
        self.scoring_forward_calls = 0  # model calls of the packed no-grad passes, held prompts' included (tests)
        self.tree_tokens = 0  # the real tokens of the prefix trees those forwards packed (each shared run once)
        self.shared_prefill_tokens = 0  # prompt tokens the shared generation prefill forwarded (read by tests)
        self.reward_forward_tokens = 0  # tokens the packed reward forward processed (read by tests)
        reward_funcs = self._hydra_reward_funcs(model, reward_funcs, args, positional, kwargs)
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self._attach_hydra_rewards()
        unwrapped = self.accelerator.unwrap_model(self.model)
        self._share_prefix = self._settings.share_prompt_prefix
        if self._share_prefix:
            reason = forward_unsupported_reason(unwrapped, self._settings.share_under_dropout)
            if reason is None and self.aux_loss_enabled:
                reason = aux_loss_reason(unwrapped)
            if reason is not None:
                self._fall_back(reason)
        if self._share_prefix:  # prompts held across a pass's chunks and a step's micro-batches, within the budget
            self._init_holds(self._settings.held_prefix_budget_gib)
        # Batches with images: packed for the families whose image placement and positions are known (else stock's)
        self._vision_reason = vision_reason(unwrapped) if is_multimodal(unwrapped) else "the model has no vision tower"
        self._vision = VISION_FAMILIES[unwrapped.config.model_type] if self._vision_reason is None else None
        self._image_tokens = image_token_ids(unwrapped)
        other_backend = self.use_vllm or self.use_transformers_continuous_batching  # they share prefixes already
        if other_backend and self._settings.share_generation_prefill:
            backend = "vLLM" if self.use_vllm else "transformers' continuous batching"
            warnings.warn(f"rloo_efficient: generation runs stock TRL's {backend} backend (it shares prompts in its "
                          f"own cache), so our shared prefill is off; the log-prob, training and reward passes are "
                          f"still ours.", stacklevel=2)  # fmt: skip
        self._share_prefill = (
            self._settings.share_generation_prefill
            and not other_backend
            and _supported(generation_unsupported_reason(unwrapped, self.generation_config,
                                                         self._settings.share_under_dropout),
                           "the shared generation prefill is off, using stock TRL's generate")
        )  # fmt: skip
        keep_once = self._settings.share_prompt_kv_cache  # True, False, or None: chosen per call by its cost
        can_keep_once = (
            self._share_prefill
            and keep_once is not False
            and _supported(prefix_cache_unsupported_reason(unwrapped),
                           "the prompt's KV cache is fanned out to every completion while decoding (the prefill is "
                           "still shared)")
        )  # fmt: skip
        self._prompt_cache_once = keep_once if can_keep_once else False  # True, or None: chosen per call
        # A tool loop's rows continue their caches from turn to turn, within the budget
        budget = self._settings.tool_cache_budget_gib
        if (
            self._share_prefill
            and bool(getattr(self, "tools", None))
            and budget != 0
            and _supported(continue_reason(unwrapped),
                           "each later tool turn prefills its rows' histories (as their prefix tree where it can)")
        ):  # fmt: skip
            self._turn_budget = default_budget(self.accelerator.device) if budget is None else int(budget * 1024**3)
        # Groups kept together across a generation's micro-batches (one micro-batch: nothing to keep together, and
        # its rows stay in stock's order)
        several = self._share_prefix and self.args.steps_per_generation > 1  # packed micro-batches to keep groups in
        self._keep_groups = bool(self._settings.shuffle_groups) and several
        if self._settings.shuffle_groups is None and several:
            reason = self._group_shuffle_reason()  # by default, where keeping groups together only reorders a sum
            self._keep_groups = reason is None
            if reason is not None:
                warnings.warn(f"rloo_efficient: micro-batches follow TRL's row shuffle, which splits groups "
                              f"(shuffle_groups=True keeps them together anyway): {reason}.", stacklevel=2)  # fmt: skip
        if self._share_prefix or self._prompt_cache_once is not False:
            # Our forwards pass a layout to the attention modules; without one they run the model's own attention.
            # TRL has wrapped the reference already (a DeepSpeed engine, FSDP, DDP): install on the model inside
            for inner in (unwrapped, self.ref_model):
                if inner is not None:
                    install(self.accelerator.unwrap_model(inner))

    def _group_shuffle_reason(self) -> str | None:
        """Why keeping each group's rows in one micro-batch would change more than the order of a sum, or None: every
        micro-batch of a generation must feed one optimizer step, and the loss must be a sum over sequences normalized
        independently of which rows share a micro-batch."""
        args = self.args
        if args.gradient_accumulation_steps % args.steps_per_generation:
            return (f"gradient_accumulation_steps ({args.gradient_accumulation_steps}) is not a multiple of "
                    f"steps_per_generation ({args.steps_per_generation}): a generation's micro-batches feed several "
                    "optimizer steps")  # fmt: skip
        for method in ("compute_loss", "_compute_loss"):  # TRL's own RLOO or GRPO loss, read below
            owner = next(cls for cls in type(self).__mro__ if method in cls.__dict__ and cls is not GroupSharingMixin)
            if owner.__module__ not in TRL_LOSSES:
                return f"{type(self).__name__} computes its own loss ({owner.__name__}.{method})"
        if self.aux_loss_enabled:
            return "the MoE load-balancing loss is computed per micro-batch"
        if getattr(self, "loss_type", None) == "bnpo":
            return "the bnpo loss is normalized by each micro-batch's tokens"
        if getattr(self, "top_entropy_quantile", 1.0) < 1.0:
            return "top_entropy_quantile takes its threshold over each micro-batch's tokens"
        if getattr(self, "_entropy_bonus_enabled", False):
            return "the entropy bonus is a mean over each micro-batch's tokens"
        return None

    @property
    def _constructed(self) -> bool:
        """
        Whether our `__init__` ran. A trainer made without it (a unit test's bare `object.__new__(GRPOTrainer)` with
        hand-set attributes, as TRL's own tests make one) reads the class defaults: every sharing switch off, and each
        of our wrappers is TRL's method.
        """
        return "_settings" in vars(self)

    @property
    def _trl_base(self) -> type:
        """The TRL trainer class this one derives from (the first class of TRL's in the method resolution order)."""
        return next(cls for cls in type(self).__mro__ if cls.__module__.startswith("trl."))

    # -- Hydra -------------------------------------------------------------------------------------------------------
    def _hydra_reward_funcs(self, model, reward_funcs, args, positional, kwargs) -> list:
        """`reward_funcs` with each reward adapter that can share the policy's base replaced by a [`HydraReward`]."""
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        if not any(reward_adapter_config(func) for func in funcs):
            return reward_funcs
        signature = inspect.signature(self._trl_base.__init__)
        bound = signature.bind(self, model, reward_funcs, args, *positional, **kwargs)
        init_kwargs = getattr(args, "model_init_kwargs", None) or {}
        peft_config = bound.arguments.get("peft_config")
        base = dtype = quantization = None
        if isinstance(model, str) and peft_config is not None:
            # TRL loads the policy with `model_init_kwargs` (float32 unless they say otherwise)
            base, dtype = model, resolved_dtype(init_kwargs.get("dtype", "float32"), model)
            quantization = init_kwargs.get("quantization_config") or bound.arguments.get("quantization_config")
        elif is_peft_model(model) or (peft_config is not None and isinstance(model, PreTrainedModel)):
            # A PeftModel, or a model object that TRL wraps with `peft_config` further down its constructor
            policy_base = model.get_base_model() if is_peft_model(model) else model
            base, dtype = get_config_model_id(policy_base.config), policy_base.dtype
            quantization = getattr(policy_base.config, "quantization_config", None)
        # The policy's adapters: the ones it comes with (a PeftModel's, or a model's loaded through transformers'
        # `load_adapter`), and the one TRL creates from `peft_config`
        configs = list(getattr(model, "peft_config", {}).values())  # a path has none
        configs += [peft_config] if peft_config is not None else []
        return split_hydra_rewards(funcs, base, dtype, quantization, init_kwargs, self._settings.hydra_reward_adapter,
                                   lambda message: warnings.warn(message, stacklevel=5), configs)  # fmt: skip

    def _attach_hydra_rewards(self) -> None:
        """Loads each Hydra reward adapter onto the policy, and its tokenizer where none was given (as stock would)."""
        for index, func in enumerate(self.reward_funcs):
            if not isinstance(func, HydraReward):
                continue
            func.attach(self.accelerator.unwrap_model(self.model))
            tokenizer = self.reward_processing_classes[index]
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(func.adapter["base_model_name_or_path"],
                                                          trust_remote_code=self.args.trust_remote_code)  # fmt: skip
                self.reward_processing_classes[index] = tokenizer
            if tokenizer.pad_token_id is None:  # as stock does for a reward model's tokenizer, given or loaded
                tokenizer.pad_token = tokenizer.eos_token

    def _save(self, output_dir: str | None = None, state_dict=None):
        """Stock's save, of the policy alone: a Hydra reward adapter on the policy is not part of what it saves (every
        checkpoint, `save_model` and `push_to_hub` save through here)."""
        with saving_policy_adapters_only(self.reward_funcs):
            return super()._save(output_dir, state_dict)

    def _fall_back(self, reason: str, permanent: bool = True) -> None:
        if permanent:
            self._share_prefix = False
        self._warnings.warn(f"rloo_efficient: prompt-prefix sharing is off{'' if permanent else ' for such batches'}, "
                            f"using stock TRL's forward: {reason}.", key=reason, stacklevel=3)  # fmt: skip

    def _warn_once(self, message: str) -> None:
        self._warnings.warn(message, stacklevel=3)

    # -- the group structure: computed, carried, made active ---------------------------------------------------------
    def _scored_lengths(self, completion_ids_list: list[list[int]]) -> list[int]:
        """Completion tokens stock TRL scores per row: all of them, or none for a masked truncated completion."""
        if not self.mask_truncated_completions:
            return [len(ids) for ids in completion_ids_list]
        ends = {*self.eos_token_ids, self._tokenizer.pad_token_id}
        return [len(ids) if ids and ids[-1] in ends else 0 for ids in completion_ids_list]

    def _generate(self, prompts: list):
        self._turns = TurnCaches(self._turn_budget) if self._turn_budget is not None else None
        try:
            result = super()._generate(prompts)  # TRL's tool loop runs in it: each turn's caches held for the next
        finally:
            if self._turns is not None and self._turns.over_budget:
                self._warn_once("rloo_efficient: a tool turn's KV caches were not held across the tool call: they "
                                "would take more than tool_cache_budget_gib; the next turn prefilled its rows' "
                                "histories instead")  # fmt: skip
            self._turns = None  # every held cache released
        if not self._constructed:
            return result
        prompt_ids, completion_ids = result[0], result[1]  # RLOO's and GRPO's both lead with the token lists
        images = prompt_images(prompts)
        self._active_rows = row_groups(prompt_ids, self._scored_lengths(completion_ids), images, completion_ids)
        if images is not None and any(ids and ids[-1] in self._image_tokens for ids in prompt_ids):
            # Each row's copy of its prompt's last token would be an image's: its features would be needed per row
            self._fall_back("a prompt ends with an image's token", permanent=False)
            self._active_rows = None
        tool_images = result[7] if len(result) > 7 else None  # GRPO: images a tool returned, per row
        if self._is_vlm and tool_images and any(tool_images):
            # In the rows' completions, each row's own: the packed forward takes images from the prompts only
            self._fall_back("a tool returned images", permanent=False)
            self._active_rows = None
        return result

    def _generate_and_score_completions(self, inputs):
        self._active_rows = None
        try:
            output = super()._generate_and_score_completions(inputs)
            rows = self._active_rows
        finally:
            self._active_rows = None
        if rows is None:
            return output
        output[ROWS_KEY] = rows  # a (B, 3 + W) CPU tensor: TRL's shuffle and split carry it with the batch
        if self._keep_groups and self.model.training:
            output = self._ordered_for_group_shuffle(output, rows[:, 0])
        return output

    @staticmethod
    def _ordered_for_group_shuffle(batch: dict, group_ids: torch.Tensor) -> dict:
        """
        `batch` reordered so that TRL's row shuffle, drawn right after from the global generator (one
        `torch.randperm(B)` in `_prepare_inputs`), lands each group's rows together ([`group_shuffle_order`]). The
        generator's state is put back: the draws stay stock's.
        """
        # TRL's randperm draws on the default device (set_default_device("cuda"): CUDA's generator): so does ours
        device = torch.get_default_device()
        forked = {"devices": []} if device.type == "cpu" else {"devices": [device], "device_type": device.type}
        with torch.random.fork_rng(**forked):
            permutation = torch.randperm(len(group_ids)).cpu()
        wanted = group_shuffle_order(group_ids, permutation)  # the rows TRL's shuffle should put at each place
        before = np.empty_like(wanted)
        before[permutation.numpy()] = wanted  # TRL takes before[permutation]: that is wanted
        index = torch.from_numpy(before)

        def take(value):
            if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
                return value
            if isinstance(value, torch.Tensor):
                return value[index.to(value.device)]
            return [value[i] for i in before]

        # Images by row first, as TRL's own shuffle takes them (a row may hold several images, or none)
        return unsplit_pixel_values_by_grid({key: take(value) for key, value in split_pixel_values_by_grid(
            batch).items()})  # fmt: skip

    def _compute_loss(self, model, inputs):
        previous, self._active_rows = self._active_rows, inputs.get(ROWS_KEY)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._active_rows = previous
