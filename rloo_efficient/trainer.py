import inspect
import warnings
from typing import Any

import torch
import trl
from accelerate.utils import is_peft_model
from transformers import AutoTokenizer, PreTrainedModel
from trl.models import unwrap_model_for_generation
from trl.extras.profiling import profiling_context, profiling_decorator
from trl.trainer.utils import get_config_model_id, pad
from trl.trainer.utils import shuffle_sequence_dict, split_pixel_values_by_grid, split_tensor_dict
from trl.trainer.utils import unsplit_pixel_values_by_grid

from . import prefix_attention
from .batch_structure import GroupedBatchMixin
from .config import RLOOConfig
from .prefix_cache import prefix_cache_unsupported_reason
from .prefix_sharing import ROWS_KEY, pack_groups, prompt_key, shuffle_groups_dict
from .prefix_sharing import unsupported_reason
from .profiling import MemoryProfilingMixin
from .reward_phase import GroupedRewardMixin
from .reward_sharing import HydraReward, reward_adapter_config, resolved_dtype, saving_policy_adapters_only
from .reward_sharing import split_hydra_rewards
from .shared_generation import generate_with_shared_prefill, generation_unsupported_reason


# TRL's forward without its profiling timer: ours times the whole call once, whichever path it takes
_stock_logps_and_entropies = trl.RLOOTrainer._get_per_token_logps_and_entropies.__wrapped__


def _supported(reason: str | None, consequence: str) -> bool:
    """True when there is no `reason` against a feature; otherwise warns `consequence: reason` and returns False."""
    if reason is not None:
        warnings.warn(f"rloo_efficient: {consequence}: {reason}.", stacklevel=3)
    return reason is None


