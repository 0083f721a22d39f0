"""An LM head and the losses read from its logits, a chunk of positions at a time, with the gradients formed in the
forward pass: no `(positions, vocab)` logits matrix is ever whole, and none is kept for backward.

`chunked_head_losses` applies a bias-free LM head (weight `(vocab, hidden)`) to groups of hidden-state rows and sums
weighted per-row terms: `nll` (negative log-likelihood of the row's label) and `kl` (forward KL from a teacher's
distribution, optionally transformed by `teacher_target`, to the head's; the teacher's own head runs on the same chunk,
without gradient). Per chunk the
logits are formed in the head's compute dtype (autocast's dtype when autocast is on, as `nn.Linear` would run),
widened to at least float32, turned into the terms and their gradient w.r.t. the logits; that gradient gives the rows'
gradient (`g @ W`) and is added into the head weight's (`W_grad += g^T @ rows`), then the chunk is freed. Backward only
scales the stored gradients by the incoming one; autograd delivers them to the hidden states and to the weight's
`.grad` (DDP's hooks and a head tied to the input embedding included). One head matmul forward and two for the
gradients, as without chunks; nothing is recomputed.

Not supported: a second backward through the same graph (`retain_graph`), double backward, and a head whose weight is
partitioned outside its own forward (DeepSpeed ZeRO-3, FSDP): the weight is read whole.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

NLL, KL = "nll", "kl"


@dataclass(frozen=True)
class Term:
    """A loss term read at a group's rows: `sum_i weights_i * loss_i` (`weights` `(N,)`, already normalised), entering
    the total loss as `coefficient * term`. `kind`: `nll` or `kl`."""

    name: str
    kind: str
    weights: torch.Tensor
    coefficient: float = 1.0


@dataclass(frozen=True)
class RowGroup:
    """Rows the head reads: hidden states `(N, hidden)`, their labels `(N,)` (valid token ids), the terms read there and,
    for `kl` terms, the teacher's hidden states at the same rows `(N, teacher hidden)`."""

    hidden: torch.Tensor
    labels: torch.Tensor
    terms: tuple[Term, ...]
    teacher_hidden: torch.Tensor | None = None

    def row_coefficients(self, kind: str) -> torch.Tensor | None:
        """`(N,)`: each row's coefficient of `kind`'s loss in the total, summed over the group's terms; None if none."""
        weights = [term.coefficient * term.weights for term in self.terms if term.kind == kind]
        return torch.stack(weights).sum(0) if weights else None


@dataclass(frozen=True)
class _Plan:
    groups: tuple[RowGroup, ...]
    rows_per_chunk: int
    weight_rows_per_piece: int
    compute: torch.dtype
    teacher_weight: torch.Tensor | None
    teacher_compute: torch.dtype | None
    teacher_target: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    weight_needs_grad: bool
    hidden_needs_grad: tuple[bool, ...]


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype `nn.Linear` with this weight computes in here: autocast's (when on, for a float32/16 weight), else the
    weight's own."""
    device = weight.device.type
    if torch.is_autocast_enabled(device) and weight.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The losses' dtype: at least float32 (bf16/fp16 -> float32; float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def _add_weight_gradient(grad_weight: torch.Tensor, grad_logits: torch.Tensor, rows: torch.Tensor, piece: int) -> None:
    """`grad_weight += grad_logits^T @ rows` (`(vocab, hidden)`, `(n, vocab)`, `(n, hidden)`), the matmul in the
    logits' dtype; into a wider `grad_weight` (float32 master weights under autocast) `piece` vocabulary rows at a
    time, so that the product's copy in the logits' dtype stays the size of a piece."""
    if grad_weight.dtype == grad_logits.dtype:
        grad_weight.addmm_(grad_logits.T, rows)
        return
    for start in range(0, grad_weight.shape[0], piece):
        grad_weight[start : start + piece] += grad_logits[:, start : start + piece].T @ rows


