"""The one acceptance routine: greedy matching and rejection sampling, batched over rows, on the device.

Inputs are per round: drafts `(rows, m)` with `num_drafts` `(rows,)` real ones per row (the rest padding), the
target's processed logits `(rows, m + 1, vocab)` over `[anchor, drafts]`, and for sampling the drafter's processed
logits `(rows, m, vocab)` (q = softmax). Both return `accepted` `(rows,)` drafts kept and `tokens` `(rows, m + 1)`:
a row adds `tokens[:accepted + 1]` (its accepted drafts, then the target's token).
"""

import torch


def greedy_accept(drafts: torch.Tensor, num_drafts: torch.Tensor, target_logits: torch.Tensor):
    """Longest prefix of drafts equal to the target's argmax, then the target's own token."""
    choices = target_logits.argmax(-1)
    real = torch.arange(drafts.shape[1], device=drafts.device) < num_drafts[:, None]
    accepted = ((drafts == choices[:, :-1]) & real).long().cumprod(1).sum(1)
    return accepted, choices


def rejection_sample(drafts: torch.Tensor, num_drafts: torch.Tensor, draft_logits: torch.Tensor,
                     target_logits: torch.Tensor, generators: list[torch.Generator | None]):
    """Leviathan et al.: accept draft j with probability min(1, p/q); at the first rejection sample from
    norm(max(0, p - q)); after every real draft is accepted, sample the bonus token from p. One generator per row
    (None: the global one). The tokens are distributed exactly as the target's processed p."""
    rows, m = drafts.shape
    device = target_logits.device
    p = target_logits.softmax(-1)
    q = torch.cat([draft_logits.softmax(-1), draft_logits.new_zeros(rows, 1, draft_logits.shape[-1])], dim=1)
    p_draft = p[:, :m].gather(-1, drafts[..., None])[..., 0]
    q_draft = q[:, :m].gather(-1, drafts[..., None])[..., 0]
    draws = torch.stack([torch.rand(m, generator=g, device=device) for g in generators])
    real = torch.arange(m, device=device) < num_drafts[:, None]
    accepted = ((draws * q_draft < p_draft) & real).long().cumprod(1).sum(1)  # u < p/q: never a token p excludes
    at = accepted[:, None, None].expand(-1, 1, p.shape[-1])
    p_at, q_at = p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]
    residual = (p_at - q_at).clamp(min=0)
    use_residual = (accepted < num_drafts) & (residual.sum(-1) > 0)
    distribution = torch.where(use_residual[:, None], residual, p_at)
    distribution = distribution / distribution.sum(-1, keepdim=True)
    token = torch.cat([torch.multinomial(distribution[r : r + 1], 1, generator=g)[0] for r, g in enumerate(generators)])
    tokens = torch.cat([drafts, drafts.new_zeros(rows, 1)], dim=1)
    tokens.scatter_(1, accepted[:, None], token[:, None])
    return accepted, tokens


__all__ = ["greedy_accept", "rejection_sample"]