class _SharedPrefixRLOOTrainer(GroupedBatchMixin, GroupedRewardMixin, trl.RLOOTrainer):
    """The prefix-sharing overrides; [`RLOOTrainer`] adds profiling around them."""

    def __init__(self, model, reward_funcs, args: RLOOConfig | None = None, *positional, **kwargs):
        if args is not None and not isinstance(args, RLOOConfig):
            args = RLOOConfig.from_stock(args)
        if args is None:  # TRL's own default
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = RLOOConfig(f"{name.split('/')[-1]}-RLOO")
        self._prefix_warned: set[str] = set()
        self.packed_forward_tokens = 0  # tokens the packed forward processed (deterministic; read by tests)
        self.shared_prefill_tokens = 0  # prompt tokens the shared generation prefill forwarded (read by tests)
        self.reward_forward_tokens = 0  # tokens the packed reward forward processed (read by tests)
        reward_funcs = self._hydra_reward_funcs(model, reward_funcs, args, positional, kwargs)
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self._attach_hydra_rewards()
        self._share_prefix = args.share_prompt_prefix
        if self._share_prefix:
            reason = unsupported_reason(self.accelerator.unwrap_model(self.model))
            if reason is None and self.aux_loss_enabled:
                reason = "the MoE load-balancing loss counts every token of every row"
            if reason is not None:
                self._fall_back(reason)
        unwrapped = self.accelerator.unwrap_model(self.model)
        other_backend = self.use_vllm or self.use_transformers_continuous_batching  # they share prefixes already
        self._share_prefill = (
            args.share_generation_prefill
            and not other_backend
            and _supported(generation_unsupported_reason(unwrapped, self.generation_config),
                           "the shared generation prefill is off, using stock TRL's generate")
        )  # fmt: skip
        self._prompt_cache_once = (
            self._share_prefill
            and args.share_prompt_kv_cache
            and _supported(prefix_cache_unsupported_reason(unwrapped),
                           "the prompt's KV cache is fanned out to every completion while decoding (the prefill is "
                           "still shared)")
        )  # fmt: skip
        if self._share_prefix or self._prompt_cache_once:
            # Our forwards pass a layout to the attention modules; without one they run the model's own attention.
            # TRL has wrapped the reference already (a DeepSpeed engine, FSDP, DDP): install on the model inside
            for model in (unwrapped, self.ref_model):
                if model is not None:
                    prefix_attention.install(self.accelerator.unwrap_model(model))

    def _hydra_reward_funcs(self, model, reward_funcs, args, positional, kwargs) -> list:
        """`reward_funcs` with each reward adapter that can share the policy's base replaced by a [`HydraReward`]."""
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        if not any(reward_adapter_config(func) for func in funcs):
            return reward_funcs
        bound = inspect.signature(trl.RLOOTrainer.__init__).bind(self, model, reward_funcs, args, *positional, **kwargs)
        init_kwargs = args.model_init_kwargs or {}
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
        return split_hydra_rewards(funcs, base, dtype, quantization, init_kwargs, args.hydra_reward_adapter,
                                   lambda message: warnings.warn(message, stacklevel=5))  # fmt: skip

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

    # -- string-level batching ---------------------------------------------------------------------------------------
    def _tokenize_prompts(self, prompts: list):
        if not self.args.share_prompt_prefix or self._is_vlm:
            return super()._tokenize_prompts(prompts)
        keys = [prompt_key(p) for p in prompts]
        unique_index: dict[str, int] = {}
        unique_prompts = []
        for key, prompt in zip(keys, prompts, strict=True):
            if key not in unique_index:
                unique_index[key] = len(unique_prompts)
                unique_prompts.append(prompt)
        unique_ids, images, multimodal_fields = super()._tokenize_prompts(unique_prompts)
        # Each row gets its own copy of its prompt's tokens (a list later code may edit in place)
        return [list(unique_ids[unique_index[key]]) for key in keys], images, multimodal_fields

    # Adapted from trl 1.16 RLOOTrainer._prepare_inputs; changes marked "# prefix sharing:"
    @profiling_decorator
    def _prepare_inputs(self, generation_batch: dict[str, torch.Tensor | Any]) -> dict[str, torch.Tensor | Any]:
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            generate_every = self.args.steps_per_generation * self.num_iterations
            if self._step % generate_every == 0 or self._buffered_inputs is None:
                generation_batch = self._generate_and_score_completions(generation_batch)
                generation_batch = split_pixel_values_by_grid(generation_batch)
                # prefix sharing: keep each group's rows together when asked to
                if self.args.shuffle_groups:
                    generation_batch = shuffle_groups_dict(generation_batch, generation_batch[ROWS_KEY][:, 0])
                else:
                    generation_batch = shuffle_sequence_dict(generation_batch)
                generation_batches = split_tensor_dict(generation_batch, self.args.steps_per_generation)
                self._buffered_inputs = [unsplit_pixel_values_by_grid(batch) for batch in generation_batches]
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        else:
            inputs = self._generate_and_score_completions(generation_batch)
        return inputs

    # -- the shared prefill in generation --------------------------------------------------------------------------
    # Adapted from trl 1.16 RLOOTrainer._generate_single_turn, its regular transformers branch (vLLM and continuous
    # batching go to stock TRL unchanged); changes marked "# shared prefill:"
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        if not self._share_prefill or images is not None or multimodal_fields:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields)
        device = self.accelerator.device

        # Regular generation path: left-pad token IDs into tensors
        prompt_tensors = [torch.tensor(ids) for ids in prompt_ids]
        padded_ids = pad(
            prompt_tensors,
            padding_value=self._tokenizer.pad_token_id,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        attention_mask = pad(
            [torch.ones_like(t) for t in prompt_tensors],
            padding_value=0,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        generate_inputs = {"input_ids": padded_ids, "attention_mask": attention_mask}
        generate_inputs = super(trl.RLOOTrainer, self)._prepare_inputs(generate_inputs)

        with (
            profiling_context(self, "transformers.generate"),
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,  # Override model.generation_config with generation_kwargs to fix transformers#42762
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            # shared prefill: each distinct prompt row's first W - 1 tokens once, its cache fanned out to its rows;
            # generate then forwards the last prompt column and samples exactly as it would have
            prompt_completion_ids, prefill_tokens = generate_with_shared_prefill(
                unwrapped_model, **generate_inputs, prompt_ids=prompt_ids, prompt_cache_once=self._prompt_cache_once,
                synced=self._forwards_are_collective(unwrapped_model), generation_config=self.generation_config,
            )  # fmt: skip
            self.shared_prefill_tokens += prefill_tokens
        # Compute prompt length and extract completion ids
        prompt_length = generate_inputs["input_ids"].size(1)
        completion_ids = prompt_completion_ids[:, prompt_length:]

        # Mask everything after the first EOS token
        is_eos = torch.isin(completion_ids, torch.tensor(self.eos_token_ids, device=device))
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        sequence_indices = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
        completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
        completion_ids = [
            c[m].tolist() for c, m in zip(completion_ids.cpu(), completion_mask.bool().cpu(), strict=True)
        ]
        return completion_ids

    def _forwards_are_collective(self, model) -> bool:
        """Whether every forward gathers parameters from all ranks (so that ranks must run the same forwards)."""
        if self.accelerator.num_processes == 1:
            return False
        from torch.distributed.fsdp import FSDPModule
        from transformers.distributed.fsdp import is_fsdp_managed_module
        from transformers.integrations import is_deepspeed_zero3_enabled

        # As transformers' generate decides to keep ranks in step (`synced_gpus`), and FSDP2 applied by accelerate
        return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model) or isinstance(model, FSDPModule)

    # -- the shared-prefix forward ---------------------------------------------------------------------------------
    @profiling_decorator
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        rows=None,
        **multimodal_kwargs,
    ):
        """Stock TRL's forward, or the packed one when the batch's group structure `rows` came with it."""
        use_stock = (
            not self._share_prefix
            or rows is None
            or compute_aux_loss
            or any(value is not None for value in multimodal_kwargs.values())
        )
        if use_stock:
            return _stock_logps_and_entropies(
                self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal_kwargs,
            )  # fmt: skip
        return self._packed_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, rows, batch_size, compute_entropy
        )

    def _packed_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, rows, batch_size, compute_entropy
    ):
        """Stock TRL's micro-batch chunking, each chunk packed as one flat sequence (the stock forward where it can't)."""
        batch_size = batch_size or input_ids.size(0)
        unwrapped = self.accelerator.unwrap_model(model)
        prefix_attention.install(unwrapped)  # done at init; a model swapped in since (e.g. a synced reference) too
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            with self.accelerator.autocast():
                device_type = input_ids.device.type
                dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                         else unwrapped.dtype)  # fmt: skip
                packed = pack_groups(input_ids[start:end], logits_to_keep, rows[start:end], dtype)
                if isinstance(packed, str):
                    self._fall_back(packed, permanent=False)
                    logps, entropies, _ = _stock_logps_and_entropies(
                        self, model, input_ids[start:end], attention_mask[start:end], logits_to_keep, end - start,
                        compute_entropy,
                    )  # fmt: skip
                else:
                    self.packed_forward_tokens += packed.num_tokens
                    outputs = model(**packed.model_inputs(), fused_lm_head=True)
                    logps = packed.unpack(outputs.log_probs)
                    entropies = packed.unpack(outputs.entropy) if compute_entropy else None
            all_logps.append(logps)
            if compute_entropy:
                all_entropies.append(entropies)
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        return logps, entropies, None