class _ChunkedHeadLosses(torch.autograd.Function):
    """`(weight, plan, *hidden) -> (total, values)`: see `chunked_head_losses`."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, plan: _Plan, *hidden: torch.Tensor):
        wide = _wide(plan.compute)
        head = weight.to(plan.compute)
        teacher_head = plan.teacher_weight.to(plan.teacher_compute) if plan.teacher_weight is not None else None
        values = torch.zeros(sum(len(group.terms) for group in plan.groups), dtype=wide, device=weight.device)
        grad_weight = torch.zeros_like(weight) if plan.weight_needs_grad else None
        grad_hidden = []
        term_index = 0
        for group, rows, needs_grad in zip(plan.groups, hidden, plan.hidden_needs_grad):
            nll_rows, kl_rows = group.row_coefficients(NLL), group.row_coefficients(KL)
            trains = (needs_grad or grad_weight is not None) and any(term.coefficient for term in group.terms)
            group_grad = torch.zeros_like(rows) if needs_grad else None
            for start in range(0, rows.shape[0], plan.rows_per_chunk):
                chunk = slice(start, start + plan.rows_per_chunk)
                inputs, labels = rows[chunk].to(plan.compute), group.labels[chunk, None]
                logits = (inputs @ head.T).to(wide)
                log_probs = logits.log_softmax(-1)
                per_kind = {NLL: -log_probs.gather(-1, labels).squeeze(-1)}
                teacher = None
                if kl_rows is not None:
                    teacher_inputs = group.teacher_hidden[chunk].to(plan.teacher_compute)
                    teacher = (teacher_inputs @ teacher_head.T).to(wide).softmax(-1)
                    if plan.teacher_target is not None:
                        teacher = plan.teacher_target(teacher, labels.squeeze(-1))
                    per_kind[KL] = torch.xlogy(teacher, teacher).sum(-1) - (teacher * log_probs).sum(-1)
                for offset, term in enumerate(group.terms):
                    values[term_index + offset] += (term.weights[chunk] * per_kind[term.kind]).sum()
                del log_probs
                if not trains:
                    continue
                # d nll / d logits = p - onehot(label); d kl / d logits = p * sum(teacher) - teacher.
                grad_logits = logits.softmax(-1)  # (a fused kernel: faster than exp of the log-probabilities on CPUs)
                del logits
                scale = nll_rows[chunk] if nll_rows is not None else torch.zeros_like(kl_rows[chunk])
                if teacher is not None:
                    scale = scale + kl_rows[chunk] * teacher.sum(-1)
                    grad_logits.mul_(scale[:, None]).sub_(teacher.mul_(kl_rows[chunk, None]))
                else:
                    grad_logits.mul_(scale[:, None])
                if nll_rows is not None:
                    grad_logits.scatter_add_(-1, labels, -nll_rows[chunk, None])
                del teacher
                grad_logits = grad_logits.to(plan.compute)
                if group_grad is not None:
                    group_grad[chunk] = grad_logits @ head
                if grad_weight is not None:
                    _add_weight_gradient(grad_weight, grad_logits, inputs, plan.weight_rows_per_piece)
            term_index += len(group.terms)
            grad_hidden.append(group_grad)
        coefficients = torch.tensor([term.coefficient for group in plan.groups for term in group.terms], dtype=wide,
                                    device=weight.device)
        ctx.grad_weight, ctx.grad_hidden = grad_weight, grad_hidden
        ctx.mark_non_differentiable(values)
        return (coefficients * values).sum(), values

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, _grad_values: torch.Tensor):
        if ctx.grad_hidden is None:
            raise RuntimeError("the chunked head losses' gradients were already used: backward runs once per forward")
        grad_weight, grad_hidden = ctx.grad_weight, ctx.grad_hidden
        ctx.grad_weight = ctx.grad_hidden = None  # handed to autograd, which may keep them as `.grad` without a copy
        if grad_weight is not None:
            grad_weight.mul_(grad_total.to(grad_weight.dtype))
        scaled = [grad.mul_(grad_total.to(grad.dtype)) if grad is not None else None for grad in grad_hidden]
        return grad_weight, None, *scaled


def _weight(head: nn.Module, hidden_size: int) -> torch.Tensor:
    weight = head.weight
    if getattr(head, "bias", None) is not None:
        raise RuntimeError("chunked_head_losses needs an LM head without bias")
    if weight.dim() != 2 or weight.shape[1] != hidden_size or weight.shape[0] == 0:
        raise RuntimeError(f"the LM head's weight has shape {tuple(weight.shape)}, not (vocab, {hidden_size}): a head "
                           "partitioned outside its forward (ZeRO-3, FSDP) must be gathered for the chunked losses")
    return weight


def chunked_head_losses(
    head: nn.Module,
    groups: list[RowGroup],
    chunk_elements: int,
    teacher_head: nn.Module | None = None,
    teacher_target: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The total loss `sum_t coefficient_t * term_t` over every group's terms, and each term's value.

    head: a bias-free LM head (`.weight` `(vocab, hidden)`); chunk_elements: logits entries formed at once (rows per
    chunk: `chunk_elements // vocab`, at least one); teacher_head: the same for the `kl` terms' teacher;
    teacher_target: `(n, vocab)` teacher probabilities (at least float32) and `(n,)` labels -> the `kl` terms' target
    distribution (default: the teacher's probabilities).
    Returns `(total, {term name: value})`: `total` a 0-dim tensor in at least float32, differentiable w.r.t. every
    group's `hidden` and `head.weight`; the values are detached (for logging)."""
    if not groups:
        raise RuntimeError("chunked_head_losses needs at least one row group")
    weight = _weight(head, groups[0].hidden.shape[-1])
    kl_groups = [group for group in groups if any(term.kind == KL for term in group.terms)]
    if kl_groups and (teacher_head is None or any(group.teacher_hidden is None for group in kl_groups)):
        raise RuntimeError("a kl term needs teacher_head and its group's teacher_hidden")
    teacher_weight = _weight(teacher_head, kl_groups[0].teacher_hidden.shape[-1]) if kl_groups else None
    grad = torch.is_grad_enabled()
    plan = _Plan(
        groups=tuple(groups),
        rows_per_chunk=max(1, chunk_elements // weight.shape[0]),
        weight_rows_per_piece=max(1, chunk_elements // weight.shape[1]),
        compute=compute_dtype(weight),
        teacher_weight=teacher_weight.detach() if teacher_weight is not None else None,
        teacher_compute=compute_dtype(teacher_weight) if teacher_weight is not None else None,
        teacher_target=teacher_target,
        weight_needs_grad=grad and weight.requires_grad,
        hidden_needs_grad=tuple(grad and group.hidden.requires_grad for group in groups),
    )
    with torch.autocast(weight.device.type, enabled=False):  # the dtypes are the plan's
        total, values = _ChunkedHeadLosses.apply(weight, plan, *(group.hidden for group in groups))
    names = [term.name for group in groups for term in group.terms]
    return total, dict(zip(names, values.unbind()))


__all__ = ["KL", "NLL", "RowGroup", "Term", "chunked_head_losses", "compute_dtype"]
