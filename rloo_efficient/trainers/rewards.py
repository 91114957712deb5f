"""
The reward phase inside the group ([`RewardScoring`]): while TRL's `_calculate_rewards` runs, each reward model that can
be scored from packed rows (and each Hydra reward adapter) stands in the trainer's `reward_funcs` as a
[`PackedRewardModel`], which TRL calls as it calls a reward function. It renders and tokenizes the texts as TRL's
reward-model branch does, scores each group's common token prefix once ([`core.forward.reward`]), and returns the
scores; everything else in TRL's method (reward functions, async ones, environments, weights, NaN handling, gathering)
is TRL's own.
"""

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from trl.data_utils import apply_chat_template, is_conversational

from ..core.forward.reward import pack_reward_rows, packed_scores, padded_scores, reward_model_reason
from ..core.layers.install import install
from ..core.layers.recurrent import has_recurrent_layers
from ..core.tree.rows import group_ids_for
from .hydra import HydraReward


class PackedRewardModel:
    """
    A reward model (or Hydra adapter) as TRL calls a reward function: `(prompts, completions, **kwargs)` -> one score
    per row, the model's first logit, from packed rows where `scoring` can, else from TRL's own padded call
    (`prepare(inputs)`: the trainer's `_prepare_inputs`, moving them to the device as TRL's branch does).
    """

    def __init__(self, scoring: "RewardScoring", model, processing_class, chat_template_kwargs: dict, prepare):
        self.scoring, self.reward_model, self.processing_class = scoring, model, processing_class
        self.template_kwargs, self.prepare = chat_template_kwargs, prepare

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        tokenizer = self.processing_class
        # The texts TRL's reward-model branch scores (trl 1.16 `_calculate_rewards`)
        if is_conversational({"prompt": prompts[0]}):
            messages = [{"messages": p + c} for p, c in zip(prompts, completions, strict=True)]
            texts = [apply_chat_template(x, tokenizer, **self.template_kwargs)["text"] for x in messages]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        scores = self.scoring.grouped_scores(self.reward_model, tokenizer, prompts, texts)
        if scores is None:  # TRL's own call, as its reward-model branch makes it
            inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                               add_special_tokens=False)  # fmt: skip
            with torch.inference_mode():
                scores = self.reward_model(**self.prepare(inputs)).logits[:, 0]
        # TRL stores a reward function's list in float32, as it stores a model's logits: the same rounding
        return scores.tolist()


class RewardScoring:
    """Scores reward models (and Hydra adapters) with each group's shared prefix once, on `device`; `share`: the
    reward prefix is shared (`share_reward_prefix`); `warn(message, key)`: says a fallback once; `unwrap`: accelerate's
    unwrapping, looked up once per model ([`packed.Unwrap`]); `counts`: `reward_forward_tokens` and
    `reward_shared_prefix_lengths` counted there."""

    def __init__(self, device, unwrap, counts, *, share: bool, warn: Callable):
        self.device, self.unwrap, self.counts, self.share, self.warn = device, unwrap, counts, share, warn

    @contextlib.contextmanager
    def standing_in(self, reward_funcs: list, processing_classes: list, chat_template_kwargs: dict, prepare):
        """While TRL's `_calculate_rewards` runs: each reward model that can be scored from packed rows (and each
        Hydra adapter) stands in `reward_funcs` (the trainer's list, edited in place) as a [`PackedRewardModel`]."""
        originals = list(reward_funcs)
        for index, (func, tokenizer) in enumerate(zip(originals, processing_classes, strict=False)):
            if isinstance(func, HydraReward) or (isinstance(func, nn.Module) and self._shares(func)):
                reward_funcs[index] = PackedRewardModel(self, func, tokenizer, chat_template_kwargs, prepare)
        try:
            yield
        finally:
            reward_funcs[:] = originals

    def _shares(self, reward_func) -> bool:
        if not self.share:
            return False
        model = self.unwrap(reward_func)
        reason = reward_model_reason(model)
        if reason is not None:
            self._fall_back_to_padded(f"{type(model).__name__}: {reason}")
        return reason is None

    def grouped_scores(self, reward_func, processing_class, prompts, texts) -> torch.Tensor | None:
        """`(B,)` rewards from packed rows, or None where TRL's call must run (then it has warned why, once)."""
        hydra = isinstance(reward_func, HydraReward)
        rows = processing_class(text=texts, add_special_tokens=False)["input_ids"]
        pad_token_id = processing_class.pad_token_id
        context = reward_func.active() if hydra else contextlib.nullcontext(reward_func)
        with torch.inference_mode(), context as root:
            inner = root.get_base_model() if hydra else self.unwrap(root)
            score = reward_func.score if hydra else None
            recurrent = has_recurrent_layers(inner)
            batch = (pack_reward_rows(rows, group_ids_for(prompts).tolist(), pad_token_id, self.device,
                                      recurrent=recurrent) if self.share
                     else "share_reward_prefix=False")  # fmt: skip
            if isinstance(batch, str):
                if not hydra:
                    self._fall_back_to_padded(batch)
                    return None
                padded = processing_class(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                          add_special_tokens=False).to(self.device)  # fmt: skip
                return padded_scores(root, inner, score, padded["input_ids"], padded["attention_mask"], pad_token_id)
            install(inner)
            self.counts.reward_forward_tokens += batch.num_tokens
            self.counts.reward_shared_prefix_lengths = batch.shared_prefix_lengths
            return packed_scores(root, inner, score, batch)

    def _fall_back_to_padded(self, reason: str) -> None:
        self.warn(f"rloo_efficient: the reward model scores each row on its own, as stock TRL: {reason}.", key=reason)