class RLOOTrainer(MemoryProfilingMixin, _SharedPrefixRLOOTrainer):
    """
    A drop-in replacement for [`trl.RLOOTrainer`] (same constructor, same results) that processes each prompt once
    per group, profiles memory per phase, and can release cached memory at phase boundaries. See [`RLOOConfig`] for
    the switches; with all of them off, training is stock TRL's.

    TRL methods overridden, and why:
    - `_tokenize_prompts`: tokenize each unique prompt string once; each of its `k` rows gets a copy of the tokens.
    - `_generate_and_score_completions` and `_compute_loss` (copied, see [`batch_structure`]): the batch's group
      structure is computed once per generation batch from TRL's token lists, travels with the batch
      (`rloo_rows`), and is passed to every log-prob forward in the call's arguments.
    - `_get_per_token_logps_and_entropies`: the packed shared-prefix forward (see [`prefix_sharing`],
      [`prefix_attention`]) for the policy, reference and training passes; the stock forward where packing would
      not be exact.
    - `_generate_single_turn`: copied from TRL's regular transformers branch to prefill each distinct prompt once and,
      for supported attention, keep its KV cache once per group while decoding (see [`shared_generation`],
      [`prefix_cache`]); vLLM, continuous batching and multimodal inputs go to stock TRL.
    - `_calculate_rewards` (copied, see [`reward_phase`]): reward models and Hydra reward adapters scored from packed
      rows, each group's shared token prefix once; the rest of TRL's reward logic unchanged.
    - `__init__`: a reward adapter on the policy's base is kept from loading as a second model and attached to the
      policy instead (Hydra); our attention function is installed on the policy and reference.
    - `_prepare_inputs`: copied from TRL to shuffle whole groups when `shuffle_groups=True` (TRL's timer kept).
    - `_save`: a Hydra reward adapter is left out of the saved policy (`save_model`, checkpoints, `push_to_hub`).
    - From [`MemoryProfilingMixin`]: `_generate`, `_calculate_rewards`, `training_step`, `log` (phase boundaries,
      memory metrics), each a thin wrapper around `super()`.
    """
