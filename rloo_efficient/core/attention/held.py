"""
The state a source forward holds for later micro-batches ([`tree.holds`]), and how they read it with or without grad.

A source is one packed forward over held nodes. What later tokens read of it is held, per layer: the attention keys and
values as the attention function reads them, a recurrent layer's final states and convolution tails at each node's
end, and the router logits of a MoE layer (for the load-balancing loss, which counts every token stock's micro-batch
holds). Each is a tensor of the forward, attached to its graph when it runs with grad.

In training a source's graph is backpropagated once, in its backprop chunk ([`tree.holds.HoldPlan.backprop_chunk`]), and
every reader contributes to its gradient:

- a reader whose backward runs before it reads `detached` copies: leaves sharing the tensors' storage, whose gradient
  is added into a bank (float32 for half precision) and dropped as it arrives;
- the readers whose backward runs in it read `attached` views through one autograd node for all of the source's
  tensors, whose backward adds each bank to the gradient flowing in (a bank alone where none flows in): the source's
  one backward then runs inside the Trainer's ordinary backward of that micro-batch, which also owns gradient
  synchronization, checkpointing's recomputation and loss scaling (the bank holds gradients of the same scaled loss).

One node for all of them, because a reader may leave some of them without gradient: a later source's forward reads
an ancestor source's keys in every layer, but nothing reads its last layer's attention output, so that the ancestor's
last-layer keys get no gradient there; their bank, what the earlier readers sent them, must still go in. A source
forward that reads attached ancestors is linked to them ([`link`]): its own backward sets theirs off, whether or not
its tensors depend on theirs (in a one-layer model they do not).

Reading the attached tensors from a micro-batch whose backward runs earlier would backpropagate the source twice (and a
second time through a graph already freed); reading detached ones in the backprop chunk would leave the bank unused.
[`tree.holds.HoldPlan.attached`] decides which, per reader.
"""

import contextlib
import contextvars

import torch


_holding: contextvars.ContextVar = contextvars.ContextVar("rloo_holding", default=None)


class _WithBanks(torch.autograd.Function):
    """A source's held tensors as its backprop chunk reads them, and a token to link a later source to them ([`link`]):
    themselves forward; backward, each one's gradient plus its bank, or its bank alone where no gradient reaches it."""

    @staticmethod
    def forward(ctx, source, names, *tensors):
        # The banks as they will be when this backward runs: the source may be released before (its last micro-batch
        # releases it after its forward), and its banks go with this graph
        ctx.source, ctx.banks, ctx.names = source, source.banks, names
        ctx.dtypes = [tensor.dtype for tensor in tensors]
        ctx.set_materialize_grads(False)  # (no zeros made for a tensor no gradient reaches)
        return (*(tensor.view_as(tensor) for tensor in tensors), tensors[0].new_zeros(()))

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for name, dtype, grad in zip(ctx.names, ctx.dtypes, grads[:-1], strict=True):
            # (freed as its sum goes on: the source's backward runs after every layer's)
            bank = ctx.banks.pop(name, None)
            if bank is not None:
                grad = bank.to(dtype) if grad is None else (grad.to(bank.dtype) + bank).to(grad.dtype)
            ctx.source.banks_added += bank is not None
            out.append(grad)
        return None, None, *out


class _Linked(torch.autograd.Function):
    """A source's tensors after its forward, linked to the tokens of the attached ancestors it read: themselves forward;
    backward, their gradients, and a zero to each token, which sets the ancestors' backward off."""

    @staticmethod
    def forward(ctx, count, *tokens_and_tensors):
        ctx.tokens = [(token.dtype, token.device) for token in tokens_and_tensors[:count]]
        ctx.set_materialize_grads(False)
        return tuple(tensor.view_as(tensor) for tensor in tokens_and_tensors[count:])

    @staticmethod
    def backward(ctx, *grads):
        return None, *(torch.zeros((), dtype=dtype, device=device) for dtype, device in ctx.tokens), *grads


