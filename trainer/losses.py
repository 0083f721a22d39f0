"""D3D training objectives (docs/method.md: Training, and Acceptance-guided progressive layer pruning), read from
hidden states.

Each loss takes the drafter's final hidden states and its LM head, and forms logits only at the positions it
supervises: `L_AR` at response positions, `L_diff` and `L_KL` at supervised masked positions. Those hidden states
are gathered first, then the head runs `rows_per_chunk` of them at a time, each chunk recomputed in backward
(activation checkpointing), so no `(positions, vocab)` float32 matrix is ever whole, forward or backward.

Shapes: diffusion hidden states `(batch, K, B - 1, hidden)` with block labels `(batch, K, B - 1)`; AR hidden states
`(batch, S, hidden)` with AR labels `(batch, S)`. Label `-100` marks a position without supervision.
"""

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
DFLASH_GAMMA = 7.0  # DFlash's decay for B = 16 (it uses 5 for B = 10 and 4 for B = 8)
LOGITS_CHUNK_ELEMENTS = 2**26  # logits entries per chunk: 256 MB in float32 (441 positions at Qwen3's 151,936)


def position_weights(
    num_masked: int, gamma: float, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`w_j = exp(-(j - 1) / gamma)` for masked positions `j = 1..num_masked`: shape `(num_masked,)`."""
    return torch.exp(-torch.arange(num_masked, device=device, dtype=dtype) / gamma)


def rows_per_chunk(head: nn.Module, chunk_elements: int = LOGITS_CHUNK_ELEMENTS) -> int:
    """Positions whose logits fit `chunk_elements` entries under `head` (an `nn.Linear` to the vocabulary)."""
    return max(1, chunk_elements // head.weight.shape[0])


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The losses' dtype: at least float32 (bf16/fp16 -> float32; float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def _loss_dtype(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(_wide(logits.dtype))


def _weighted_chunk(term: Callable, head: nn.Module, hidden: torch.Tensor, weights: torch.Tensor, *per_row) -> torch.Tensor:
    return (term(_loss_dtype(head(hidden)), *per_row) * weights).sum()


def weighted_head_sum(
    term: Callable, hidden: torch.Tensor, head: nn.Module, weights: torch.Tensor, *per_row: torch.Tensor, rows: int
) -> torch.Tensor:
    """`sum_i weights_i * term(head(hidden_i), *per_row_i)`, `rows` positions at a time.

    term: `(n, vocab)` logits (float32 or wider), then the `(n, ...)` slices of `per_row` -> `(n,)`.
    hidden: `(N, hidden)`; weights: `(N,)`. With more than one chunk each is checkpointed: its logits are freed after
    the forward and recomputed, one chunk at a time, in backward."""
    if hidden.shape[0] <= rows:
        return _weighted_chunk(term, head, hidden, weights, *per_row)
    total = 0
    for start in range(0, hidden.shape[0], rows):
        chunk = slice(start, start + rows)
        total = total + checkpoint(
            _weighted_chunk, term, head, hidden[chunk], weights[chunk], *(t[chunk] for t in per_row), use_reentrant=False
        )
    return total


def _nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction="none")


def _supervised_masked(hidden: torch.Tensor, block_labels: torch.Tensor, gamma: float):
    """The supervised masked positions: their hidden states `(N, hidden)`, labels `(N,)` and weights `w_j` `(N,)`."""
    supervised = block_labels != IGNORE_INDEX
    weights = position_weights(block_labels.shape[-1], gamma, block_labels.device, _wide(hidden.dtype))
    weights = weights.expand(block_labels.shape)
    return hidden[supervised], block_labels[supervised], weights[supervised]


def diffusion_loss(
    hidden: torch.Tensor, head: nn.Module, block_labels: torch.Tensor, gamma: float = DFLASH_GAMMA,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """`L_diff = sum_k sum_{j<=b_k} w_j * nll_kj / sum_k sum_{j<=b_k} w_j` over the whole batch.

    hidden: `(batch, K, B - 1, hidden)` final hidden states of the masked positions; block_labels: `(batch, K, B - 1)`."""
    rows, labels, weights = _supervised_masked(hidden, block_labels, gamma)
    total = weighted_head_sum(_nll, rows, head, weights, labels, rows=rows_per_chunk(head, chunk_elements))
    return total / weights.sum().clamp_min(1e-12)


def ar_loss(
    hidden: torch.Tensor, head: nn.Module, ar_labels: torch.Tensor, chunk_elements: int = LOGITS_CHUNK_ELEMENTS
) -> torch.Tensor:
    """`L_AR`: mean next-token negative log-likelihood over the supervised (response) positions of the batch.

    hidden: `(batch, S, hidden)`; `ar_labels[:, i]` is the token that position `i` should predict (already shifted)."""
    supervised = ar_labels != IGNORE_INDEX
    labels = ar_labels[supervised]
    weights = torch.ones(labels.shape, device=labels.device, dtype=_wide(hidden.dtype))
    total = weighted_head_sum(_nll, hidden[supervised], head, weights, labels, rows=rows_per_chunk(head, chunk_elements))
    return total / weights.sum().clamp_min(1)


def adjust_teacher(teacher_probs: torch.Tensor, labels: torch.Tensor, delta: float = 0.01) -> torch.Tensor:
    """Mix the teacher toward the supervised token by the smallest eta that gives it margin `delta` (Appendix A).

    `q~ = (1 - eta) q0 + eta onehot(y)`, margin `m = q0(y) - max_{v != y} q0(v)`, `eta = max(0, (delta - m) / (1 - m))`.
    teacher_probs: `(..., vocab)`; labels: `(...)` valid token ids. Returns `q~`, same shape as `teacher_probs`."""
    own = teacher_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    others = teacher_probs.scatter(-1, labels.unsqueeze(-1), float("-inf")).amax(dim=-1)
    margin = own - others
    eta = ((delta - margin) / (1 - margin).clamp_min(1e-12)).clamp_min(0.0).unsqueeze(-1)
    return (1 - eta) * teacher_probs + eta * F.one_hot(labels, teacher_probs.shape[-1]).to(teacher_probs.dtype)


def _adjusted_teacher_kl(
    student_logits: torch.Tensor, teacher_hidden: torch.Tensor, labels: torch.Tensor, teacher_head: nn.Module, delta: float
) -> torch.Tensor:
    """Forward KL(adjusted teacher || student) per row: `(n, vocab)` student logits, `(n, hidden)` teacher states."""
    with torch.no_grad():
        teacher = adjust_teacher(_loss_dtype(teacher_head(teacher_hidden)).softmax(-1), labels, delta)
    return (teacher * (teacher.clamp_min(1e-30).log() - student_logits.log_softmax(-1))).sum(-1)


def distillation_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    teacher_hidden: torch.Tensor,
    teacher_head: nn.Module,
    block_labels: torch.Tensor,
    gamma: float = DFLASH_GAMMA,
    delta: float = 0.01,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """`L_KL`: forward KL(adjusted teacher || student), position-weighted like `L_diff`, over supervised masked
    positions. Student and teacher hidden states `(batch, K, B - 1, hidden)` from the same blocks and attention
    pattern; each model's head forms its logits, chunk by chunk (the teacher's without gradient)."""
    rows, labels, weights = _supervised_masked(hidden, block_labels, gamma)
    teacher_rows = teacher_hidden[block_labels != IGNORE_INDEX]
    term = partial(_adjusted_teacher_kl, teacher_head=teacher_head, delta=delta)
    total = weighted_head_sum(term, rows, head, weights, teacher_rows, labels, rows=rows_per_chunk(head, chunk_elements))
    return total / weights.sum().clamp_min(1e-12)


__all__ = [
    "DFLASH_GAMMA", "IGNORE_INDEX", "LOGITS_CHUNK_ELEMENTS", "adjust_teacher", "ar_loss", "diffusion_loss",
    "distillation_loss", "position_weights", "rows_per_chunk", "weighted_head_sum",
]
