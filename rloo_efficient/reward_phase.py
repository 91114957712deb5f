"""
The trainer's reward phase: TRL's `_calculate_rewards`, with reward models (and Hydra reward adapters) scored from
packed rows, each group's shared token prefix once (see [`reward_sharing`]); stock's call where a model cannot be.
"""

import asyncio
import contextlib
import warnings

import torch
from accelerate.logging import get_logger
from accelerate.utils import gather
from torch import nn
from transformers import Trainer
from trl.data_utils import apply_chat_template, is_conversational
from trl.extras.profiling import profiling_context, profiling_decorator
from trl.trainer.utils import is_async_callable

from .prefix_attention import install
from .prefix_sharing import group_ids_for
from .reward_sharing import HydraReward, pack_reward_rows, packed_scores, padded_scores, reward_model_reason


logger = get_logger(__name__)


class GroupedRewardMixin:
    """Scores reward models (and Hydra adapters) with each group's shared prefix once; see the module docstring."""

    # Adapted from trl 1.16 RLOOTrainer._calculate_rewards; changes marked "# prefix sharing:"
    @profiling_decorator
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        device = self.accelerator.device
        rewards_per_func = torch.zeros(len(prompts), len(self.reward_funcs), device=device)

        # Repeat all input columns (but "prompt", "completion", and "completion_ids") to match the num of generations
        keys = [key for key in inputs[0] if key not in ["prompt", "completion", "completion_ids"]]
        reward_kwargs = {key: [example[key] for example in inputs] for key in keys}

        # This allows for dynamic reward shaping based on training progress.
        reward_kwargs["trainer_state"] = self.state

        # Allow reward functions to log extra columns to the completions table.
        reward_kwargs["log_extra"] = self._log_completion_extra

        # Allow reward functions to log additional scalar metrics.
        reward_kwargs["log_metric"] = self._log_metric

        async_funcs_info = []  # async custom functions for asyncio.gather

        for i, (reward_func, reward_processing_class, reward_func_name) in enumerate(
            zip(self.reward_funcs, self.reward_processing_classes, self.reward_func_names, strict=True)
        ):
            # prefix sharing: a Hydra reward adapter is scored like a model
            if isinstance(reward_func, (nn.Module, HydraReward)):  # Module (no PretrainedModel) for compat w/ compiled
                with profiling_context(self, reward_func_name):
                    if is_conversational({"prompt": prompts[0]}):
                        messages = [{"messages": p + c} for p, c in zip(prompts, completions, strict=True)]
                        texts = [
                            apply_chat_template(x, reward_processing_class, **self.chat_template_kwargs)["text"]
                            for x in messages
                        ]
                    else:
                        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
                    # prefix sharing: each group's common token prefix scored once, where the model allows
                    scores = self._grouped_reward_scores(reward_func, reward_processing_class, prompts, texts)
                    if scores is not None:
                        rewards_per_func[:, i] = scores
                        continue
                    reward_inputs = reward_processing_class(
                        text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
                    )
                    reward_inputs = Trainer._prepare_inputs(self, reward_inputs)  # prefix sharing: Trainer's own
                    with torch.inference_mode():
                        rewards_per_func[:, i] = reward_func(**reward_inputs).logits[:, 0]  # Shape (B*G,)
            elif is_async_callable(reward_func):  # Separate async reward funcs to run them in parallel later
                async_funcs_info.append((i, reward_func, reward_func_name))
            else:
                # Run synchronous reward function
                with profiling_context(self, reward_func_name):
                    output_reward_func = reward_func(
                        prompts=prompts, completions=completions, completion_ids=completion_ids_list, **reward_kwargs
                    )
                    # Convert None values to NaN
                    output_reward_func = [reward if reward is not None else torch.nan for reward in output_reward_func]
                    if len(output_reward_func) != len(prompts):
                        raise ValueError(
                            f"The reward function '{reward_func_name}' returned {len(output_reward_func)} rewards, but "
                            f"{len(prompts)} were expected (one per prompt-completion pair). Make sure the reward "
                            f"function returns exactly one reward per completion."
                        )
                    rewards_per_func[:, i] = torch.tensor(output_reward_func, dtype=torch.float32, device=device)

        # Execute async custom functions in parallel using asyncio.gather
        if async_funcs_info:

            async def _invoke_async(index, func, func_name):
                with profiling_context(self, func_name):
                    output = await func(
                        prompts=prompts, completions=completions, completion_ids=completion_ids_list, **reward_kwargs
                    )
                    output = [r if r is not None else torch.nan for r in output]
                    if len(output) != len(prompts):
                        raise ValueError(
                            f"The reward function '{func_name}' returned {len(output)} rewards, but {len(prompts)} "
                            f"were expected (one per prompt-completion pair). Make sure the reward function returns "
                            f"exactly one reward per completion."
                        )
                    return index, output

            async def _run_async_funcs():
                coros = [_invoke_async(i, func, func_name) for (i, func, func_name) in async_funcs_info]
                return await asyncio.gather(*coros)

            async_results = asyncio.run_coroutine_threadsafe(_run_async_funcs(), self.async_loop).result()
            for idx, output_reward_func in async_results:
                rewards_per_func[:, idx] = torch.tensor(output_reward_func, dtype=torch.float32, device=device)

        # If all reward functions return None for a given row, issue a detailed warning
        if torch.isnan(rewards_per_func).all(dim=1).any():
            nan_row_idx = torch.isnan(rewards_per_func).all(dim=1).nonzero(as_tuple=True)[0][0]
            row_reward_kwargs = {
                key: value[nan_row_idx]
                for key, value in reward_kwargs.items()
                if key not in ("trainer_state", "log_extra", "log_metric")
            }
            row_reward_kwargs["prompt"] = prompts[nan_row_idx]
            row_reward_kwargs["completion"] = completions[nan_row_idx]
            logger.warning(
                f"All reward functions returned None for the following kwargs:\n{row_reward_kwargs}\n"
                "Please ensure that at least one reward function returns a valid reward."
            )

        # Gather the reward per function: this part is crucial, because the rewards are normalized per group and the
        # completions may be distributed across processes
        rewards_per_func = gather(rewards_per_func)
        return rewards_per_func


    def _grouped_reward_scores(self, reward_func, processing_class, prompts, texts) -> torch.Tensor | None:
        """`(B,)` rewards from packed rows, or None where stock's call must run (then it has warned why, once)."""
        hydra = isinstance(reward_func, HydraReward)
        if not hydra and (not self.args.share_reward_prefix or not self._reward_model_supported(reward_func)):
            return None
        rows = processing_class(text=texts, add_special_tokens=False)["input_ids"]
        pad_token_id = processing_class.pad_token_id
        context = reward_func.active() if hydra else contextlib.nullcontext(reward_func)
        with torch.inference_mode(), context as root:
            inner = root.get_base_model() if hydra else self.accelerator.unwrap_model(root)
            score = reward_func.score if hydra else None
            batch = pack_reward_rows(rows, group_ids_for(prompts).tolist(), pad_token_id, self.accelerator.device,
                                     inner.dtype) if self.args.share_reward_prefix else "share_reward_prefix=False"  # fmt: skip
            if isinstance(batch, str):
                if not hydra:
                    self._fall_back_reward(batch)
                    return None
                padded = processing_class(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                          add_special_tokens=False).to(self.accelerator.device)  # fmt: skip
                return padded_scores(root, inner, score, padded["input_ids"], padded["attention_mask"], pad_token_id)
            install(inner)
            self.reward_forward_tokens += batch.num_tokens
            self.reward_shared_prefix_lengths = batch.shared_prefix_lengths
            return packed_scores(root, inner, score, batch)

    def _reward_model_supported(self, reward_func) -> bool:
        model = self.accelerator.unwrap_model(reward_func)
        reason = reward_model_reason(model)
        if reason is not None:
            self._fall_back_reward(f"{type(model).__name__}: {reason}")
        return reason is None

    def _fall_back_reward(self, reason: str) -> None:
        if reason not in self._prefix_warned:
            self._prefix_warned.add(reason)
            warnings.warn(f"rloo_efficient: the reward model scores each row on its own, as stock TRL: {reason}.",
                          stacklevel=4)  # fmt: skip