def link(tensors: dict, tokens: list[torch.Tensor]) -> dict:
    """`tensors` (a source's, by name) whose backward also sets off the backward of the attached reads whose `tokens`
    ([`HeldSource.read`]'s `"link"`) its forward read; as they are where there is nothing to link."""
    names = [name for name, tensor in tensors.items() if tensor.requires_grad]
    if not tokens or not names:
        return tensors
    linked = _Linked.apply(len(tokens), *tokens, *(tensors[name] for name in names))
    return {**tensors, **dict(zip(names, linked, strict=True))}


class HeldSource:
    """The tensors one source forward left (`name -> tensor`), and their detached and attached versions."""

    def __init__(self, tensors: dict, tokens: int):
        self.tensors = tensors
        self.tokens = tokens
        self.banks: dict = {}
        self.banks_added = 0  # attached tensors whose backward added a bank (read by tests)
        self._versions: dict[bool, dict] = {}

    def read(self, attached: bool) -> dict:
        """Every held tensor, `attached` (through the banks, with a `"link"` token: [`link`]) or detached (its
        gradient banked); as they are where nothing needs a gradient."""
        if attached not in self._versions:
            versions = dict(self.tensors)
            names = [name for name, tensor in self.tensors.items() if tensor.requires_grad]
            if attached and names:
                *views, token = _WithBanks.apply(self, names, *(self.tensors[name] for name in names))
                versions.update(zip(names, views, strict=True))
                versions["link"] = token
            elif names:
                versions.update({name: self._detached(name, self.tensors[name]) for name in names})
            self._versions[attached] = versions
        return self._versions[attached]

    def _detached(self, name, tensor: torch.Tensor) -> torch.Tensor:
        leaf = tensor.detach().requires_grad_(True)  # the same storage
        leaf.register_post_accumulate_grad_hook(lambda leaf, name=name: self._bank(name, leaf))
        return leaf

    def _bank(self, name, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        dtype = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
        if name in self.banks:
            self.banks[name].add_(grad)
        else:
            self.banks[name] = grad.to(dtype, copy=True)

    @property
    def nbytes(self) -> int:
        tensors = [*self.tensors.values(), *self.banks.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def release(self) -> None:
        """Drops the held tensors and banks (an attached version's backward still to run keeps its banks)."""
        self.tensors, self.banks, self._versions = {}, {}, {}


class HeldReads:
    """What one packed forward reads of held sources: `slots`, each a source's tensors in the version it reads (the
    layout's held parts name their slot), and `kv_source`, the layer whose keys each attention layer reads (Gemma 4's
    shared layers read another's)."""

    def __init__(self, slots: list[dict], kv_source: list[int] | None = None):
        self.slots = slots
        self.kv_source = kv_source

    def attention(self, layer: int, expand=None) -> list[torch.Tensor]:
        """`[key, value]` of every slot for attention layer `layer`, `(1, Hkv, Ns, D)` each; a slot holding latents
        (multi-head latent attention) expanded by `expand(kv_nope, k_rot)`, the layer's own `expand_kv`."""
        layer = layer if self.kv_source is None else self.kv_source[layer]
        out = []
        for slot in self.slots:
            if ("latent", layer) in slot and expand is not None:
                out += expand(slot[("latent", layer)], slot[("rot", layer)])
                continue
            if ("key", layer) not in slot:
                raise RuntimeError(f"No keys were held for attention layer {layer}: its attention did not go through "
                                   "rloo_efficient's attention function in the source forward.")  # fmt: skip
            out += [slot[("key", layer)], slot[("value", layer)]]
        return out

    def recurrent(self, layer) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(final states, convolution tails)` of every slot's nodes for recurrent layer `layer` (a module), the slots
        concatenated, with a row of zeros after them (the state of a root without a held parent); None where no slot
        holds one."""
        pairs = [(slot.get(("state", id(layer))), slot[("tail", id(layer))]) for slot in self.slots
                 if ("tail", id(layer)) in slot]  # fmt: skip
        if not pairs:
            return None
        states, tails = zip(*pairs, strict=True)
        zero = lambda x: x.new_zeros((1, *x.shape[1:]))  # noqa: E731
        joined = lambda xs: None if xs[0] is None else torch.cat([*xs, zero(xs[0])])  # noqa: E731 (a convolution: no state)
        return joined(states), joined(tails)

    def links(self) -> list[torch.Tensor]:
        """The tokens of the slots read attached ([`link`])."""
        return [slot["link"] for slot in self.slots if "link" in slot]

    def routers(self) -> list[list[torch.Tensor]]:
        """Per slot, each MoE layer's router logits `(Ns, E)`, in call order."""
        return [[slot[("router", index)] for index in range(sum(name[0] == "router" for name in slot))]
                for slot in self.slots]  # fmt: skip


class Capture:
    """What a source forward's layers hand over, collected as a [`HeldSource`]'s tensors. `owner`: under FSDP2, the
    sharded module whose forward is running ([`forward.sharded.running_owner`]), whose parameters each held tensor's
    backward needs gathered ([`guard`])."""

    def __init__(self, kv_source: list[int] | None = None, owner=None):
        self.tensors: dict = {}
        self.kv_source = kv_source
        self.owner = owner

    def attention(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.kv_source is not None and self.kv_source[layer] != layer:
            return  # a layer reading another's keys: its source's are held
        if ("latent", layer) in self.tensors:
            return  # latent attention: the latents these keys expand from are held ([`latents`])
        self.tensors[("key", layer)], self.tensors[("value", layer)] = self.guard(key), self.guard(value)

    def latents(self, layer: int, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> None:
        """Multi-head latent attention's latents, `(1, 1, N, rank)` and `(1, 1, N, rope dims)`, as its `expand_kv`
        takes them (each reader expands them again, as stock's rows each expand their own): held in place of the keys
        and values, which have `heads * (qk_head_dim + v_head_dim) / (rank + rope dims)` times as many values (71 at
        DeepSeek-V3's widths). In the dtype they come in: narrowing them would change the gradients' sums (the rope
        part's over heads, a LoRA `kv_b_proj`'s two paths', both float32 in stock's). A view of a wider tensor
        (Kimi-Linear's rope part, split from the projection) is copied, so that it does not keep the rest alive."""
        self.tensors[("latent", layer)] = self.guard(kv_nope.contiguous())
        self.tensors[("rot", layer)] = self.guard(k_rot.contiguous())

    def recurrent(self, layer, kind: str, value: torch.Tensor) -> None:
        """Every node's final `"state"` or convolution `"tail"` of a recurrent layer, in [`tree.runs.level_order`]."""
        self.tensors[(kind, id(layer))] = self.guard(value)

    def routers(self, logits: list[torch.Tensor]) -> None:
        """Each MoE layer's router logits, in call order (each guarded as the forward recorded it)."""
        for index, value in enumerate(logits):
            self.tensors[("router", index)] = value

    def guard(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, its backward preceded by gathering the sharded module it was computed in (under FSDP2): its
        gradient enters that module inside it, where FSDP gathers parameters only for a gradient reaching the
        module's output, which none may (a source's last layer: nothing reads its output)."""
        module = self.owner() if self.owner is not None else None
        if module is not None and tensor.grad_fn is not None:
            tensor.grad_fn.register_prehook(lambda grad_outputs, module=module: module.unshard())
        return tensor


def capturing():
    """The [`Capture`] of the source forward running now, or None (never during checkpointing's recomputation, which
    runs outside the forward's block)."""
    return _holding.get()


@contextlib.contextmanager
def holding(capture: Capture):
    token = _holding.set(capture)
    try:
        yield capture
    finally:
        _holding.reset(token)
