"""D3D training objectives (docs/method.md: Training, and Acceptance-guided progressive layer pruning).

Shapes: diffusion logits `(batch, K, B - 1, vocab)` with block labels `(batch, K, B - 1)`; AR logits
`(batch, S, vocab)` with AR labels `(batch, S)`. Label `-100` marks a position without supervision.
"""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
DFLASH_GAMMA = 7.0  # DFlash's decay for B = 16 (it uses 5 for B = 10 and 4 for B = 8)


def position_weights(num_masked: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """`w_j = exp(-(j - 1) / gamma)` for masked positions `j = 1..num_masked`: shape `(num_masked,)`."""
    return torch.exp(-torch.arange(num_masked, device=device, dtype=torch.float32) / gamma)


def _supervised_weights(block_labels: torch.Tensor, gamma: float) -> torch.Tensor:
    weights = position_weights(block_labels.shape[-1], gamma, block_labels.device)
    return weights * (block_labels != IGNORE_INDEX)


def diffusion_loss(diffusion_logits: torch.Tensor, block_labels: torch.Tensor, gamma: float = DFLASH_GAMMA) -> torch.Tensor:
    """`L_diff = sum_k sum_{j<=b_k} w_j * nll_kj / sum_k sum_{j<=b_k} w_j` over the whole batch."""
    nll = F.cross_entropy(
        diffusion_logits.float().flatten(0, -2), block_labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view_as(block_labels)
    weights = _supervised_weights(block_labels, gamma)
    return (nll * weights).sum() / weights.sum().clamp_min(1e-12)


def ar_loss(ar_logits: torch.Tensor, ar_labels: torch.Tensor) -> torch.Tensor:
    """`L_AR`: mean next-token negative log-likelihood over the supervised (response) positions of the batch.

    `ar_labels[:, i]` is the token that the logits at position `i` should predict (already shifted)."""
    return F.cross_entropy(ar_logits.float().flatten(0, -2), ar_labels.flatten(), ignore_index=IGNORE_INDEX)


def adjust_teacher(teacher_probs: torch.Tensor, labels: torch.Tensor, delta: float = 0.01) -> torch.Tensor:
    """Mix the teacher toward the supervised token by the smallest eta that gives it margin `delta` (Appendix A).

    `q~ = (1 - eta) q0 + eta onehot(y)`, margin `m = q0(y) - max_{v != y} q0(v)`, `eta = max(0, (delta - m) / (1 - m))`.
    teacher_probs: `(..., vocab)`; labels: `(...)` valid token ids. Returns `q~`, same shape as `teacher_probs`."""
    own = teacher_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    others = teacher_probs.scatter(-1, labels.unsqueeze(-1), float("-inf")).amax(dim=-1)
    margin = own - others
    eta = ((delta - margin) / (1 - margin).clamp_min(1e-12)).clamp_min(0.0).unsqueeze(-1)
    return (1 - eta) * teacher_probs + eta * F.one_hot(labels, teacher_probs.shape[-1]).to(teacher_probs.dtype)


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    block_labels: torch.Tensor,
    gamma: float = DFLASH_GAMMA,
    delta: float = 0.01,
) -> torch.Tensor:
    """`L_KL`: forward KL(adjusted teacher || student), position-weighted like `L_diff`, over supervised masked
    positions. Both logits `(batch, K, B - 1, vocab)` from the same blocks and attention pattern."""
    supervised = block_labels != IGNORE_INDEX
    safe_labels = block_labels.clamp_min(0)
    teacher = adjust_teacher(teacher_logits.float().softmax(-1), safe_labels, delta)
    student_log_probs = student_logits.float().log_softmax(-1)
    kl = (teacher * (teacher.clamp_min(1e-30).log() - student_log_probs)).sum(-1)
    weights = _supervised_weights(block_labels, gamma)
    return (kl * weights * supervised).sum() / weights.sum().clamp_min(1e-12)


__all__ = [
    "DFLASH_GAMMA", "IGNORE_INDEX", "adjust_teacher", "ar_loss", "diffusion_loss", "distillation_loss",
    "position_weights",
]
