"""
An embedding's weight gradient on the rows its tokens touch, as torch's dense backward makes those rows: added to a
`.grad` in place ([`add_rows`]), or, for a weight tied to the LM head, summed with the head's gradient as autograd sums
the two ([`Tied`]). With no host sync: every shape follows the token count.
"""

import torch


def distinct_rows(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`indices` (flat) as `n` slots of distinct indices: `(distinct, renamed, ranks)`. `distinct[r]` is the index of
    rank `r` among the distinct ones (ascending; the spare slots past the distinct count hold 0), `renamed` each token's
    rank, `ranks` the sorted tokens' ranks. Shapes fixed by the token count: no host sync."""
    ordered, order = torch.sort(indices, stable=True)
    starts = torch.diff(ordered, prepend=ordered.new_full((1,), -1)).ne(0)  # (indices are not negative)
    ranks = starts.cumsum(0) - 1  # each sorted token's index's rank among the distinct ones
    distinct = torch.zeros_like(indices).scatter_(0, ranks, ordered)
    renamed = torch.empty_like(ranks).scatter_(0, order, ranks)
    return distinct, renamed, ranks


def dense_rows(rows: torch.Tensor, indices: torch.Tensor, renamed: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """`embedding_dense_backward(rows, indices, V, padding_idx)` on the touched rows only, one per slot of
    [`distinct_rows`]: each index renamed to its rank among the distinct indices (order kept: a stable sort orders the
    renamed indices as the originals, so torch's kernels, CPU and CUDA, sum each row's tokens in the same order and
    groups); the spare slots' rows are zeros."""
    if padding_idx >= 0:  # the padding row gets nothing: its tokens' rows zeroed, added to its own slot as zeros
        rows = torch.where((indices == padding_idx).unsqueeze(-1), 0, rows)
    return torch.ops.aten.embedding_dense_backward(rows, renamed, indices.numel(), -1, False)


def add_rows(grad: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor, padding_idx: int) -> None:
    """`grad += embedding_dense_backward(rows, indices, V, padding_idx)`, made on the touched rows only
    ([`dense_rows`]) and added to `grad`'s rows by the distinct indices (the spare slots add zeros to row 0)."""
    distinct, renamed, _ = distinct_rows(indices)
    grad.index_put_((distinct,), dense_rows(rows, indices, renamed, padding_idx).to(grad.dtype), accumulate=True)


class Tied:
    """
    A tied weight's gradient as autograd adds it: the head's and the lookup's summed, then added to `.grad` (or taken as
    `.grad`, where there is none). The head's backward runs first: it adds its gradient, one vocabulary chunk at a
    time, to every row, having kept the rows the lookup's tokens touch as they were (`grad_rows`) and its own gradient
    on them (`head_rows`); the lookup's backward then writes those rows as `grad_rows + (head_rows + its gradient)`.
    One slot per token ([`distinct_rows`]): the spare slots write the first distinct row's value again. Autograd's
    order: the head's backward runs before the lookup's (its input's gradient comes from the head's). Nothing may add to
    the weight's gradient between them: checked (its version), as is that the lookup's backward is the same backward's
    (a later one adds its gradient as an untied lookup's, as autograd would).
    """

    def __init__(self, indices: torch.Tensor, padding_idx: int, parameter: torch.Tensor):
        self.indices, self.padding_idx, self.parameter = indices.reshape(-1).long(), padding_idx, parameter
        self.head_rows = self.grad_rows = None  # the rows kept, from the head's backward to the lookup's
        self.distinct = self.renamed = self.slots = None  # the slots ([`distinct_rows`]), made in the head's backward
        self.task = self.version = None  # the head's backward's graph task, and `.grad`'s version after it

    def hold(self) -> None:
        """Before the head's chunks: `.grad` made where there is none, and the touched rows kept."""
        weight = self.parameter
        n = self.indices.numel()
        self.distinct, self.renamed, ranks = distinct_rows(self.indices)
        slots = torch.arange(n, device=self.indices.device)
        self.slots = torch.where(slots > ranks.narrow(0, max(n - 1, 0), min(n, 1)), 0, slots)  # (spare: the first's)
        self.distinct = self.distinct.index_select(0, self.slots)
        if weight.grad is None:
            # Autograd would take the sum as `.grad`: zeros plus it are the same bits (the sum is never -0.0: the
            # lookup's zeros are +0.0)
            weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
        self.grad_rows = weight.grad.index_select(0, self.distinct)
        self.head_rows = weight.new_zeros((n, weight.shape[1]))
        self.task = torch._C._current_graph_task_id()

    def take(self, part: torch.Tensor, start: int) -> None:
        """The head's gradient on rows `start:start + len(part)`: its touched rows kept, every row added."""
        local = self.distinct - start
        inside = ((local >= 0) & (local < part.shape[0])).unsqueeze(-1)
        torch.where(inside, part.index_select(0, local.clamp(0, part.shape[0] - 1)), self.head_rows, out=self.head_rows)
        if part.dtype in (torch.float16, torch.bfloat16):  # autograd adds an untouched row the lookup's +0.0: a
            part.add_(0.0)  # no-op but on -0.0, which only rounding to half precision makes of TRL's float32 sums
        grad = self.parameter.grad
        grad.narrow(0, start, part.shape[0]).add_(part)
        self.version = grad._version

    def add(self, grad_output: torch.Tensor) -> bool:
        """The lookup's backward: the touched rows written as autograd's addition of the summed gradients makes them.
        False where this is not the head's backward (the rows are then as autograd leaves them: the lookup's gradient
        is still to be added)."""
        head_rows, grad_rows, self.head_rows, self.grad_rows = self.head_rows, self.grad_rows, None, None
        if self.task != torch._C._current_graph_task_id():
            return False
        grad = self.parameter.grad
        if grad is None or grad._version != self.version:
            raise RuntimeError("rloo_efficient: a tied LM head's and input embedding's gradient was changed between "
                               "their backwards, which their sum added in place cannot follow")  # fmt: skip
        total = dense_rows(grad_output, self.indices, self.renamed, self.padding_idx).to(grad.dtype)
        total = total.index_select(0, self.slots)
        grad_rows.add_(total.add_(head_rows))  # (autograd's `grad + (head's + lookup's)`: the sums commute)
        grad.index_copy_(0, self.distinct, grad_rows)
        return True
