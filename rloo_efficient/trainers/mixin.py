"""
The one mixin that binds the core to a TRL group trainer: [`trl.RLOOTrainer`], [`trl.GRPOTrainer`], or a subclass of
either (TRL's own `GMPOTrainer`, a user's). It wraps TRL's methods and calls `super()` in each; no TRL method body is
copied. The batch's rows ([`core.packing.row_groups`]: each row's group, lengths and tokens) are read once per
generation batch from the token lists TRL's `_generate` returns, are active while TRL's own no-grad passes run, travel
with the batch TRL returns (TRL's shuffle and split carry them), and are active again while TRL's loss runs for each
micro-batch, which packs them as its prefix tree ([`core.tree`]).
"""

import contextlib
import dataclasses
import inspect
import warnings

import numpy as np
import torch
from accelerate.utils import is_peft_model
from transformers import AutoTokenizer, PreTrainedModel
from trl.extras.profiling import profiling_context
from trl.trainer.utils import get_config_model_id, split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from ..core import prefix_attention
from ..core.families import forward_unsupported_reason, is_multimodal
from ..core.moe import aux_loss_reason, recording_router_logits, weighted_aux_loss
from ..core.packing import ROWS_KEY, group_shuffle_order, pack_rows, prompt_images, prompt_key, row_groups
from ..core.prefix_cache import prefix_cache_unsupported_reason
from ..core.recurrent import has_recurrent_layers
from ..core.shared_generation import TOKEN_TYPE_FIELDS, generate_with_shared_prefill, generation_unsupported_reason
from ..core.shared_generation import text_only
from ..core.turn_cache import TurnCaches, continue_reason, default_budget
from ..core.vision import IMAGE_KWARGS, VISION_FAMILIES, image_blocks, image_token_ids, layout_reason
from ..core.vision import packed_positions, rope_index_positions, select_images, token_blocks, vision_reason
from .config import STOCK_SETTINGS, sharing_settings
from .held_prefix import HeldPrefixMixin
from .hydra import HydraReward, reward_adapter_config, resolved_dtype, saving_policy_adapters_only
from .hydra import split_hydra_rewards
from .rewards import RewardSharingMixin


# The modules of the losses `_group_shuffle_reason` reads
TRL_LOSSES = ("trl.trainer.rloo_trainer", "trl.trainer.grpo_trainer")


def _supported(reason: str | None, consequence: str) -> bool:
    """True when there is no `reason` against a feature; otherwise warns `consequence: reason` and returns False."""
    if reason is not None:
        warnings.warn(f"rloo_efficient: {consequence}: {reason}.", stacklevel=3)
    return reason is None


