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
"""

import dataclasses
import functools

import torch
from accelerate.utils import DistributedType
from transformers import Trainer
from trl.extras.profiling import profiling_context

from ..core.forward.passes import PassCounts
from ..core.layers.install import install
from ..core.layers.vision import ModelVision
from ..core.tree.rows import prompt_images, row_groups
from ..profiling.trainer_profiling import PROFILING_OFF, TrainerProfiling
from .config import ROWS_KEY, sharing_settings
from .generation import SharedGeneration, distinct_prompts
from .group_shuffle import group_shuffle_reason, ordered_for_group_shuffle
from .held_prefix import HeldPrefixes
from .hydra import attach_hydra_rewards, hydra_reward_funcs, saving_policy_adapters_only
from .packed import PackedPasses, Unwrap
from .ranks import Ranks
from .rewards import RewardScoring
from .switches import STOCK, Fallbacks, Setup, Switches


@dataclasses.dataclass
class Counts(PassCounts):
    """What our paths processed (deterministic; read by tests and benchmarks): the packed passes' ([`PassCounts`]),
    the shared generation prefill's and the packed reward forward's."""

    shared_prefill_tokens: int = 0  # prompt tokens the shared generation prefill forwarded
    reward_forward_tokens: int = 0  # tokens the packed reward forward processed
    reward_shared_prefix_lengths: list | None = None  # the last packed reward batch's shared prefix per row


def _count(name: str) -> property:
    """The trainer's `name` counter, kept in its [`Counts`] (a user may reset it, as before)."""

    def reset(self, value) -> None:
        if "_counts" not in vars(self):  # a trainer built without our `__init__`: its own, not the class's zeros
            self._counts = Counts()
        setattr(self._counts, name, value)

    return property(lambda self: getattr(self._counts, name), reset, doc=f"`{name}` of [`Counts`].")


