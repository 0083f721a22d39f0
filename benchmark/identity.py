"""What a method's output that differs from the target's own greedy output means. In float32 identity is checked
exactly: any difference fails. In bfloat16 (or float16), verifying several tokens in one pass rounds differently from
one-token steps, so where the target's own two best tokens nearly tie the pick can flip, for every speculative method:
such a mismatch is a near-tie (reported, not a failure); any other is a divergence (a failure)."""

import torch

# Top-2 logit margin, relative to the top logit, under which a flip is rounding: 8 bfloat16 roundings (2^-8 each).
NEAR_TIE = 2**-5
CANDIDATES = 8  # the best tokens of the low-precision logits whose logits are recomputed in float32


def checks_exactly(target) -> bool:
    """Whether `target`'s outputs are compared token for token (float32) rather than up to near-ties."""
    return target.dtype == torch.float32


def top2_margin(logits: torch.Tensor) -> tuple[list[int], float]:
    """The two best entries of `logits` `(vocab,)` (indices) and their gap relative to the best logit (at least 1 in
    magnitude): what `NEAR_TIE` is compared with."""
    best = logits.topk(2)
    return best.indices.tolist(), float(best.values[0] - best.values[1]) / max(1.0, float(best.values[0].abs()))


@torch.no_grad()
def top2_in_float32(target, ids: list[int]) -> tuple[list[int], float]:
    """The target's two best next tokens after `ids` and their margin relative to the best logit: the logits of its
    best candidates recomputed in float32 from its last hidden state `(hidden,)` and its output layer's rows."""
    inputs = torch.tensor([ids], device=target.device)
    hidden = target.get_decoder()(input_ids=inputs).last_hidden_state[0, -1]
    head = target.get_output_embeddings()
    candidates = head(hidden).topk(min(CANDIDATES, head.weight.shape[0])).indices
    logits = head.weight[candidates].float() @ hidden.float()
    if head.bias is not None:
        logits += head.bias[candidates].float()
    top2, margin = top2_margin(logits)
    return candidates[top2].tolist(), margin


def classify(target, prompts: list[torch.Tensor], reference: list[list[int]], outputs: list[list[int]],
             either_order: bool = False) -> dict:
    """Counts of `outputs` (one per prompt `(1, L)`) against the target's `reference`: identical, near-ties (the
    first differing token is the target's runner-up at a near-tie) and divergences (any other difference, and every
    difference when `checks_exactly(target)`). `either_order`: `reference` is another engine's greedy output (vLLM
    alone), not `target`'s own, so at a near-tie either of the two tokens may be `target`'s best."""
    counts = {"identical": 0, "near_ties": 0, "divergences": 0}
    for prompt, expected, got in zip(prompts, reference, outputs):
        if expected == got:
            counts["identical"] += 1
            continue
        first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        near_tie = False
        if first is not None and not checks_exactly(target):
            top2, margin = top2_in_float32(target, prompt[0].tolist() + expected[:first])
            pair = [expected[first], got[first]]
            near_tie = margin <= NEAR_TIE and (top2 == pair or (either_order and top2 == pair[::-1]))
        counts["near_ties" if near_tie else "divergences"] += 1
    return counts


__all__ = ["CANDIDATES", "NEAR_TIE", "checks_exactly", "classify", "top2_in_float32", "top2_margin"]
