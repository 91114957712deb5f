"""
The one mixin that binds the core to a TRL group trainer: [`trl.RLOOTrainer`], [`trl.GRPOTrainer`], or a subclass of
either (TRL's own `GMPOTrainer`, a user's). It overrides TRL's methods, calls `super()` in each, and delegates the work
to the parts it holds, each an object with its own state:

- [`switches.Switches`]: which of our paths the run takes, and the fallbacks, each said once;
- [`ranks.Ranks`]: agreement across processes where every forward is collective (ZeRO-3, FSDP);
- [`generation.SharedGeneration`]: the shared prefill, and a tool loop's held caches;
- [`packed.PackedPasses`]: the packed log-prob and training passes ([`core.forward.passes`]);
- [`held_prefix.HeldPrefixes`]: prompts held across a pass's chunks and a step's micro-batches;
- [`rewards.RewardScoring`]: reward models scored from packed rows;
- [`profiling.trainer_profiling.TrainerProfiling`]: each phase's memory and time (`trainer.memory_profiling`).

The batch's rows ([`core.tree.rows.row_groups`]: each row's group, lengths and tokens) are read once per generation
batch from the token lists TRL's `_generate` returns, are active while TRL's own no-grad passes run, travel with the
batch TRL returns (TRL's shuffle and split carry them), and are active again while TRL's loss runs for each
micro-batch, which packs them as its prefix tree ([`core.tree.radix`]).

TRL methods wrapped (each calls `super()`), and why:
- `__init__`: a reward adapter on the policy's base attached to the policy instead of loaded as a second model
  (Hydra); our attention function installed on the policy and the reference; the parts built ([`parts.Parts`]).
- `_tokenize_prompts`: each distinct prompt (and environment) tokenized once; its rows get copies.
- `_generate_single_turn`: while it runs, the model's `generate` prefills each distinct prompt once
  ([`core.generation.generate`]), its images encoded once ([`core.layers.vision`]), in the backend chosen once
  ([`core.generation.backends`]); vLLM and continuous batching go to TRL untouched.
- `_generate`: the group structure, from the token lists it returns, becomes active for the no-grad passes; while
  it runs (GRPO's tool loop), each turn's KV caches are held for the rows' next turn ([`core.generation.turn_cache`],
  `tool_cache_budget_gib`), and released when it returns.
- `_generate_and_score_completions`: the structure is added to the batch it returns; keeping groups together
  (`shuffle_groups`, by default where that only reorders a sum: [`group_shuffle.group_shuffle_reason`]), the batch
  is ordered so that TRL's own shuffle, drawn next, leaves each group's rows together.
- `_prepare_inputs`: a training micro-batch's scope of held prompts planned when the first of its micro-batches is
  served ([`held_prefix`]).
- `training_step`: each optimizer step's window of micro-batches counted (where prompts are held).
- `_compute_loss`: the micro-batch's structure is active while TRL's loss runs.
- `_get_per_token_logps_and_entropies`: the packed pass ([`core.forward.passes`]) when the active structure matches
  the batch it is given; TRL's otherwise.
- `_calculate_rewards`: reward models scored from packed rows ([`rewards`]).
- `_save`: a Hydra reward adapter is left out of the saved policy.
- `log`: the profiling part's metrics merged in. `_generate`, `_calculate_rewards`, `training_step`,
  `_generate_and_score_completions` and `_get_per_token_logps_and_entropies` open its phases ([`TrainerProfiling`]).
"""

import functools

import torch
from transformers import Trainer
from trl.extras.profiling import profiling_context

from ..core import graphs
from ..core.layers.install import install
from ..core.tree.rows import carried, prompt_images, row_groups, scored_lengths, table_of
from ..profiling.trainer_profiling import PROFILING_OFF, TrainerProfiling
from .config import ROWS_KEY, sharing_settings
from .counters import Counted, Counts
from .generation import SharedGeneration, tokenized_once
from .group_shuffle import group_shuffle_reason, ordered_for_group_shuffle
from .held_prefix import HeldPrefixes, upcoming_micro_batches
from .hydra import attach_hydra_rewards, hydra_reward_funcs, saving_policy_adapters_only
from .memory_profiling import ProfilingAccessors
from .packed import PackedPasses
from .parts import Parts
from .rewards import RewardScoring
from .switches import STOCK, Switches


