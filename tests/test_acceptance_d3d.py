"""The acceptance routines alone (`acceptance_d3d`), on a toy target and proposal that are Markov chains (each
token's distribution depends on the one before), so that a draft's p depends on the drafts before it: the tokens
emitted over rounds are distributed exactly as the target's, token-wise rejection sampling and block verification
alike, and a wrong residual or a wrong q is caught."""

from collections import Counter

import pytest
import torch
from transformers import (LogitsProcessorList, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
                          MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from distribution import chi_square_p_value
from modeling_d3d.acceptance_d3d import RowProcessors, block_verify, draw, process, rejection_sample

VOCAB, DRAFTS, LENGTH, SAMPLES = 3, 3, 3, 6000


def chains(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probability tables `(VOCAB, VOCAB)` (row: the token before) of the target, the proposal, and another."""
    generator = torch.Generator().manual_seed(seed)
    return tuple((1.5 * torch.randn(VOCAB, VOCAB, generator=generator)).log_softmax(-1) for _ in range(3))


def exact(target: torch.Tensor) -> dict[tuple[int, ...], float]:
    """P(first LENGTH tokens after token 0) under the target chain."""
    distribution = {(): 1.0}
    for _ in range(LENGTH):
        distribution = {seq + (t,): prob * target[seq[-1] if seq else 0, t].exp().item()
                        for seq, prob in distribution.items() for t in range(VOCAB)}
    return distribution


def decode(accept, target, proposal, drafting, seed: int):
    """SAMPLES rows decoded by rounds of up to DRAFTS drafts (drawn from `drafting`, judged against `proposal` as
    q; each row a random number of them per round) until each has LENGTH tokens. Returns the counts of the first
    LENGTH tokens and the mean drafts accepted per round."""
    torch.manual_seed(seed)
    outputs = [[] for _ in range(SAMPLES)]
    accepted_total, rounds = 0, 0
    while any(len(out) < LENGTH for out in outputs):
        last = torch.tensor([out[-1] if out else 0 for out in outputs])
        drafts, previous = [], last
        for _ in range(DRAFTS):
            previous = torch.multinomial(drafting[previous].exp(), 1)[:, 0]
            drafts.append(previous)
        drafts = torch.stack(drafts, dim=1)  # (rows, DRAFTS)
        before = torch.cat([last[:, None], drafts], dim=1)  # the token before each position
        num_drafts = torch.randint(0, DRAFTS + 1, (SAMPLES,))
        accepted, tokens = accept(drafts, num_drafts, proposal[before[:, :-1]], target[before], [None] * SAMPLES)
        for r, out in enumerate(outputs):
            out.extend(tokens[r, : accepted[r] + 1].tolist())
        accepted_total, rounds = accepted_total + accepted.sum().item(), rounds + SAMPLES
    return Counter(tuple(out[:LENGTH]) for out in outputs), accepted_total / rounds


@pytest.mark.parametrize("accept", [rejection_sample, block_verify], ids=["token-wise", "block"])
def test_tokens_over_rounds_follow_the_target_and_a_wrong_q_is_caught(accept):
    target, proposal, other = chains(0)
    counts, _ = decode(accept, target, proposal, proposal, seed=1)
    assert chi_square_p_value(counts, exact(target), SAMPLES) > 1e-3
    counts, _ = decode(accept, target, proposal, other, seed=2)  # drafts not drawn from the q it is told
    assert chi_square_p_value(counts, exact(target), SAMPLES) < 1e-6


def test_after_a_partly_kept_block_the_token_comes_from_the_scaled_residual():
    """One case, many draws: drafts [2, 2]; the first draft's p/q is 1/2, so after keeping it alone the next token
    comes from norm(max(0, p/2 - q)) (tokens 0 and 1 as 2:1), not from the token-wise norm(max(0, p - q)) (4:3):
    the rounds that keep exactly one draft are checked against both."""
    p = torch.tensor([[0.3, 0.45, 0.25], [0.5, 0.45, 0.05], [0.4, 0.4, 0.2]]).log()
    q = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.15, 0.75]]).log()
    drafts = torch.tensor([[2, 2]]).expand(SAMPLES, -1)
    torch.manual_seed(0)
    accepted, tokens = block_verify(drafts, torch.full((SAMPLES,), 2), q.expand(SAMPLES, -1, -1),
                                    p.expand(SAMPLES, -1, -1), [None] * SAMPLES)
    after_one = tokens[accepted == 1, 1]
    assert len(after_one) > 500
    counts = Counter((t,) for t in after_one.tolist())
    for scale, matches in ((0.5, True), (1.0, False)):
        residual = (scale * p[1].exp() - q[1].exp()).clamp(min=0)
        expected = {(t,): v for t, v in enumerate((residual / residual.sum()).tolist()) if v > 0}
        assert (chi_square_p_value(counts, expected, len(after_one)) > 1e-3) == matches, scale


def test_block_verification_keeps_at_least_as_many_drafts_as_token_wise():
    """Sun et al.'s guarantee, in expectation: the same chains, the mean accepted drafts per round (the token-wise
    mean may exceed the block one by noise only: three standard errors of a difference of two means)."""
    target, proposal, _ = chains(4)
    _, token_wise = decode(rejection_sample, target, proposal, proposal, seed=5)
    _, block = decode(block_verify, target, proposal, proposal, seed=6)
    assert block >= token_wise - 3 * (2 * DRAFTS**2 / 4 / SAMPLES) ** 0.5, (block, token_wise)
    greedy_proposal = torch.full_like(proposal, -1e4).scatter(1, proposal.argmax(1, keepdim=True), 0.0)
    counts, _ = decode(block_verify, target, greedy_proposal, greedy_proposal, seed=7)  # one-hot q (argmax drafts)
    assert chi_square_p_value(counts, exact(target), SAMPLES) > 1e-3


@pytest.mark.parametrize("accept", [rejection_sample, block_verify], ids=["token-wise", "block"])
def test_a_round_without_drafts_draws_the_token_from_p(accept):
    p = torch.tensor([0.5, 0.3, 0.2])
    torch.manual_seed(8)
    accepted, tokens = accept(torch.zeros(SAMPLES, 0, dtype=torch.long), torch.zeros(SAMPLES, dtype=torch.long),
                              torch.zeros(SAMPLES, 0, VOCAB), p.log().expand(SAMPLES, 1, -1), [None] * SAMPLES)
    assert tokens.shape == (SAMPLES, 1) and tokens.dtype == torch.long and not accepted.any()
    counts = Counter((t,) for t in tokens[:, 0].tolist())
    assert chi_square_p_value(counts, {(t,): v for t, v in enumerate(p.tolist())}, SAMPLES) > 1e-3


class WidthsSeen(TopPLogitsWarper):
    """A top-p warper that records how many scores per position it was given."""

    def __init__(self, top_p: float):
        super().__init__(top_p)
        self.widths = []

    def __call__(self, input_ids, scores):
        self.widths.append(scores.shape[-1])
        return super().__call__(input_ids, scores)


def test_warpers_after_top_k_see_only_its_tokens_and_give_transformers_scores():
    """A row's processors (`RowProcessors`) run the warpers after a top-k warper (top-p, min-p, temperature) over
    the k scores it keeps, not the whole vocabulary (16 verified columns of a 151k vocabulary: 16 sorts of it), and
    give exactly the scores transformers' own list gives, in any order of the warpers, ties and -inf included; where
    the k + 1 highest scores are not distinct, the whole vocabulary, as transformers does."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(400):
        vocab = int(torch.randint(2, 60, (), generator=generator))
        chain = [TemperatureLogitsWarper(0.1 + 2 * float(torch.rand((), generator=generator))),
                 TopKLogitsWarper(int(torch.randint(1, vocab + 2, (), generator=generator))),
                 TopPLogitsWarper(0.01 + 0.99 * float(torch.rand((), generator=generator)))]
        chain += [MinPLogitsWarper(0.5 * float(torch.rand((), generator=generator)))] if trial % 3 == 0 else []
        chain = chain[::-1] if trial % 5 == 0 else chain
        scores = 3 * torch.randn(int(torch.randint(1, 5, (), generator=generator)), vocab, generator=generator)
        scores = scores.round() if trial % 7 == 0 else scores  # ties
        scores[:, : vocab // 4] = -float("inf") if trial % 11 == 0 else scores[:, : vocab // 4]
        ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
        assert torch.equal(RowProcessors(chain)(ids, scores.clone()), LogitsProcessorList(chain)(ids, scores.clone()))

    top_p = WidthsSeen(0.9)
    processors = RowProcessors([TemperatureLogitsWarper(0.6), TopKLogitsWarper(20), top_p])
    distinct = torch.randn(16, 4096, generator=generator)
    assert torch.equal(processors(None, distinct.clone()), LogitsProcessorList(processors)(None, distinct.clone()))
    tied = distinct.clone()
    tied[3, tied[3].topk(2).indices] = tied[3].max()
    processors(None, tied)
    assert top_p.widths == [20, 4096, 4096]  # transformers' list, then the tie


@pytest.mark.parametrize("rule", ["min_new_tokens", "min_length"])
def test_a_length_rule_past_its_length_leaves_the_rest_batched_and_scores_as_transformers_gives(rule):
    """`process` over a row's verified columns: while `min_new_tokens` (or `min_length`) masks EOS at some of them,
    every position with its own context, as transformers' list gives it; once the rule is past the shortest context,
    its other processors (context-free) in one call for every position (a call per verified column cost 0.2 ms on
    a CPU), with the same scores."""
    eos, prompt, vocab = 3, 5, 40
    rules = {"min_new_tokens": MinNewTokensLengthLogitsProcessor(prompt, 4, eos),
             "min_length": MinLengthLogitsProcessor(prompt + 4, eos)}
    scores = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    drafts = torch.arange(10, 16)
    for length, calls in ((prompt + 2, 6), (prompt + 4, 1), (prompt + 9, 1)):  # EOS masked at 2 columns, 0, 0
        top_p = WidthsSeen(1.0)  # a context-free processor that records its calls (and masks nothing)
        processors = RowProcessors([rules[rule], top_p])
        context = list(range(length))
        output = process(processors, context, scores, drafts)
        expected = torch.cat([LogitsProcessorList([rules[rule], TopPLogitsWarper(1.0)])(
            torch.tensor([context + drafts[:j].tolist()]), scores[j : j + 1].clone()) for j in range(6)])
        assert torch.equal(output, expected) and len(top_p.widths) == calls, (length, top_p.widths)
        assert output[:, eos].isinf().sum() == max(prompt + 4 - length, 0)


def test_draws_follow_each_rows_weights_with_its_own_generator():
    """`draw` (the engine's sampler: one uniform per row into its cumulative weights) picks each token with
    probability proportional to its weight, never a zero-weight one (first, last, between), for rows of unnormalised
    weights; a row's draws depend on its own generator only."""
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0, 0.0, 1.5], [0.0] * 5 + [3.0]])
    generators = [torch.Generator().manual_seed(seed) for seed in (1, 2, 3)]
    samples = torch.stack([draw(weights, generators) for _ in range(4000)])  # (4000, rows)
    for row in range(weights.shape[0]):
        counts = Counter((token,) for token in samples[:, row].tolist())
        assert {token for token, in counts} <= set(weights[row].nonzero()[:, 0].tolist())
        if row < 2:
            expected = {(token,): (weight / weights[row].sum()).item() for token, weight in enumerate(weights[row])}
            assert chi_square_p_value(counts, expected, len(samples)) > 1e-3
    alone = draw(weights[1:2], [torch.Generator().manual_seed(2)])
    assert torch.equal(alone, draw(weights, [torch.Generator().manual_seed(seed) for seed in (9, 2, 9)])[1:2])


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [float("nan"), 1.0, 1.0]], ids=["zeros", "nan"])
def test_a_draw_from_a_distribution_without_mass_gives_a_token_outside_the_vocabulary(row):
    """A row whose processors left no token (or whose logits were NaN) gets the token `vocab`, never a token picked
    silently (the engine ends that row with an error), on any device; the other rows are drawn as ever."""
    weights = torch.tensor([[0.2, 0.3, 0.5], row, [0.0, 0.0, 1.0]])
    assert draw(weights, [None, None, None]).tolist()[1:] == [3, 2]