class GroupSharingMixin:
    """
    Each prompt once per group in every phase of a TRL group trainer. Mix it in before the trainer class,
    `class MyTrainer(GroupSharingMixin, trl.GRPOTrainer)`; [`RLOOTrainer`] and [`GRPOTrainer`] are built so. The
    switches are our config's fields ([`config.SharingArguments`]), read from `args` with their defaults where `args`
    is a stock config.

    TRL methods wrapped (each calls `super()`), and why:
    - `__init__`: a reward adapter on the policy's base attached to the policy instead of loaded as a second model
      (Hydra); our attention function installed on the policy and the reference; the parts built.
    - `_tokenize_prompts`: each distinct prompt (and environment) tokenized once; its rows get copies.
    - `_generate_single_turn`: while it runs, the model's `generate` prefills each distinct prompt once
      ([`core.generation.generate`]), its images encoded once ([`core.layers.vision`]); vLLM and continuous batching go
      to TRL untouched.
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

    _config_class: type | None = None  # our config for this trainer: a stock config of its base class becomes one
    # What a trainer built without our `__init__` reads ([`_constructed`]): every path off, no part, each wrapper TRL's
    # method
    _switches: Switches = STOCK
    _counts = Counts()
    _generation: SharedGeneration | None = None
    _passes: PackedPasses | None = None
    _held: HeldPrefixes | None = None
    _rewards: RewardScoring | None = None
    memory_profiling: TrainerProfiling = PROFILING_OFF
    _active_rows: torch.Tensor | None = None  # the group structure TRL's current forwards use

    packed_forward_tokens = _count("packed_forward_tokens")
    tree_tokens = _count("tree_tokens")
    held_forward_tokens = _count("held_forward_tokens")
    scoring_forward_calls = _count("scoring_forward_calls")
    graph_replays = _count("graph_replays")
    shared_prefill_tokens = _count("shared_prefill_tokens")
    reward_forward_tokens = _count("reward_forward_tokens")
    reward_shared_prefix_lengths = _count("reward_shared_prefix_lengths")

    def __init__(self, model, reward_funcs=None, args=None, *positional, **kwargs):
        if self._config_class is not None and type(args) is self._config_class._stock:
            args = self._config_class.from_stock(args)
        settings = sharing_settings(args)
        self._counts = Counts()
        reward_funcs = hydra_reward_funcs(self._trl_base.__init__, model, reward_funcs, args, positional, kwargs,
                                          settings.hydra_reward_adapter)  # fmt: skip
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        unwrap = Unwrap(self.accelerator)
        unwrapped = unwrap(self.model)
        attach_hydra_rewards(self.reward_funcs, self.reward_processing_classes, unwrapped, self.args.trust_remote_code)
        backend = None
        if self.use_vllm or self.use_transformers_continuous_batching:
            backend = "vLLM" if self.use_vllm else "transformers' continuous batching"
        setup = Setup(unwrapped, getattr(self, "generation_config", None), self.accelerator.device, bool(self.aux_loss_enabled),
                      other_backend=backend, tools=bool(getattr(self, "tools", None)),
                      several_micro_batches=self.args.steps_per_generation > 1)  # fmt: skip
        entropy_bonus = getattr(self, "_entropy_bonus_enabled", False)  # (TRL's GRPO only)
        switches = Switches.resolve(settings, setup,
                                    lambda: group_shuffle_reason(self, GroupSharingMixin, entropy_bonus))  # fmt: skip
        policy = lambda: unwrap(self.model)  # noqa: E731 (the Trainer may replace `self.model` when it prepares it)
        ranks = Ranks(self.accelerator, policy)
        vision = ModelVision.of(unwrapped)  # batches with images: packed for the families whose layout is known
        fsdp = 0
        if getattr(self, "is_fsdp_enabled", False):
            fsdp = 2 if getattr(self.accelerator, "is_fsdp2", False) else 1
        # Nothing but autograd watches a gradient's accumulation: it may be done as gradients arrive
        owns_accumulation = self.accelerator.distributed_type == DistributedType.NO and not self.args.torch_compile
        fallbacks = self._fallbacks = Fallbacks()
        if switches.hold_budget:  # prompts held across a pass's chunks and a step's micro-batches
            self._held = HeldPrefixes.of(switches.hold_budget, policy, self.args, ranks.agree, fallbacks.warn, vision,
                                         fsdp=fsdp, aux_loss=bool(self.aux_loss_enabled),
                                         alias_parameters=owns_accumulation)  # fmt: skip
        self._switches, self._ranks = switches, ranks
        planner = self._held.planner if self._held is not None else None
        self._passes = PackedPasses(self.accelerator.autocast, unwrap, ranks, vision, planner, self._counts,
                                    prefix=switches.prefix, graphs=switches.graphed_passes, fall_back=fallbacks.packed,
                                    fsdp=bool(fsdp), grads_in_place=owns_accumulation)  # fmt: skip
        self._generation = SharedGeneration(ranks, vision, self._counts, cache_once=switches.prompt_cache_once,
                                            tree=switches.tree, static=switches.static_decoding,
                                            turn_budget=switches.turn_budget, fall_back=fallbacks.packed,
                                            warn=fallbacks.warn)  # fmt: skip
        self._rewards = RewardScoring(self.accelerator.device, unwrap, self._counts, share=switches.reward_prefix,
                                      warn=fallbacks.warn)  # fmt: skip
        if switches.any_layout:
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
        """
        Whether our `__init__` ran. A trainer made without it (a unit test's bare `object.__new__(GRPOTrainer)` with
        hand-set attributes, as TRL's own tests make one) reads the class defaults: every sharing switch off, and each
        of our wrappers is TRL's method.
        """
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
        if not self._switches.distinct_prompts or self._is_vlm:
            return super()._tokenize_prompts(prompts)
        # With environments (GRPO), each prompt is rendered with its environment's tools: part of the key
        environments = getattr(self, "_batch_environments", None)
        if getattr(self, "environment_factories", None) is None:
            environments = None
        first, index = distinct_prompts(prompts, environments)
        if len(first) == len(prompts):
            return super()._tokenize_prompts(prompts)
        if environments is not None:
            self._batch_environments = [environments[row] for row in first]
        try:
            unique_ids, images, fields = super()._tokenize_prompts([prompts[row] for row in first])
        finally:
            if environments is not None:
                self._batch_environments = environments
        if fields:  # per-prompt fields would need the same fan-out: tokenize every row, as stock does
            return super()._tokenize_prompts(prompts)
        # Each row gets its own copy of its prompt's tokens (a list later code may edit in place)
        return [list(unique_ids[distinct]) for distinct in index], images, fields

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
    def _scored_lengths(self, completion_ids_list: list[list[int]]) -> list[int]:
        """Completion tokens stock TRL scores per row: all of them, or none for a masked truncated completion."""
        if not self.mask_truncated_completions:
            return [len(ids) for ids in completion_ids_list]
        ends = {*self.eos_token_ids, self._tokenizer.pad_token_id}
        return [len(ids) if ids and ids[-1] in ends else 0 for ids in completion_ids_list]

    def _generate(self, prompts: list):
        if not self._constructed:
            return super()._generate(prompts)
        with self.memory_profiling.phase("generation"), self._generation.tool_loop():
            result = super()._generate(prompts)  # TRL's tool loop runs in it: each turn's caches held for the next
        prompt_ids, completion_ids = result[0], result[1]  # RLOO's and GRPO's both lead with the token lists
        images = prompt_images(prompts)
        self._active_rows = row_groups(prompt_ids, self._scored_lengths(completion_ids), images, completion_ids)
        if images is not None and any(ids and ids[-1] in self._passes.vision.image_tokens for ids in prompt_ids):
            # Each row's copy of its prompt's last token would be an image's: its features would be needed per row
            self._fallbacks.packed("a prompt ends with an image's token")
            self._active_rows = None
        tool_images = result[7] if len(result) > 7 else None  # GRPO: images a tool returned, per row
        if self._is_vlm and tool_images and any(tool_images):
            # In the rows' completions, each row's own: the packed forward takes images from the prompts only
            self._fallbacks.packed("a tool returned images")
            self._active_rows = None
        return result

    def _generate_and_score_completions(self, inputs):
        self._active_rows = None
        try:
            with self.memory_profiling.scoring():  # its no-grad log-prob passes are phases
                output = super()._generate_and_score_completions(inputs)
            rows = self._active_rows
        finally:
            self._active_rows = None
        if rows is None:
            return output
        output[ROWS_KEY] = rows  # a (B, 3 + W) CPU tensor: TRL's shuffle and split carry it with the batch
        if self._switches.keep_groups and self.model.training:
            output = ordered_for_group_shuffle(output, rows[:, 0])
        return output

    # -- training: micro-batches, their windows, their loss ----------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch):
        # The accumulation's last micro-batch (TRL counts `_step` in its `training_step`): the optimizer step follows
        with self.memory_profiling.micro_batch(lambda: self._step % self.current_gradient_accumulation_steps == 0):
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
            self._held.prepare(inputs if serves else None, lambda position: self._upcoming(inputs, position))
        return inputs

    def _upcoming(self, inputs: dict, window_position: int) -> list | None:
        """The micro-batches TRL will serve from `inputs` on (its buffered generation's, in the order TRL serves them),
        to the end of the optimizer step (`window_position` of its micro-batches run so far) or of the generation,
        whichever comes first; None where `inputs` is not TRL's next buffered one."""
        buffered = getattr(self, "_buffered_inputs", None)
        per_generation = self.args.steps_per_generation
        generate_every = per_generation * self.num_iterations
        step = self._step
        count = min(self.current_gradient_accumulation_steps - window_position,
                    generate_every - step % generate_every)  # fmt: skip
        if not buffered or count < 2 or buffered[step % per_generation] is not inputs:
            return None
        return [buffered[(step + t) % per_generation] for t in range(count)]

    def _compute_loss(self, model, inputs):
        previous, self._active_rows = self._active_rows, inputs.get(ROWS_KEY)
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