class GroupSharingMixin(HeldPrefixMixin, RewardSharingMixin):
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
      ([`core.shared_generation`]), its images encoded once ([`core.vision`]); vLLM and continuous batching go to TRL
      untouched.
    - `_generate`: the group structure, from the token lists it returns, becomes active for the no-grad passes; while
      it runs (GRPO's tool loop), each turn's KV caches are held for the rows' next turn ([`core.turn_cache`],
      `tool_cache_budget_gib`), and released when it returns.
    - `_generate_and_score_completions`: the structure is added to the batch it returns; keeping groups together
      (`shuffle_groups`, by default where that only reorders a sum: [`_group_shuffle_reason`]), the
      batch is ordered so that TRL's own shuffle, drawn next, leaves each group's rows together.
    - `_compute_loss`: the micro-batch's structure is active while TRL's loss runs.
    - `_get_per_token_logps_and_entropies`: the packed forward ([`core.packing`]) when the active structure matches
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
        self._prefix_warned: set[str] = set()
        self._active_rows: torch.Tensor | None = None  # the group structure TRL's current forwards use
        self.packed_forward_tokens = 0  # tokens the packed forward processed (deterministic; read by tests)
        self.tree_tokens = 0  # the real tokens of the prefix trees those forwards packed (each shared run once)
        self.shared_prefill_tokens = 0  # prompt tokens the shared generation prefill forwarded (read by tests)
        self.reward_forward_tokens = 0  # tokens the packed reward forward processed (read by tests)
        reward_funcs = self._hydra_reward_funcs(model, reward_funcs, args, positional, kwargs)
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self._attach_hydra_rewards()
        unwrapped = self.accelerator.unwrap_model(self.model)
        self._share_prefix = self._settings.share_prompt_prefix
        if self._share_prefix:
            reason = forward_unsupported_reason(unwrapped)
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
        self._share_prefill = (
            self._settings.share_generation_prefill
            and not other_backend
            and _supported(generation_unsupported_reason(unwrapped, self.generation_config),
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
                    prefix_attention.install(self.accelerator.unwrap_model(inner))

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
        if reason not in self._prefix_warned:
            self._prefix_warned.add(reason)
            warnings.warn(
                f"rloo_efficient: prompt-prefix sharing is off{'' if permanent else ' for such batches'}, using stock "
                f"TRL's forward: {reason}.",
                stacklevel=3,
            )

    def _warn_once(self, message: str) -> None:
        if message not in self._prefix_warned:
            self._prefix_warned.add(message)
            warnings.warn(message, stacklevel=3)

    # -- generation --------------------------------------------------------------------------------------------------
    def _tokenize_prompts(self, prompts: list):
        if not self._settings.share_prompt_prefix or self._is_vlm:
            return super()._tokenize_prompts(prompts)
        # With environments (GRPO), each prompt is rendered with its environment's tools: part of the key
        environments = getattr(self, "_batch_environments", None)
        if getattr(self, "environment_factories", None) is None:
            environments = None
        keys = [(None if environments is None else environments[i], prompt_key(p)) for i, p in enumerate(prompts)]
        first: dict[tuple, int] = {}
        for row, key in enumerate(keys):
            first.setdefault(key, row)
        if len(first) == len(prompts):
            return super()._tokenize_prompts(prompts)
        rows = list(first.values())
        if environments is not None:
            self._batch_environments = [environments[row] for row in rows]
        try:
            unique_ids, images, fields = super()._tokenize_prompts([prompts[row] for row in rows])
        finally:
            if environments is not None:
                self._batch_environments = environments
        if fields:  # per-prompt fields would need the same fan-out: tokenize every row, as stock does
            return super()._tokenize_prompts(prompts)
        position = {key: index for index, key in enumerate(first)}
        # Each row gets its own copy of its prompt's tokens (a list later code may edit in place)
        return [list(unique_ids[position[key]]) for key in keys], images, fields

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        if not self._share_prefill:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        if "generate" in vars(self.accelerator.unwrap_model(self.model_wrapped)):
            # A `generate` set on the model itself (a test's `patch.object`, a tracing wrapper, another library's): it
            # is called as stock calls it, with stock's arguments
            self._warn_once("rloo_efficient: the shared generation prefill is off for such calls, using stock TRL's "
                            "generate: the model's generate is replaced on the model object")  # fmt: skip
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        with_images = not text_only(images, multimodal_fields)
        reason = self._image_prefill_reason(prompt_ids, images, multimodal_fields) if with_images else None
        # Where every forward gathers parameters from all ranks, they all take stock's generate or none does
        if not self._all_ranks_can(reason is None):
            self._fall_back(reason or "another process's prompts cannot be prefilled once", permanent=False)
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        with self._shared_prefill(prompt_ids, images if with_images else None):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)

    def _image_prefill_reason(self, prompt_ids, images, multimodal_fields) -> str | None:
        """Why prompts with images cannot be prefilled once per group, or None when they can."""
        if self._vision_reason is not None:
            return self._vision_reason
        unknown = set(multimodal_fields) - set(IMAGE_KWARGS) - set(TOKEN_TYPE_FIELDS)
        if unknown:
            return f"the processor returns fields the shared prefill does not split ({', '.join(sorted(unknown))})"
        if any(ids and ids[-1] in self._image_tokens for ids in prompt_ids):
            return "a prompt ends with an image's token"  # the prefill stops one token short of it
        if "pixel_values" in multimodal_fields:
            return layout_reason(multimodal_fields, [len(row or []) for row in images or [[]] * len(prompt_ids)],
                                 self._vision["pixels"])  # fmt: skip
        return None

    def _all_ranks_can(self, can: bool) -> bool:
        """`can`, agreed by every process (one all-reduce) where each forward gathers parameters from all of them."""
        if not self._forwards_are_collective(self.accelerator.unwrap_model(self.model_wrapped)):
            return can
        import torch.distributed as dist

        flag = torch.tensor([int(can)], device=self.accelerator.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    @contextlib.contextmanager
    def _shared_prefill(self, prompt_ids: list[list[int]], images: list | None = None):
        """
        While TRL's generation runs (its regular transformers path: vLLM and continuous batching never call `generate`),
        the model's `generate` is [`generate_with_shared_prefill`] for these prompts' token lists (and their images):
        each distinct prompt prefilled once, its images encoded once, decoding continued from that cache, sampling
        exactly as the stock call.
        """
        model = self.accelerator.unwrap_model(self.model_wrapped)  # what TRL's unwrap_model_for_generation yields
        stock_generate = model.generate

        def generate(input_ids, attention_mask, **kwargs):
            output, tokens = generate_with_shared_prefill(
                model, input_ids, attention_mask, prompt_ids=prompt_ids, prompt_cache_once=self._prompt_cache_once,
                tree=self._settings.share_prefill_tree, synced=self._forwards_are_collective(model),
                generate=stock_generate, images=images, turns=self._turns, **kwargs,
            )  # fmt: skip
            self.shared_prefill_tokens += tokens
            return output

        model.generate = generate  # on the instance: found before the class's method
        try:
            yield
        finally:
            if vars(model).get("generate") is generate:  # ours, unless the block replaced it: the class's again
                del model.generate

    def _forwards_are_collective(self, model) -> bool:
        """Whether every forward gathers parameters from all ranks (so that ranks must run the same forwards)."""
        if self.accelerator.num_processes == 1:
            return False
        from torch.distributed.fsdp import FSDPModule
        from transformers.distributed.fsdp import is_fsdp_managed_module
        from transformers.integrations import is_deepspeed_zero3_enabled

        # As transformers' generate decides to keep ranks in step (`synced_gpus`), and FSDP2 applied by accelerate
        return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model) or isinstance(model, FSDPModule)

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

    # -- the packed forward ------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal_kwargs):  # fmt: skip
        """TRL's forward, or the packed one when the active group structure matches the batch."""
        images = {key: value for key, value in multimodal_kwargs.items() if value is not None}
        rows = self._rows_for(input_ids, logits_to_keep, images)
        if rows is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal_kwargs,
            )  # fmt: skip
        with profiling_context(self, "_get_per_token_logps_and_entropies"):  # TRL's timer, as its own method has
            return self._packed_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, rows, batch_size,
                                                    compute_entropy, compute_aux_loss, images)  # fmt: skip

    def _rows_for(self, input_ids, logits_to_keep, images: dict) -> torch.Tensor | None:
        """The active group structure when the packed forward can serve this call, else None."""
        rows = self._active_rows
        if not self._share_prefix or rows is None:
            return None
        if images.get("pixel_values") is not None:  # a batch with images: stock's forward where they cannot be packed
            reason = self._vision_reason or layout_reason(images, images.get("num_images") or [], self._vision["pixels"])
            if reason is not None:
                self._fall_back(reason, permanent=False)
                return None
        if any(key not in images for key in ("pixel_values", "num_images")) and images:  # token types, no image
            return None
        group, plen, scored = rows[:, :3].numpy().T  # host values
        if len(group) != input_ids.shape[0] or plen.max() > input_ids.shape[1] - logits_to_keep or (
            scored.max() > logits_to_keep):  # fmt: skip
            # Count-free, so that it warns once however many batch shapes miss it
            self._fall_back("the group structure of the batch's generation does not match the rows, prompt length or "
                            "completion length of the batch a forward is given", permanent=False)  # fmt: skip
            return None
        return rows

    def _packed_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, rows, batch_size,
                                    compute_entropy, compute_aux_loss=False, images=None):  # fmt: skip
        """TRL's micro-batch chunking, each chunk packed as one flat sequence (TRL's forward where it can't be); with
        `compute_aux_loss`, each chunk's MoE load-balancing loss over every token stock's chunk holds ([`core.moe`]);
        with `images` (TRL's image kwargs), each group's images once ([`core.vision`])."""
        batch_size = batch_size or input_ids.size(0)
        unwrapped = self.accelerator.unwrap_model(model)
        prefix_attention.install(unwrapped)  # done at init; a model swapped in since (e.g. a synced reference) too
        text_config = unwrapped.config.get_text_config()
        # A config asking for router logits would have TRL's head compute its own loss over our flat sequence
        extra = {"output_router_logits": False} if hasattr(text_config, "output_router_logits") else {}
        all_logps, all_entropies, all_aux = [], [], []
        with_positions = bool(images) and self._vision["positions"] == "rope_index"  # Qwen's, from each group's row
        recurrent = has_recurrent_layers(unwrapped)
        chunks = [(start, min(start + batch_size, input_ids.size(0))) for start in range(0, input_ids.size(0), batch_size)]
        # Prompts held across chunks (a no-grad pass's, or this micro-batch of a training scope's): [`held_prefix`]
        scope, indices, closes = self._held_chunks(rows, chunks, compute_aux_loss, bool(images))

        def call(**inputs):
            with self.accelerator.autocast():
                return model(**inputs, fused_lm_head=True, **extra)

        try:
            for index, (start, end) in zip(indices, chunks, strict=True):
                pack = dict(token_weights=compute_aux_loss, group_sources=with_positions,
                            image_tokens=self._image_tokens if images else None, recurrent=recurrent)  # fmt: skip
                if scope is not None:
                    source = scope.plan.chunks[index].source
                    if source is not None:  # the prompts first held here: forwarded once, for every later chunk
                        routers = (lambda: recording_router_logits(unwrapped)) if compute_aux_loss else None
                        tokens = scope.forward_source(source, call, input_ids.size(1) - logits_to_keep,
                                                      input_ids.device, recurrent, routers)  # fmt: skip
                        self.packed_forward_tokens += tokens
                        self.tree_tokens += tokens
                        self.held_forward_tokens += tokens
                    packed = scope.pack(index, input_ids[start:end], logits_to_keep, rows[start:end], **pack)
                else:
                    packed = pack_rows(input_ids[start:end], logits_to_keep, rows[start:end], **pack)
                chunk_images = {}
                if images and not isinstance(packed, str):
                    packed, chunk_images = self._with_images(unwrapped, packed, images, input_ids, attention_mask,
                                                             start, logits_to_keep)  # fmt: skip
                if isinstance(packed, str):
                    self._fall_back(packed, permanent=False)
                    stock = super()._get_per_token_logps_and_entropies.__func__
                    stock = getattr(stock, "__wrapped__", stock)  # TRL's forward without its timer: this call is timed
                    logps, entropies, aux = stock(self, model, input_ids[start:end], attention_mask[start:end],
                                                  logits_to_keep, end - start, compute_entropy, compute_aux_loss,
                                                  **(self._images_of_rows(images, start, end) if images else {}))  # fmt: skip
                else:
                    self.packed_forward_tokens += packed.num_tokens
                    self.tree_tokens += packed.tree.real_tokens
                    routers = recording_router_logits(unwrapped) if compute_aux_loss else contextlib.nullcontext()
                    with routers as router_logits:
                        outputs = call(**packed.model_inputs(), **chunk_images)
                    logps = packed.unpack(outputs.log_probs)
                    entropies = packed.unpack(outputs.entropy) if compute_entropy else None
                    aux = None
                    if compute_aux_loss:
                        held_logits = packed.layout.held.routers() if packed.layout.held is not None else []
                        aux = weighted_aux_loss(router_logits, packed.token_weights, text_config, held_logits,
                                                list(packed.held_weights))  # fmt: skip
                if scope is not None:
                    self._chunk_done(scope, index)
                all_logps.append(logps)
                if compute_entropy:
                    all_entropies.append(entropies)
                if compute_aux_loss:
                    all_aux.append(aux)
        finally:
            if closes:
                scope.close()
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        aux_loss = torch.stack(all_aux).mean() if compute_aux_loss else None  # as TRL averages its chunks'
        return logps, entropies, aux_loss

    def _with_images(self, model, packed, images: dict, input_ids, attention_mask, start: int, logits_to_keep: int):
        """
        The packed chunk starting at row `start` of an image batch: the images of each group's first row, once, in the
        order of the groups' nodes, and what the family needs beside them ([`core.vision`]): Qwen's 3-D positions (the
        model's own `get_rope_index` on each group's first row, its completion columns unmasked: the rows of a group
        share their prompt's positions, and completions are text, one position per column), or the tokens' image
        blocks (Gemma). Returns `(packed, image kwargs)`.
        """
        num_images, first = images["num_images"], start + packed.first_rows
        group_images = select_images(images, num_images, first, self._vision["pixels"])
        if self._vision["positions"] == "rope_index":
            index = torch.from_numpy(first).to(input_ids.device)
            mask = attention_mask.index_select(0, index)
            mask[:, -logits_to_keep:] = 1
            positions = rope_index_positions(model, input_ids.index_select(0, index), mask, {
                "image_grid_thw": group_images.get("image_grid_thw"),
                "mm_token_type_ids": images["mm_token_type_ids"].index_select(0, index)})  # fmt: skip
            packed = dataclasses.replace(packed, position_ids=packed_positions(positions, packed.group_source_index))
        blocks = image_blocks(model)
        if blocks is not None and group_images:  # an image's tokens attend to each other both ways
            key, image_types, layers = blocks
            ids = token_blocks(images[key][start : start + packed.num_rows], image_types, packed.source_index)
            packed = dataclasses.replace(packed, layout=dataclasses.replace(packed.layout, token_blocks=ids,
                                                                            blocks_on=layers))  # fmt: skip
        return packed, group_images

    def _images_of_rows(self, images: dict, start: int, end: int) -> dict:
        """TRL's image kwargs for the rows `[start, end)` alone, as TRL's forward takes them for a batch of those."""
        rows = np.arange(start, end)
        out = select_images(images, images["num_images"], rows, self._vision["pixels"])
        out["num_images"] = images["num_images"][start:end]
        for key in TOKEN_TYPE_FIELDS:
            if images.get(key) is not None:
                out[key] = images[key][start:end]
        return out
