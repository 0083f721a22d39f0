"""Asynchronous D3D (`sources_d3d.SuccessorSource`): `D3DAssistedGenerator` through `target.generate`, and the
worker's failures, isolation and one-pass-at-a-time guarantee (the branches themselves: `test_engine_d3d`)."""

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


def added_per_round(record) -> list[int]:
    return [len(outcome.added) for outcomes, _ in record.history for outcome in outcomes]


def served_from_cache(record) -> list[bool]:
    return [outcome.from_branch for outcomes, _ in record.history for outcome in outcomes]


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
                stats = generator.settle(speculative)
                assert stats.new_tokens == max_new or speculative.shape[1] - prompt.shape[1] == stats.new_tokens
                hits += stats.branch_hits
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
        stats = generator.settle(out)
    assert torch.equal(out, target.generate(prompt, max_new_tokens=19, do_sample=False))
    # first round drafts B-1 = 3; every later round reuses the full-acceptance branch (B-2 = 2 drafts + bonus)
    assert added_per_round(stats) == [4, 3, 3, 3, 3, 3]
    assert served_from_cache(stats) == [False] + [True] * 5
    assert stats.hit_rate == 1.0 and stats.branch_hits == 5 and generator.budget_tokens == 4 * (3 * 2 + 2)


def test_a_drafter_that_is_always_wrong_misses_and_drafts_synchronously():
    target, drafter = pair(0, 1, 4, 96)
    always_predicts(target, 7)
    always_predicts(drafter, 8)
    with drafter.async_generator(coverage=4, fanout=0) as generator:
        out = target.generate(torch.tensor([[5]]), max_new_tokens=6, do_sample=False, assistant_model=generator)
        stats = generator.settle(out)
    assert stats.tau == 1.0 and stats.branch_hits == 0 and stats.hit_rate == 0.0


def test_async_sampling_matches_the_target_distribution():
    target = tiny_target(11, vocab_size=VOCAB)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(12, vocab_size=VOCAB), block_size=2).eval()
    hits = []

    class CountingGenerator(D3DAssistedGenerator):
        def generate(self, *args, **kwargs):
            output = super().generate(*args, **kwargs)
            hits.append(self._session.hit)
            return output

    # fanout VOCAB - 1: every rejection outcome has a prepared branch, so many rounds are served from the cache
    with CountingGenerator(drafter, coverage=2, fanout=VOCAB - 1) as generator:
        counts = sampled_counts(target, seed=3, assistant_model=generator)
    assert sum(hits) > 300
    assert chi_square_p_value(counts, exact_distribution(target), SAMPLES) > 1e-3


def fail_in_the_worker(drafter, fail_at: int):
    """Make the drafter's `fail_at`-th forward on the SuccessorSource worker thread raise (a drafter device lost in
    the middle of a successor pass); returns the list of worker calls so far."""
    original, calls = drafter.forward, []

    def forward(*args, **kwargs):
        if threading.current_thread().name.startswith("d3d-drafter"):
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("drafter device lost")
        return original(*args, **kwargs)

    drafter.forward = forward
    return calls


def finishes(call, timeout: float = 120) -> dict:
    """Run `call` on a thread; returns {"error": ...} or {"output": ...}; fails if it hangs (a guard, not a timing)."""
    result: dict = {}

    def run():
        try:
            result["output"] = call()
        except RuntimeError as error:
            result["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=timeout)
    assert not thread.is_alive(), "generate hung after a worker failure"
    return result


def test_a_worker_exception_reaches_the_caller_and_the_generator_recovers():
    target, drafter = pair(0, 0, 4, 6)
    calls = fail_in_the_worker(drafter, fail_at=3)
    prompt = torch.tensor([[1, 2, 3]])
    reference = target.generate(prompt, max_new_tokens=40, do_sample=False)
    with drafter.async_generator(coverage=3, fanout=2) as generator:
        result = finishes(lambda: target.generate(prompt, max_new_tokens=40, do_sample=False,
                                                  assistant_model=generator))
        assert "drafter device lost" in str(result.get("error")) and len(calls) == 3
        out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=generator)
        assert torch.equal(out, reference)


def test_a_worker_exception_reaches_the_engine_caller_and_a_fresh_call_works():
    target, drafter = pair(0, 0, 4, 6)
    calls = fail_in_the_worker(drafter, fail_at=2)
    ids, mask = torch.tensor([[0, 1, 2, 3], [4, 5, 1, 2]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    kwargs = dict(max_new_tokens=30, do_sample=False, asynchronous=True, coverage=3, fanout=2)
    result = finishes(lambda: drafter.generate_batch(target, ids, attention_mask=mask, **kwargs))
    assert "drafter device lost" in str(result.get("error")) and len(calls) == 2
    out = drafter.generate_batch(target, ids, attention_mask=mask, **kwargs)
    for row, prompt in enumerate([ids[0, 1:], ids[1]]):
        alone = target.generate(prompt[None], max_new_tokens=30, do_sample=False)[0, len(prompt):]
        assert out[row, 4:].tolist() == alone.tolist()


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
        earlier = generator.settle(first)
        prompt = first[:, :-3]  # a prefix the earlier call's branches were prepared around
        second = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=generator)
        stats = generator.settle(second)
    assert stats is not earlier and not served_from_cache(stats)[0]
    assert stats.lookups <= stats.rounds - 1  # the first round of a call searches no branches
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
    with pytest.raises(ValueError, match="coverage must be an integer in 1..16"):
        D3DAssistedGenerator(drafter, coverage=coverage, fanout=fanout)


@pytest.mark.parametrize("coverage,fanout,name", [(4, 2.5, "fanout"), (4.0, 2, "coverage"), (4, True, "fanout")])
def test_settings_that_are_not_ints_are_refused(coverage, fanout, name):
    _, drafter = pair(0, 0, 16, 6)
    with pytest.raises(ValueError, match="coverage must be an integer in 1..16 and fanout an integer"):
        D3DAssistedGenerator(drafter, coverage=coverage, fanout=fanout)


def test_the_generator_is_only_an_assistant():
    _, drafter = pair(0, 0, 4, 6)
    with drafter.async_generator() as generator, pytest.raises(ValueError, match="assistant_model="):
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
            hits += generator.settle(speculative).branch_hits
    assert hits > 0