@pytest.mark.parametrize("verify", [rejection_sample, block_verify], ids=["token", "block"])
@pytest.mark.parametrize("bad", ["zero", "nan"])
def test_a_draft_to_which_q_gives_nothing_is_never_kept_and_the_next_token_follows_p(verify, bad):
    """A draft that q gives no probability (the drafter's processed logits left it -inf, or were NaN) was not drawn
    from q: p / q would keep it every time. Verification stops before it: the drafts before it are judged as usual,
    and at its position the token follows p. Fails when the row's drafts are all judged (the old code)."""
    p = torch.tensor([0.1, 0.6, 0.3]).log()
    q = torch.tensor([0.5, 0.25, 0.25]).log()
    unusable = torch.tensor([0.0, float("-inf"), 0.0] if bad == "zero" else [float("nan")] * 3)
    drafts = torch.tensor([[0, 1, 2]])  # the second draft: q gives it nothing
    draft_logits = torch.stack([q, unusable, q])[None]
    target_logits = p.expand(1, 4, 3)
    generators = [torch.Generator().manual_seed(5)]
    kept, after_first = Counter(), Counter()
    for _ in range(4000):
        accepted, tokens = verify(drafts, torch.tensor([3]), draft_logits, target_logits, generators)
        kept[accepted.item()] += 1
        if accepted.item() == 1:
            after_first[(tokens[0, 1].item(),)] += 1
    assert set(kept) == {0, 1} and kept[1] > 0
    expected = {(token,): prob.item() for token, prob in enumerate(p.exp())}
    assert chi_square_p_value(after_first, expected, sum(after_first.values())) > 1e-3


