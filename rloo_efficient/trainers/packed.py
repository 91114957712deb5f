"""
The trainer side of the packed log-prob and training passes ([`PackedPasses`]): whether a call of TRL's
`_get_per_token_logps_and_entropies` can be packed (the active group structure matches the batch it is given, its
images can be packed), and the pass itself, run by core ([`core.forward.passes`]) in the chunks its hold planner plans
([`core.forward.hold_planner.HoldPlanner`]); TRL's forward otherwise.
"""

import weakref
from collections.abc import Callable

import numpy as np
import torch

from ..core.forward.hold_planner import HoldPlanner
from ..core.forward.passes import PackedPass, PassCounts
from ..core.layers.vision import ModelVision
from .ranks import Ranks


class Unwrap:
    """`accelerator.unwrap_model(model)`, looked up once per model: accelerate's asks which packages are installed on
    every call (about 1.7 ms here), and a packed pass asks it once per chunk."""

    def __init__(self, accelerator):
        self._unwrap_model = accelerator.unwrap_model
        self._known = weakref.WeakKeyDictionary()

    def __call__(self, model):
        known = self._known.get(model)
        inner = known() if known is not None else None
        if inner is None:
            inner = self._unwrap_model(model)
            self._known[model] = weakref.ref(inner)  # (weak: the inner module is often the model itself)
        return inner


class PackedPasses:
    """
    The packed passes of one trainer: `autocast` (the accelerator's mixed precision), `unwrap` ([`Unwrap`]), `ranks`
    (where every process must pack or none), the policy's `vision`, the `held` prefixes' planner (None: nothing held),
    `counts` (what the passes processed); its decisions: `prefix` (the packed forwards are on), `graphs` (a no-grad
    pass's one- and two-row chunks replayed from graphs), `fall_back(reason)` (says once why such batches run stock's
    forward), `fsdp` (FSDP may shard the policy), `grads_in_place` (nothing else watches a gradient's accumulation: the
    LM head's and embedding's are added to `.grad` as made, [`core.forward.in_place_grads`]).
    """

    def __init__(self, autocast, unwrap: Unwrap, ranks: Ranks, vision: ModelVision, held: HoldPlanner | None,
                 counts: PassCounts, *, prefix: bool, graphs: bool, fall_back: Callable[[str], None],
                 fsdp: bool = False, grads_in_place: bool = False):  # fmt: skip
        self.autocast, self.unwrap, self.ranks, self.vision, self.held = autocast, unwrap, ranks, vision, held
        self.counts, self.prefix, self.graphs, self.fall_back = counts, prefix, graphs, fall_back
        self.fsdp, self.grads_in_place = fsdp, grads_in_place

    def generated_rows_reasons(self, prompt_ids: list, images: list | None, tool_images: list | None) -> list[str]:
        """Why a generation's rows (their `prompt_ids`, each row's prompt `images` and the `tool_images` its tools
        returned, or None) cannot be packed: every reason that holds (none: they can)."""
        reasons = []
        if images is not None and any(ids and ids[-1] in self.vision.image_tokens for ids in prompt_ids):
            # Each row's copy of its prompt's last token would be an image's: its features would be needed per row
            reasons.append("a prompt ends with an image's token")
        if tool_images and any(tool_images):
            # In the rows' completions, each row's own: the packed forward takes images from the prompts only
            reasons.append("a tool returned images")
        return reasons

    def rows_for(self, rows: torch.Tensor | None, input_ids, logits_to_keep: int, images: dict) -> torch.Tensor | None:
        """`rows`, the active group structure, where a packed pass can serve this call (every process's, where the
        processes must agree), else None."""
        rows = self._rows_for(rows, input_ids, logits_to_keep, images)
        if self.held is not None and not torch.is_grad_enabled() and not self.ranks.agree(np.array([rows is not None])):
            rows = None  # every process packs or none does: the packed pass agrees its plans with all
        return rows

    def _rows_for(self, rows: torch.Tensor | None, input_ids, logits_to_keep: int, images: dict) -> torch.Tensor | None:
        if not self.prefix or rows is None:
            return None
        if images.get("pixel_values") is not None:  # a batch with images: stock's forward where they cannot be packed
            reason = self.vision.batch_reason(images)
            if reason is not None:
                self.fall_back(reason)
                return None
        if any(key not in images for key in ("pixel_values", "num_images")) and images:  # token types, no image
            return None
        group, plen, scored = rows[:, :3].numpy().T  # host values
        if len(group) != input_ids.shape[0] or plen.max() > input_ids.shape[1] - logits_to_keep or (
            scored.max() > logits_to_keep):  # fmt: skip
            # Count-free, so that it warns once however many batch shapes miss it
            self.fall_back("the group structure of the batch's generation does not match the rows, prompt length or "
                           "completion length of the batch a forward is given")  # fmt: skip
            return None
        return rows

    def check_nothing_held(self) -> None:
        """Before stock's forward: refused where a training scope's held prompts wait for their backward."""
        if self.held is not None:
            self.held.check_nothing_held()

    @property
    def _graphs(self) -> bool:
        """Whether a no-grad pass may replay its one-row chunks from graphs: where each process decides its own
        forwards (under ZeRO-3 or FSDP every forward gathers parameters from all of them: a capture, or a check's
        extra forward, on one process alone would stall the others)."""
        return self.graphs and not self.ranks.collective()

    def run(self, model, input_ids, attention_mask, logits_to_keep: int, rows: torch.Tensor, batch_size: int | None,
            compute_entropy: bool, compute_aux_loss: bool, images: dict, stock: Callable) -> tuple:  # fmt: skip
        """The packed pass ([`core.forward.passes.PackedPass`]) over TRL's chunks of `batch_size` rows, in the chunks
        the held prefixes plan; `stock(input_ids, attention_mask, **images)`: TRL's forward of some rows, for a chunk
        that cannot be packed."""
        packed = PackedPass(model, self.unwrap(model), compute_entropy, compute_aux_loss, self.vision, self.autocast,
                            self.held, self.fall_back, self.counts, self.fsdp,
                            graphs=self._graphs, grads_in_place=self.grads_in_place)  # fmt: skip
        return packed.run(input_ids, attention_mask, logits_to_keep, rows, batch_size, images, stock)
