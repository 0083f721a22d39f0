"""Speculative sampling through `target.generate(do_sample=True, assistant_model=drafter)` draws from the target's
own distribution: a chi-square test against the exact distribution of the first tokens, and proof that the test
fails for a wrong residual and for a drafter whose reported q is not the distribution it sampled from."""

from collections import Counter

import pytest
import torch
import transformers.generation.utils as generation_utils

from conftest import tiny_target
from distribution import BROKEN_SAMPLES, NEW_TOKENS, PROMPT, SAMPLES, SETTINGS, VOCAB, chi_square_p_value, exact_distribution, sampled_counts
from modeling_d3d import BlockSource, D3DAssistant, D3DForBlockDiffusion
from modeling_d3d.passes_d3d import run_pass
from modeling_d3d.sources_d3d import block_pass_layout


@pytest.fixture(scope="module")
def models():
    target = tiny_target(11, vocab_size=VOCAB)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(12, vocab_size=VOCAB), block_size=4).eval()
    return target, drafter, exact_distribution(target)


def speculative_counts(target, drafter, samples: int = SAMPLES) -> Counter:
    return sampled_counts(target, seed=0, samples=samples, assistant_model=drafter)


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
        accepted += [len(o.added) for outcomes, _ in drafter.settle(out).history for o in outcomes]
    assert 1 in accepted and max(accepted) >= 2  # the test above exercises both the residual and acceptance


def test_plain_target_sampling_passes_the_same_test(models):
    target, _, expected = models
    counts = sampled_counts(target, seed=2, rows=SAMPLES)
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3


def resample_from_p_instead_of_the_residual(candidate_input_ids, candidate_logits, candidate_length, new_logits,
                                            *_, **__):
    """A wrong acceptance rule: after a rejection it samples from p instead of norm(max(0, p - q)). It takes what
    else transformers passes (5.17: `is_done_candidate` positionally) and ignores it."""
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
    assert chi_square_p_value(speculative_counts(target, drafter, BROKEN_SAMPLES), expected, BROKEN_SAMPLES) < 1e-6


class SourceReportingRawLogits(BlockSource):
    """A broken source: it samples its drafts from the processed distribution but reports the unprocessed logits
    (a second block pass from the same cache) as q."""

    def propose(self, contexts, sampling):
        proposal = super().propose(contexts, sampling)
        layout = block_pass_layout(contexts, self.committed[: len(contexts)], self.block_size, self.drafter.config.mask_token_id)
        proposal.logits = run_pass(self.drafter, self.cache, layout, self.block_size - 1)
        return proposal


def test_a_q_without_the_logits_processors_fails_the_test(models):
    target, drafter, expected = models
    with D3DAssistant(SourceReportingRawLogits(drafter)) as broken:
        assert chi_square_p_value(speculative_counts(target, broken, BROKEN_SAMPLES), expected, BROKEN_SAMPLES) < 1e-6


def test_the_same_adapter_with_an_honest_source_passes_the_test(models):
    target, drafter, expected = models
    with D3DAssistant(BlockSource(drafter)) as honest:
        assert chi_square_p_value(speculative_counts(target, honest), expected, SAMPLES) > 1e-3
