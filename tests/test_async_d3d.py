"""Asynchronous D3D: packed successor drafting and `D3DAssistedGenerator` through `target.generate`."""

import itertools
import threading

import pytest
import torch

from conftest import always_predicts, tiny_target
from distribution import SAMPLES, VOCAB, chi_square_p_value, exact_distribution, sampled_counts
from modeling_d3d import D3DAssistedGenerator, D3DForBlockDiffusion


def pair(target_seed: int, drafter_seed: int, block_size: int, vocab_size: int):
    target = tiny_target(target_seed, vocab_size=vocab_size)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(drafter_seed, vocab_size=vocab_size), block_size=block_size)
    return target, drafter.eval()


@pytest.mark.parametrize("block_size,coverage,fanout", [(5, 4, 2), (4, 4, 3), (6, 1, 2), (4, 3, 0), (3, 2, 1)])
def test_each_branch_equals_block_drafting_from_its_own_prefix(block_size, coverage, fanout):
    _, drafter = pair(0, 3, block_size, 96)
    prefix = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(block_size))
    draft = drafter.draft_block(prefix)
    branches = drafter.draft_successors(prefix, draft.tokens, draft.logits, draft.past_key_values, coverage, fanout)
    drafted = block_size - 1
    assert len(branches) == min(coverage - 1, drafted) * fanout + 1
    assert sum(b.tokens.shape[1] + 1 for b in branches) <= block_size * ((coverage - 1) * fanout + 2)
    assert draft.past_key_values.get_seq_length() == prefix.shape[1] + drafted
    for branch in branches[:-1]:
        j = len(branch.key) - 1
        assert list(branch.key[:j]) == draft.tokens[0, :j].tolist() and branch.key[j] != draft.tokens[0, j].item()
        alone = drafter.draft_block(torch.cat([prefix, torch.tensor([branch.key])], dim=1))
        assert torch.equal(branch.tokens, alone.tokens)
        torch.testing.assert_close(branch.logits, alone.logits, atol=1e-4, rtol=0)
    full = branches[-1]
    alone = drafter.draft_block(torch.cat([prefix, draft.tokens], dim=1))
    assert full.key == tuple(draft.tokens[0].tolist()) + (alone.tokens[0, 0].item(),)
    assert torch.equal(full.tokens, alone.tokens[:, 1:])
    torch.testing.assert_close(full.logits, alone.logits[:, 1:], atol=1e-4, rtol=0)


def test_alternative_anchors_are_the_next_most_probable_drafter_tokens():
    _, drafter = pair(0, 3, 5, 96)
    prefix = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    draft = drafter.draft_block(prefix)
    branches = drafter.draft_successors(prefix, draft.tokens, draft.logits, draft.past_key_values, coverage=3, fanout=2)
    for j in range(2):
        ranks = draft.logits[0, j].argsort(descending=True).tolist()
        assert ranks[0] == draft.tokens[0, j].item()
        assert [b.key[-1] for b in branches if len(b.key) == j + 1] == ranks[1:3]


def test_greedy_output_is_token_identical_through_the_generator():
    generator_seed = torch.Generator().manual_seed(0)
    compared, hits = 0, 0
    for (vocab, block, coverage, fanout), seed in itertools.product(
        [(6, 4, 4, 2), (8, 16, 12, 2), (12, 5, 2, 3), (96, 3, 3, 1), (6, 4, 1, 2), (8, 5, 3, 0)], [0, 1]
    ):  # includes C=1 (full-acceptance branch only) and F=0
        target, drafter = pair(seed, seed, block, vocab)
        with D3DAssistedGenerator(drafter, coverage=coverage, fanout=fanout) as generator:
            for prompt_length, max_new in itertools.product([1, block + 1, 2 * block + 3], [2, 9, 33]):
                prompt = torch.randint(0, vocab, (1, prompt_length), generator=generator_seed)
                reference = target.generate(prompt, max_new_tokens=max_new, do_sample=False)
                speculative = target.generate(prompt, max_new_tokens=max_new, do_sample=False, assistant_model=generator)
                assert torch.equal(reference, speculative), (vocab, block, coverage, fanout, prompt_length, max_new)
                stats = generator.generation_stats.settle(speculative)
                assert stats.new_tokens == max_new or speculative.shape[1] - prompt.shape[1] == stats.new_tokens
                hits += stats.cache_hits
                compared += 1
    assert compared >= 50 and hits > 0


