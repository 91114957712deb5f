"""
The trainer side of the packed log-prob and training passes ([`PackedPasses`]): whether a call of TRL's
`_get_per_token_logps_and_entropies` can be packed (the active group structure matches the batch it is given, its
images can be packed), and the pass itself, run by core ([`core.forward.passes`]) in the chunks the held prefixes plan
([`held_prefix.HeldPrefixes`]); TRL's forward otherwise.
"""

import functools
import weakref
from collections.abc import Callable

import numpy as np
import torch

from ..core.forward.passes import PackedPass, PassCounts
from ..core.layers.vision import ModelVision
from .held_prefix import HeldPrefixes
from .ranks import Ranks
from .switches import Switches


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
    The packed passes of one trainer: `autocast` (the accelerator's mixed precision), `unwrap` ([`Unwrap`]),
    `switches` (whether to pack, and the fallbacks), `ranks` (where every process must pack or none), the policy's
    `vision`, the `held` prefixes (None: nothing held), `counts` (what the passes processed), `fsdp` (FSDP may shard
    the policy), `grads_in_place` (nothing else watches a gradient's accumulation: the LM head's is added to `.grad` as
    made, [`core.forward.in_place_grads`]).
    """

    def __init__(self, autocast, unwrap: Unwrap, switches: Switches, ranks: Ranks, vision: ModelVision,
                 held: HeldPrefixes | None, counts: PassCounts, fsdp: bool = False,
                 grads_in_place: bool = False):  # fmt: skip
        self.autocast, self.unwrap, self.switches, self.ranks, self.vision = autocast, unwrap, switches, ranks, vision
        self.held, self.counts, self.fsdp, self.grads_in_place = held, counts, fsdp, grads_in_place

    def rows_for(self, rows: torch.Tensor | None, input_ids, logits_to_keep: int, images: dict) -> torch.Tensor | None:
        """`rows`, the active group structure, where a packed pass can serve this call (every process's, where the
        processes must agree), else None."""
        rows = self._rows_for(rows, input_ids, logits_to_keep, images)
        if self.held is not None and not torch.is_grad_enabled() and not self.ranks.agree(np.array([rows is not None])):
            rows = None  # every process packs or none does: the packed pass agrees its plans with all
        return rows

    def _rows_for(self, rows: torch.Tensor | None, input_ids, logits_to_keep: int, images: dict) -> torch.Tensor | None:
        if not self.switches.prefix or rows is None:
            return None
        if images.get("pixel_values") is not None:  # a batch with images: stock's forward where they cannot be packed
            reason = self.vision.batch_reason(images)
            if reason is not None:
                self.switches.fall_back(reason, permanent=False)
                return None
        if any(key not in images for key in ("pixel_values", "num_images")) and images:  # token types, no image
            return None
        group, plen, scored = rows[:, :3].numpy().T  # host values
        if len(group) != input_ids.shape[0] or plen.max() > input_ids.shape[1] - logits_to_keep or (
            scored.max() > logits_to_keep):  # fmt: skip
            # Count-free, so that it warns once however many batch shapes miss it
            self.switches.fall_back("the group structure of the batch's generation does not match the rows, prompt "
                                    "length or completion length of the batch a forward is given",
                                    permanent=False)  # fmt: skip
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
        return self.switches.settings.graph_scoring_passes and not self.ranks.collective()

    def run(self, model, input_ids, attention_mask, logits_to_keep: int, rows: torch.Tensor, batch_size: int | None,
            compute_entropy: bool, compute_aux_loss: bool, images: dict, stock: Callable) -> tuple:  # fmt: skip
        """The packed pass ([`core.forward.passes.PackedPass`]) over TRL's chunks of `batch_size` rows, in the chunks
        the held prefixes plan; `stock(input_ids, attention_mask, **images)`: TRL's forward of some rows, for a chunk
        that cannot be packed."""
        fall_back = functools.partial(self.switches.fall_back, permanent=False)
        packed = PackedPass(model, self.unwrap(model), compute_entropy, compute_aux_loss, self.vision, self.autocast,
                            self.held, fall_back, self.counts, self.fsdp,
                            graphs=self._graphs, grads_in_place=self.grads_in_place)  # fmt: skip
        return packed.run(input_ids, attention_mask, logits_to_keep, rows, batch_size, images, stock)
