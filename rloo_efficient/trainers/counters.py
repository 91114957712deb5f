"""
What our paths processed, per trainer ([`Counts`]), read as the trainer's attributes ([`Counted`]): deterministic
counts that tests and benchmarks read, and that a user may reset.
"""

import dataclasses

from ..core.forward.passes import PassCounts


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


class Counted:
    """The trainer's counters, each an attribute read from (and reset in) its [`Counts`]."""

    _counts = Counts()  # a trainer built without our `__init__`: zeros (its own once one is reset)

    packed_forward_tokens = _count("packed_forward_tokens")
    tree_tokens = _count("tree_tokens")
    held_forward_tokens = _count("held_forward_tokens")
    scoring_forward_calls = _count("scoring_forward_calls")
    graph_replays = _count("graph_replays")
    shared_prefill_tokens = _count("shared_prefill_tokens")
    reward_forward_tokens = _count("reward_forward_tokens")
    reward_shared_prefix_lengths = _count("reward_shared_prefix_lengths")