def test_eos_and_a_drafter_in_another_dtype_through_the_generator():
    eos, stopped_early = 2, 0
    for seed in range(4):
        target, drafter = pair(seed, seed, 5, 6)
        with drafter.to(torch.bfloat16).async_generator(coverage=3, fanout=2) as generator:
            for length in (1, 4, 11):
                prompt = torch.randint(0, 6, (1, length), generator=torch.Generator().manual_seed(length))
                kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=eos)
                reference = target.generate(prompt, **kwargs)
                assert torch.equal(reference, target.generate(prompt, assistant_model=generator, **kwargs))
                stopped_early += int(reference.shape[1] < length + 30)
    assert stopped_early > 0


def test_a_drafter_that_always_agrees_is_served_from_the_cache_every_round():
    target, drafter = pair(0, 1, 4, 96)
    always_predicts(target, 7)
    always_predicts(drafter, 7)
    with drafter.async_generator(coverage=4, fanout=2) as generator:
        prompt = torch.tensor([[1, 2, 3]])
        out = target.generate(prompt, max_new_tokens=4 + 3 * 5, do_sample=False, assistant_model=generator)
        stats = generator.generation_stats.settle(out)
    assert torch.equal(out, target.generate(prompt, max_new_tokens=19, do_sample=False))
    # first round drafts B-1 = 3; every later round reuses the full-acceptance branch (B-2 = 2 drafts + bonus)
    assert stats.accepted_lengths == [4, 3, 3, 3, 3, 3]
    assert [r.from_cache for r in stats.rounds_drafted] == [False] + [True] * 5
    assert stats.hit_rate == 1.0 and stats.cache_hits == 5 and stats.budget_tokens == 4 * (3 * 2 + 2)


def test_a_drafter_that_is_always_wrong_misses_and_drafts_synchronously():
    target, drafter = pair(0, 1, 4, 96)
    always_predicts(target, 7)
    always_predicts(drafter, 8)
    with drafter.async_generator(coverage=4, fanout=0) as generator:
        out = target.generate(torch.tensor([[5]]), max_new_tokens=6, do_sample=False, assistant_model=generator)
        stats = generator.generation_stats.settle(out)
    assert stats.tau == 1.0 and stats.cache_hits == 0 and stats.hit_rate == 0.0


def test_async_sampling_matches_the_target_distribution():
    target = tiny_target(11, vocab_size=VOCAB)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(12, vocab_size=VOCAB), block_size=2).eval()
    hits = []

    class CountingGenerator(D3DAssistedGenerator):
        def _round(self, session, input_ids, max_new_tokens):
            output = super()._round(session, input_ids, max_new_tokens)
            hits.append(session.stats.rounds_drafted[-1].from_cache)
            return output

    # fanout VOCAB - 1: every rejection outcome has a prepared branch, so many rounds are served from the cache
    with CountingGenerator(drafter, coverage=2, fanout=VOCAB - 1) as generator:
        counts = sampled_counts(target, seed=3, assistant_model=generator)
    assert sum(hits) > 300
    assert chi_square_p_value(counts, exact_distribution(target), SAMPLES) > 1e-3


