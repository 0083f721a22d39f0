"""Speculative sampling through `target.generate(do_sample=True, assistant_model=drafter)` draws from the target's
own distribution: a chi-square test against the exact distribution of the first tokens, and proof that the test
fails for a wrong residual and for a drafter whose reported q is not the distribution it sampled from."""

from collections import Counter
from itertools import product

import pytest
import torch
import transformers.generation.utils as generation_utils
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from conftest import tiny_target
from modeling_d3d import D3DBlockDraft, D3DForBlockDiffusion

VOCAB = 8
NEW_TOKENS = 3
SAMPLES = 2500
SETTINGS = dict(temperature=0.7, top_k=5, top_p=0.9)
PROMPT = torch.tensor([[1, 5, 2, 7]])


def processors() -> LogitsProcessorList:
    return LogitsProcessorList(
        [TemperatureLogitsWarper(SETTINGS["temperature"]), TopKLogitsWarper(SETTINGS["top_k"]), TopPLogitsWarper(SETTINGS["top_p"])]
    )


@torch.no_grad()
def exact_distribution(target) -> dict[tuple[int, ...], float]:
    """P(first NEW_TOKENS tokens) under the target with the sampling processors, by enumerating every prefix."""
    distribution = {(): 1.0}
    for _ in range(NEW_TOKENS):
        extended = {}
        for continuation, probability in distribution.items():
            if probability == 0.0:
                continue
            ids = torch.cat([PROMPT, torch.tensor([continuation], dtype=torch.long).reshape(1, -1)], dim=1)
            logits = target(ids).logits[:, -1].float()
            step = processors()(ids, logits).softmax(-1)[0]
            for token in range(VOCAB):
                extended[continuation + (token,)] = probability * step[token].item()
        distribution = extended
    return distribution


def chi_square_p_value(counts: Counter, expected: dict[tuple[int, ...], float], samples: int) -> float:
    """Pearson chi-square p-value; outcomes with fewer than 5 expected draws are pooled into one cell."""
    cells, pooled_expected, pooled_observed = [], 0.0, 0
    for outcome, probability in expected.items():
        if probability * samples >= 5:
            cells.append((counts.get(outcome, 0), probability * samples))
        else:
            pooled_expected += probability * samples
            pooled_observed += counts.get(outcome, 0)
    if pooled_expected > 0:
        cells.append((pooled_observed, pooled_expected))
    unexpected = sum(n for outcome, n in counts.items() if outcome not in expected or expected[outcome] == 0)
    if unexpected:
        return 0.0
    statistic = sum((observed - mean) ** 2 / mean for observed, mean in cells)
    dof = len(cells) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)).item()


def speculative_counts(target, drafter, seed: int = 0) -> Counter:
    torch.manual_seed(seed)
    counts = Counter()
    for _ in range(SAMPLES):
        out = target.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=True, assistant_model=drafter, **SETTINGS)
        counts[tuple(out[0, PROMPT.shape[1] :].tolist())] += 1
    return counts


@pytest.fixture(scope="module")
def models():
    target = tiny_target(11, vocab_size=VOCAB)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(12, vocab_size=VOCAB), block_size=4).eval()
    return target, drafter, exact_distribution(target)


def test_speculative_sampling_matches_the_target_distribution(models):
    target, drafter, expected = models
    counts = speculative_counts(target, drafter)
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3


def test_the_drafts_are_really_being_rejected_and_accepted(models):
    target, drafter, _ = models
    torch.manual_seed(1)
    accepted = []
    for _ in range(200):
        out = target.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=True, assistant_model=drafter, **SETTINGS)
        accepted += drafter.generation_stats.settle(out).accepted_lengths
    assert 1 in accepted and max(accepted) >= 2  # the test above exercises both the residual and acceptance


def test_plain_target_sampling_passes_the_same_test(models):
    target, _, expected = models
    torch.manual_seed(2)
    counts = Counter(
        tuple(target.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=True, **SETTINGS)[0, PROMPT.shape[1] :].tolist())
        for _ in range(SAMPLES)
    )
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3


def resample_from_p_instead_of_the_residual(candidate_input_ids, candidate_logits, candidate_length, new_logits, **_):
    """A wrong acceptance rule: after a rejection it samples from p instead of norm(max(0, p - q))."""
    drafts = candidate_input_ids[0, -candidate_length:]
    positions = torch.arange(candidate_length)
    q = candidate_logits[0].softmax(-1)[positions, drafts]
    p = new_logits[0].softmax(-1)
    keep = torch.rand(candidate_length) <= p[positions, drafts] / q
    accepted = int(keep.long().cumprod(0).sum())
    next_token = torch.multinomial(p[accepted], 1)
    return torch.cat([drafts[:accepted], next_token])[None], accepted


def test_a_wrong_residual_fails_the_test(models, monkeypatch):
    target, drafter, expected = models
    monkeypatch.setattr(generation_utils, "_speculative_sampling", resample_from_p_instead_of_the_residual)
    assert chi_square_p_value(speculative_counts(target, drafter), expected, SAMPLES) < 1e-6


class DrafterReportingRawLogits(D3DForBlockDiffusion):
    """A broken drafter: it samples from the processed distribution but reports the unprocessed logits as q."""

    def draft_block(self, input_ids, past_key_values=None, logits_processor=None, do_sample=False):
        processed = super().draft_block(input_ids, past_key_values, logits_processor, do_sample)
        raw = super().draft_block(input_ids, processed.past_key_values, None, False)
        return D3DBlockDraft(tokens=processed.tokens, logits=raw.logits, past_key_values=processed.past_key_values)


def test_a_q_without_the_logits_processors_fails_the_test(models):
    target, drafter, expected = models
    broken = DrafterReportingRawLogits(drafter.config).eval()
    broken.load_state_dict(drafter.state_dict())
    assert chi_square_p_value(speculative_counts(target, broken), expected, SAMPLES) < 1e-6