class GroupSharingMixin(Counted, ProfilingAccessors):
    """
    Each prompt once per group in every phase of a TRL group trainer. Mix it in before the trainer class,
    `class MyTrainer(GroupSharingMixin, trl.GRPOTrainer)`; [`RLOOTrainer`] and [`GRPOTrainer`] are built so. The
    switches are our config's fields ([`config.SharingArguments`]), read from `args` with their defaults where `args`
    is a stock config. The TRL methods it wraps, and why: the module's docstring.
    """

    _config_class: type | None = None  # our config for this trainer: a stock config of its base class becomes one
    # What a trainer built without our `__init__` reads ([`_constructed`]): every path off, no part, each wrapper TRL's
    # method
    _switches: Switches = STOCK
    _generation: SharedGeneration | None = None
    _passes: PackedPasses | None = None
    _held: HeldPrefixes | None = None
    _rewards: RewardScoring | None = None
    memory_profiling: TrainerProfiling = PROFILING_OFF
    _active_rows: torch.Tensor | None = None  # the group structure TRL's current forwards use

    def __init__(self, model, reward_funcs=None, args=None, *positional, **kwargs):
        if self._config_class is not None:
            args = self._config_class.of(args, model)
        settings = sharing_settings(args)
        self._counts = Counts()
        reward_funcs = hydra_reward_funcs(self._trl_base.__init__, model, reward_funcs, args, positional, kwargs,
                                          settings.hydra_reward_adapter)  # fmt: skip
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        unwrapped = self.accelerator.unwrap_model(self.model)
        attach_hydra_rewards(self.reward_funcs, self.reward_processing_classes, unwrapped, self.args.trust_remote_code)
        entropy_bonus = getattr(self, "_entropy_bonus_enabled", False)  # (TRL's GRPO only)
        parts = Parts.of(self, settings, self._counts,
                         lambda: group_shuffle_reason(self, GroupSharingMixin, entropy_bonus))  # fmt: skip
        self._switches, self._ranks, self._fallbacks, self._held = parts.switches, parts.ranks, parts.fallbacks, parts.held
        self._passes, self._generation, self._rewards = parts.passes, parts.generation, parts.rewards
        if parts.switches.any_layout:
            # Our forwards pass a layout to the attention modules; without one they run the model's own attention.
            # TRL has wrapped the reference already (a DeepSpeed engine, FSDP, DDP): install on the model inside
            for inner in (unwrapped, self.ref_model):
                if inner is not None:
                    install(self.accelerator.unwrap_model(inner))
        # Last: the memory now (the models loaded, our layers installed) is the profiling's baseline
        self.memory_profiling = TrainerProfiling.from_args(self.args, self.accelerator, lambda: self.model.training,
                                                           self.ref_model, self._counts, type(self))  # fmt: skip
        for callback in self.memory_profiling.callbacks:
            self.add_callback(callback)

    @property
    def _constructed(self) -> bool:
        """Whether our `__init__` ran. A trainer made without it (a bare `object.__new__(GRPOTrainer)` with hand-set
        attributes, as TRL's own tests make one) reads the class defaults: every path off, each wrapper TRL's method."""
        return "_switches" in vars(self)

    @property
    def _trl_base(self) -> type:
        """The TRL trainer class this one derives from (the first class of TRL's in the method resolution order)."""
        return next(cls for cls in type(self).__mro__ if cls.__module__.startswith("trl."))

    def _save(self, output_dir: str | None = None, state_dict=None):
        """Stock's save, of the policy alone: a Hydra reward adapter on the policy is not part of what it saves (every
        checkpoint, `save_model` and `push_to_hub` save through here)."""
        with saving_policy_adapters_only(self.reward_funcs):
            return super()._save(output_dir, state_dict)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.update(self.memory_profiling.logs(logs))  # in place, as TRL's own metrics: `evaluate()` returns them
        super().log(logs, start_time)

    # -- generation --------------------------------------------------------------------------------------------------
    def _tokenize_prompts(self, prompts: list):
        tokenize = super()._tokenize_prompts
        if not self._switches.distinct_prompts or self._is_vlm:
            return tokenize(prompts)
        # With environments (GRPO), each prompt is rendered with its environment's tools: part of the key
        environments = getattr(self, "_batch_environments", None)
        if environments is None or getattr(self, "environment_factories", None) is None:
            return tokenized_once(tokenize, prompts, None)

        def tokenize_with(rows: list, row_environments: list):  # TRL renders `_batch_environments`' tools
            self._batch_environments = row_environments
            try:
                return tokenize(rows)
            finally:
                self._batch_environments = environments

        return tokenized_once(tokenize_with, prompts, environments)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        prefill = None
        if self._switches.prefill:
            # The module whose `generate` TRL's generation calls: what `unwrap_model_for_generation` yields, or under
            # `torch_compile` the module inside the compiled wrapper (whose `generate` is that module's)
            model = self.accelerator.unwrap_model(self.model_wrapped, keep_torch_compile=False)
            prefill = self._generation.prefill(model, prompt_ids, images, multimodal_fields)
        if prefill is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        with prefill:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)

    # -- the group structure: computed, carried, made active ---------------------------------------------------------
    def _generate(self, prompts: list):
        if not self._constructed:
            return super()._generate(prompts)
        with self.memory_profiling.phase("generation"), self._generation.tool_loop():
            result = super()._generate(prompts)  # TRL's tool loop runs in it: each turn's caches held for the next
        prompt_ids, completion_ids = result[0], result[1]  # RLOO's and GRPO's both lead with the token lists
        images = prompt_images(prompts)
        tool_images = result[7] if len(result) > 7 and self._is_vlm else None  # GRPO: images a tool returned, per row
        reasons = self._passes.generated_rows_reasons(prompt_ids, images, tool_images)
        for reason in reasons:
            self._fallbacks.packed(reason)
        if reasons:
            return result
        ends = {*self.eos_token_ids, self._tokenizer.pad_token_id} if self.mask_truncated_completions else None
        self._active_rows = row_groups(prompt_ids, scored_lengths(completion_ids, ends), images, completion_ids)
        return result

    def _generate_and_score_completions(self, inputs):
        self._active_rows = None
        try:
            with self.memory_profiling.scoring():  # its no-grad log-prob passes are phases
                output = super()._generate_and_score_completions(inputs)
            rows = self._active_rows
        finally:
            self._active_rows = None
            graphs.release_pools()  # the step's CUDA graphs are dead: their pool back to the device before training
        if rows is None:
            return output
        output[ROWS_KEY] = carried(rows)  # a host array per row: TRL's shuffle and split carry them with the batch
        if self._switches.keep_groups and self.model.training:
            output = ordered_for_group_shuffle(output, rows[:, 0])
        return output

    # -- training: micro-batches, their windows, their loss ----------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch):
        # The optimizer phase follows a window's last micro-batch, as transformers marks it (an epoch's short one too)
        with self.memory_profiling.micro_batch(lambda: self.accelerator.sync_gradients):
            held = self._held
            if held is None:
                return super().training_step(model, inputs, num_items_in_batch)
            held.step_begins(model)
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            except BaseException:
                held.close()
                raise
            finally:
                held.step_ends(self.accelerator.sync_gradients)

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self._held is not None:
            # (a batch without rows too: where forwards are collective, every process plans, and agrees, each scope)
            serves = self._switches.prefix and self.model.training and isinstance(inputs, dict)
            self._held.prepare(inputs if serves else None, lambda position: upcoming_micro_batches(
                getattr(self, "_buffered_inputs", None), inputs, self._step, self.args.steps_per_generation,
                self.num_iterations, self.current_gradient_accumulation_steps - position))  # fmt: skip
        return inputs

    def _compute_loss(self, model, inputs):
        rows = inputs.get(ROWS_KEY)
        previous, self._active_rows = self._active_rows, table_of(rows) if rows is not None else None
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._active_rows = previous

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal_kwargs):  # fmt: skip
        """TRL's forward, or the packed pass when the active group structure matches the batch."""
        passes = self._passes
        images = {key: value for key, value in multimodal_kwargs.items() if value is not None}
        rows = passes.rows_for(self._active_rows, input_ids, logits_to_keep, images) if passes is not None else None
        if rows is None:
            if passes is not None:
                passes.check_nothing_held()
            with self.memory_profiling.scoring_pass(model):
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                    **multimodal_kwargs,
                )  # fmt: skip
        trl_forward = super()._get_per_token_logps_and_entropies.__func__
        trl_forward = getattr(trl_forward, "__wrapped__", trl_forward)  # TRL's forward without its timer: ours is timed

        def stock(ids, mask, **chunk_images):  # stock's forward of some rows, for a chunk that cannot be packed
            return trl_forward(self, model, ids, mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                               **chunk_images)  # fmt: skip

        # The profiling phase, then TRL's timer (as TRL's own method has)
        with self.memory_profiling.scoring_pass(model), profiling_context(self, "_get_per_token_logps_and_entropies"):
            return passes.run(model, input_ids, attention_mask, logits_to_keep, rows, batch_size, compute_entropy,
                              compute_aux_loss, images, stock)  # fmt: skip

    # -- rewards -----------------------------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self._rewards is None:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        prepare = functools.partial(Trainer._prepare_inputs, self)  # to the device, as TRL's reward-model branch does
        with self.memory_profiling.phase("reward"), self._rewards.standing_in(
                self.reward_funcs, self.reward_processing_classes, self.chat_template_kwargs, prepare):  # fmt: skip
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