class FailingDrafter(D3DForBlockDiffusion):
    """A drafter whose packed successor pass fails on its `fail_at`-th call."""

    fail_at = 3

    def draft_successors(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.fail_at:
            raise RuntimeError("drafter device lost")
        return super().draft_successors(*args, **kwargs)


def failing_pair():
    target, drafter = pair(0, 0, 4, 6)
    failing = FailingDrafter(drafter.config).eval()
    failing.load_state_dict(drafter.state_dict())
    return target, failing


def test_a_worker_exception_reaches_the_caller_and_the_generator_recovers():
    target, drafter = failing_pair()
    prompt = torch.tensor([[1, 2, 3]])
    with drafter.async_generator(coverage=3, fanout=2) as generator:
        result: dict = {}

        def call():
            try:
                target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=generator)
            except RuntimeError as error:
                result["error"] = error

        thread = threading.Thread(target=call)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), "generate hung after a worker failure"
        assert "drafter device lost" in str(result.get("error"))
        out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=generator)
        assert torch.equal(out, target.generate(prompt, max_new_tokens=40, do_sample=False))


def test_the_worker_runs_one_pass_at_a_time():
    target, drafter = pair(0, 0, 4, 6)
    active, most = [0], [0]
    lock = threading.Lock()
    original = drafter.forward

    def observed_forward(*args, **kwargs):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            return original(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    drafter.forward = observed_forward
    with drafter.async_generator(coverage=4, fanout=2, worker_threads=1) as generator:
        for seed in range(3):
            prompt = torch.randint(0, 6, (1, 5), generator=torch.Generator().manual_seed(seed))
            out = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=generator)
            assert torch.equal(out, target.generate(prompt, max_new_tokens=30, do_sample=False))
    assert most[0] == 1


def test_a_new_call_never_uses_branches_prepared_for_an_earlier_one():
    target, drafter = pair(0, 0, 4, 6)
    with drafter.async_generator(coverage=4, fanout=2) as generator:
        first = target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=20, do_sample=False, assistant_model=generator)
        earlier = generator.generation_stats
        prompt = first[:, :-3]  # a prefix the earlier call's branches were prepared around
        second = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=generator)
        stats = generator.generation_stats
    assert stats is not earlier and not stats.rounds_drafted[0].looked_up and not stats.rounds_drafted[0].from_cache
    assert torch.equal(second, target.generate(prompt, max_new_tokens=20, do_sample=False))


def test_a_closed_generator_refuses_work():
    target, drafter = pair(0, 0, 4, 6)
    with drafter.async_generator() as generator:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        target.generate(torch.tensor([[1, 2]]), max_new_tokens=5, do_sample=False, assistant_model=generator)


@pytest.mark.parametrize("coverage,fanout", [(0, 2), (17, 2), (4, -1)])
def test_out_of_range_settings_are_refused(coverage, fanout):
    _, drafter = pair(0, 0, 16, 6)
    with pytest.raises(ValueError, match="coverage must be in 1..16"):
        D3DAssistedGenerator(drafter, coverage=coverage, fanout=fanout)


@pytest.mark.parametrize("coverage,fanout,name", [(4, 2.5, "fanout"), (4.0, 2, "coverage"), (4, True, "fanout")])
def test_settings_that_are_not_ints_are_refused(coverage, fanout, name):
    _, drafter = pair(0, 0, 16, 6)
    with pytest.raises(ValueError, match=f"{name} must be an int"):
        D3DAssistedGenerator(drafter, coverage=coverage, fanout=fanout)


def test_the_generator_is_only_an_assistant():
    _, drafter = pair(0, 0, 4, 6)
    with drafter.async_generator() as generator, pytest.raises(ValueError, match="assistant_model=generator"):
        generator.generate(torch.tensor([[1, 2]]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("target_device", ["cpu", "cuda"])
def test_greedy_output_is_identical_with_the_drafter_on_a_gpu(target_device):
    generator_seed = torch.Generator().manual_seed(0)
    target, drafter = pair(0, 0, block_size=5, vocab_size=6)
    target = target.to(target_device)
    hits = 0
    with drafter.async_generator(device="cuda", coverage=4, fanout=2) as generator:
        for prompt_length in (1, 7, 19):
            prompt = torch.randint(0, 6, (1, prompt_length), generator=generator_seed).to(target_device)
            reference = target.generate(prompt, max_new_tokens=40, do_sample=False)
            speculative = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=generator)
            assert torch.equal(reference, speculative)
            hits += generator.generation_stats.settle(speculative).cache_hits
    assert hits > 0
