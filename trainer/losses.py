"""D3D training objectives (docs/method.md: Training, and Acceptance-guided progressive layer pruning), read from
hidden states.

Each loss takes the drafter's final hidden states and its LM head, and forms logits only at the positions it
supervises: `L_AR` at response positions, `L_diff` and `L_KL` at supervised masked positions. Those hidden states
are gathered first, then `d3d.trainer.chunked_head` runs the head on `chunk_elements // vocab` of them at a time and
forms each chunk's gradients in the forward pass, so no `(positions, vocab)` float32 matrix is ever whole, forward or
backward, and nothing is recomputed. `training_losses` reads every term in one pass (`L_diff` and `L_KL` from the
same logits).

Shapes: diffusion hidden states `(batch, K, B - 1, hidden)` with block labels `(batch, K, B - 1)`; AR hidden states
`(batch, S, hidden)` with AR labels `(batch, S)`. Label `-100` marks a position without supervision.
"""

from functools import partial

import torch
from torch import nn

from .chunked_head import KL, NLL, RowGroup, Term, chunked_head_losses

IGNORE_INDEX = -100
DFLASH_GAMMA = 7.0  # DFlash's decay for B = 16 (it uses 5 for B = 10 and 4 for B = 8)
LOGITS_CHUNK_ELEMENTS = 2**26  # logits entries per chunk: 256 MB in float32 (441 positions at Qwen3's 151,936)


def position_weights(
    num_masked: int, gamma: float, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`w_j = exp(-(j - 1) / gamma)` for masked positions `j = 1..num_masked`: shape `(num_masked,)`."""
    return torch.exp(-torch.arange(num_masked, device=device, dtype=dtype) / gamma)


def _ar_group(hidden: torch.Tensor, ar_labels: torch.Tensor, ar_weight: float) -> RowGroup:
    """The response positions: `L_AR` is the mean NLL over them. hidden `(batch, S, hidden)`, ar_labels `(batch, S)`."""
    supervised = ar_labels != IGNORE_INDEX
    labels = ar_labels[supervised]
    weights = torch.full(labels.shape, 1 / max(labels.numel(), 1), device=labels.device,
                         dtype=torch.promote_types(hidden.dtype, torch.float32))
    return RowGroup(hidden[supervised], labels, (Term("ar", NLL, weights, ar_weight),))


def _masked_group(hidden: torch.Tensor, block_labels: torch.Tensor, gamma: float, terms: dict[str, str],
                  teacher_hidden: torch.Tensor | None = None) -> RowGroup:
    """The supervised masked positions, each term (`{name: kind}`) weighted `w_j / sum w`. hidden `(batch, K, B - 1,
    hidden)`, block_labels `(batch, K, B - 1)`."""
    supervised = block_labels != IGNORE_INDEX
    weights = position_weights(block_labels.shape[-1], gamma, block_labels.device,
                               torch.promote_types(hidden.dtype, torch.float32))
    weights = weights.expand(block_labels.shape)[supervised]
    weights = weights / weights.sum().clamp_min(1e-12)
    return RowGroup(hidden[supervised], block_labels[supervised],
                    tuple(Term(name, kind, weights) for name, kind in terms.items()),
                    teacher_hidden[supervised] if teacher_hidden is not None else None)


def diffusion_loss(
    hidden: torch.Tensor, head: nn.Module, block_labels: torch.Tensor, gamma: float = DFLASH_GAMMA,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """`L_diff = sum_k sum_{j<=b_k} w_j * nll_kj / sum_k sum_{j<=b_k} w_j` over the whole batch.

    hidden: `(batch, K, B - 1, hidden)` final hidden states of the masked positions; block_labels: `(batch, K, B - 1)`."""
    group = _masked_group(hidden, block_labels, gamma, {"diffusion": NLL})
    return chunked_head_losses(head, [group], chunk_elements)[0]


def ar_loss(
    hidden: torch.Tensor, head: nn.Module, ar_labels: torch.Tensor, chunk_elements: int = LOGITS_CHUNK_ELEMENTS
) -> torch.Tensor:
    """`L_AR`: mean next-token negative log-likelihood over the supervised (response) positions of the batch.

    hidden: `(batch, S, hidden)`; `ar_labels[:, i]` is the token that position `i` should predict (already shifted)."""
    return chunked_head_losses(head, [_ar_group(hidden, ar_labels, 1.0)], chunk_elements)[0]


def adjust_teacher(teacher_probs: torch.Tensor, labels: torch.Tensor, delta: float = 0.01) -> torch.Tensor:
    """Mix the teacher toward the supervised token by the smallest eta that gives it margin `delta` (Appendix A).

    `q~ = (1 - eta) q0 + eta onehot(y)`, margin `m = q0(y) - max_{v != y} q0(v)`, `eta = max(0, (delta - m) / (1 - m))`.
    teacher_probs: `(..., vocab)`; labels: `(...)` valid token ids. Returns `q~`, same shape as `teacher_probs` (one new
    tensor of that size: no one-hot or masked copy is formed)."""
    labels = labels.unsqueeze(-1)
    own = teacher_probs.gather(-1, labels).squeeze(-1)
    top = teacher_probs.topk(2, dim=-1)
    others = torch.where(top.indices[..., 0] == labels[..., 0], top.values[..., 1], top.values[..., 0])
    margin = own - others
    eta = ((delta - margin) / (1 - margin).clamp_min(1e-12)).clamp_min(0.0).unsqueeze(-1)
    return (teacher_probs * (1 - eta)).scatter_add_(-1, labels, eta)


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
    group = _masked_group(hidden, block_labels, gamma, {"kl": KL}, teacher_hidden)
    return chunked_head_losses(head, [group], chunk_elements, teacher_head,
                               partial(adjust_teacher, delta=delta))[0]


def training_losses(
    ar_hidden: torch.Tensor,
    diffusion_hidden: torch.Tensor,
    head: nn.Module,
    ar_labels: torch.Tensor,
    block_labels: torch.Tensor,
    gamma: float = DFLASH_GAMMA,
    ar_weight: float = 1.0,
    teacher_hidden: torch.Tensor | None = None,
    teacher_head: nn.Module | None = None,
    kl_margin: float = 0.01,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
) -> dict[str, torch.Tensor]:
    """`L_train = L_diff + ar_weight * L_AR` (`+ L_KL` with `teacher_hidden`) in one pass over the head.

    Shapes as in `ar_loss`, `diffusion_loss` and `distillation_loss`. Returns `loss` (differentiable w.r.t. the hidden
    states and `head.weight`) and the terms `diffusion`, `ar` and, with a teacher, `kl` (detached, for logging)."""
    terms = {"diffusion": NLL} | ({"kl": KL} if teacher_hidden is not None else {})
    groups = [_ar_group(ar_hidden, ar_labels, ar_weight), _masked_group(diffusion_hidden, block_labels, gamma, terms,
                                                                        teacher_hidden)]
    total, values = chunked_head_losses(head, groups, chunk_elements, teacher_head,
                                        partial(adjust_teacher, delta=kl_margin))
    return {"loss": total, **values}


__all__ = [
    "DFLASH_GAMMA", "IGNORE_INDEX", "LOGITS_CHUNK_ELEMENTS", "adjust_teacher", "ar_loss", "diffusion_loss",
    "distillation_loss", "position_weights", "training_losses",
]
