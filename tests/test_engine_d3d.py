"""The engine (`engine_d3d.SpeculativeEngine` over `sources_d3d` and `successor_d3d`): every row equals the target
decoding it alone (greedy) or follows the target's distribution (sampling), with mixed lengths, early EOS, rows
joining mid-run, cancellation and failures; every prepared successor branch equals block drafting from its prefix."""

import inspect
import itertools
import time
import threading
from collections import Counter

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import always_predicts, left_pad, run_without_project, tiny_target
from distribution import NEW_TOKENS, PROMPT, SAMPLES, VOCAB, chi_square_p_value, exact_distribution, processors
from modeling_d3d import BlockSource, D3DForBlockDiffusion, RoundRecord, RowSettings, SpeculativeEngine, SuccessorSource
from modeling_d3d.acceptance_d3d import rejection_sample
from modeling_d3d.acceptance_d3d import RowSampling
from modeling_d3d.caches_d3d import StaticKVCache
from modeling_d3d.generation_d3d import speculative_generate
from modeling_d3d.lookup_d3d import LookupSource
from modeling_d3d.passes_d3d import prefill, run_pass
from modeling_d3d.policy_d3d import VerifyPolicy
from modeling_d3d.sources_d3d import block_pass_layout
from modeling_d3d.successor_d3d import plan_alternatives, successor_pass

SOURCES = {"sync": lambda drafter: BlockSource(drafter), "async": lambda drafter: SuccessorSource(drafter, 4, 2)}


def engine_for(target, drafter, kind: str = "sync", max_rows: int = 64, max_length: int = 128, **source_kwargs):
    source = None if drafter is None else (SuccessorSource(drafter, **source_kwargs) if source_kwargs
                                           else SOURCES[kind](drafter))
    return SpeculativeEngine(target, source, max_rows=max_rows, max_length=max_length)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pair(seed: int, block_size: int, vocab_size: int, **kwargs):
    target = tiny_target(seed, vocab_size=vocab_size, **kwargs)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(seed, vocab_size=vocab_size), block_size=block_size)
    return target, drafter.eval()



def alone(target, prompt: list[int] | torch.Tensor, max_new_tokens: int, **kwargs) -> list[int]:
    prompt = torch.as_tensor(prompt).reshape(1, -1)
    out = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, prompt.shape[1] :].tolist()


def drive(decoder: SpeculativeEngine, outputs: dict, rounds: int | None = None) -> dict:
    """Run rounds (all, or `rounds`), collecting each row's tokens in `outputs`; returns {key: error}."""
    errors = {}
    while len(decoder) and (rounds is None or rounds > 0):
        for outcome in decoder.step():
            outputs.setdefault(outcome.key, []).extend(outcome.added)
            if outcome.error is not None:
                errors[outcome.key] = outcome.error
        rounds = None if rounds is None else rounds - 1
    return errors


@pytest.mark.parametrize("asynchronous", [False, True])
def test_every_row_of_a_mixed_length_batch_equals_the_target_alone(asynchronous):
    generator = torch.Generator().manual_seed(0)
    accepted = Counter()
    for (vocab, block), seed in itertools.product([(6, 4), (8, 16), (96, 3), (12, 7)], [0, 1]):
        target, drafter = pair(seed, block, vocab)
        lengths = [1, block - 1, block, block + 1, 3 * block + 2, 2]
        prompts = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
        ids, mask = left_pad(prompts)
        out = drafter.generate_batch(target, ids, attention_mask=mask, max_new_tokens=23, do_sample=False,
                                     asynchronous=asynchronous, policy=False)  # the block every round
        assert out.shape == (len(prompts), ids.shape[1] + 23)
        for row, prompt in enumerate(prompts):
            assert out[row, ids.shape[1] :].tolist() == alone(target, prompt, 23), (vocab, block, seed, row)
        stats = drafter.round_record
        assert stats.new_tokens == 23 * len(prompts) and all(1 <= n <= block for n in stats.accepted)
        assert sum(n * count for n, count in stats.accepted.items()) == stats.new_tokens
        accepted += stats.accepted
    assert min(accepted) == 1 and max(accepted) >= 4  # rejections and multi-token acceptances, in the same batches


def test_generate_applies_its_sampling_processors_to_every_row():
    """Sampling through `generate` with top_k=1: the processors make p one-hot, so rejection sampling must reproduce
    greedy decoding exactly (it would not if the target's logits skipped the processors)."""
    target, drafter = pair(1, 6, 12)
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 12, (n,), generator=generator) for n in (2, 7, 15)]
    ids, mask = left_pad(prompts)
    torch.manual_seed(0)
    out = drafter.generate_batch(target, ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=1,
                                 temperature=0.5, policy=False)  # the block every round
    for row, prompt in enumerate(prompts):
        assert out[row, ids.shape[1] :].tolist() == alone(target, prompt, 20)
    assert max(drafter.round_record.accepted) >= 2


def test_rows_stop_at_their_own_eos_and_the_others_go_on():
    eos, stopped_early, went_on = 2, 0, 0
    for seed in range(4):
        target, drafter = pair(seed, 5, 6)
        prompts = [torch.randint(0, 6, (n,), generator=torch.Generator().manual_seed(seed * 10 + n)) for n in (3, 4, 7, 12)]
        ids, mask = left_pad(prompts)
        out = drafter.generate_batch(target, ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos)
        for row, prompt in enumerate(prompts):
            reference = alone(target, prompt, 30, eos_token_id=eos, pad_token_id=eos)
            tail = out[row, ids.shape[1] :].tolist()
            assert tail[: len(reference)] == reference and set(tail[len(reference) :]) <= {eos}
            stopped_early += len(reference) < 30
            went_on += len(reference) == 30
    assert stopped_early > 0 and went_on > 0


def test_the_first_token_comes_from_the_prefill_as_generates_does():
    """A row's prefill reads its whole prompt, and the logits of its last token decide its first token, as
    `generate`'s prefill does: the target alone makes N tokens in N target passes, as `generate` does (before: N + 1,
    the prefill stopped before the prompt's last token and the first round read it again); the step that reports
    the first token runs no pass; the tokens are the target's."""
    target = tiny_target(2)
    prompt = [1, 2, 3, 4]
    references = {new: alone(target, prompt, new) for new in (1, 5)}
    calls = []
    hook = target.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        for new, reference in references.items():
            calls.clear()
            decoder = SpeculativeEngine(target, None, max_rows=1, max_length=64)
            decoder.add(0, prompt, RowSettings(new))
            (first,) = decoder.step()
            assert len(calls) == 1 and first.added == reference[:1] and first.finished == (new == 1)
            outputs = {0: first.added}
            drive(decoder, outputs)
            assert len(calls) == new and outputs[0] == reference
    finally:
        hook.remove()


def test_rows_that_fail_to_join_report_no_first_token():
    """`add_rows` decides the first tokens before the sources take the rows; should a source refuse them then, the
    rows do not join and no first token of theirs is reported (a key added again would have had two)."""
    target = tiny_target(2)
    reference = alone(target, [1, 2, 3], 3)

    class Refuses(LookupSource):
        refuse = True

        def add(self, first_slot, contexts):
            if self.refuse:
                raise RuntimeError("refused")
            super().add(first_slot, contexts)

    lookup = Refuses(4)
    decoder = SpeculativeEngine(target, None, max_rows=2, max_length=64, lookup=lookup)
    with pytest.raises(RuntimeError, match="refused"):
        decoder.add("a", [1, 2, 3], RowSettings(3))
    assert len(decoder) == 0 and decoder.step() == []
    lookup.refuse = False
    decoder.add("a", [1, 2, 3], RowSettings(3))
    outputs = {}
    drive(decoder, outputs)
    assert outputs == {"a": reference}


def test_a_row_stopping_at_eos_leaves_the_batch_at_once():
    target, drafter = pair(0, 4, 96)
    always_predicts(target, 7)
    always_predicts(drafter, 7)
    decoder = engine_for(target, drafter)
    decoder.add("stops", [1, 2, 3], RowSettings(max_new_tokens=40, eos_token_ids=frozenset({7})))
    decoder.add("runs", [4, 5], RowSettings(max_new_tokens=9))
    first = {o.key: o for o in decoder.step()}  # the first tokens, from the prefill
    assert first["stops"].added == [7] and first["stops"].finished
    assert first["runs"].added == [7] and not first["runs"].finished
    assert [row.key for row in decoder.rows] == ["runs"]
    outputs = {"runs": first["runs"].added}
    drive(decoder, outputs)
    assert outputs["runs"] == [7] * 9 and decoder.round_record.accepted == {1: 2, 4: 2}


class ForwardShapes:
    """Records the input shape of every forward of a model (to show which tokens were computed)."""

    def __init__(self, model):
        self.shapes = []
        self._hook = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        self.shapes.append(tuple(kwargs["input_ids"].shape))

    def stop(self) -> None:
        self._hook.remove()


def test_requests_joining_mid_run_match_the_target_alone_without_recomputing_prefixes():
    target, drafter = pair(1, 16, 8)
    target_shapes, drafter_shapes = ForwardShapes(target), ForwardShapes(drafter)
    generator = torch.Generator().manual_seed(3)
    prompts = {key: torch.randint(0, 8, (n,), generator=generator).tolist() for key, n in
               [("a", 5), ("b", 31), ("c", 1), ("d", 12), ("e", 40)]}
    limits = {"a": 40, "b": 25, "c": 30, "d": 33, "e": 20}
    decoder = engine_for(target, drafter)
    outputs = {}
    for key in "ab":
        decoder.add(key, prompts[key], RowSettings(limits[key]))
    drive(decoder, outputs, rounds=2)
    decoder.add("c", prompts["c"], RowSettings(limits["c"]))
    drive(decoder, outputs, rounds=3)
    for key in "de":
        decoder.add(key, prompts[key], RowSettings(limits[key]))
    drive(decoder, outputs)
    target_shapes.stop()
    drafter_shapes.stop()
    for key, prompt in prompts.items():
        assert outputs[key] == alone(target, prompt, limits[key]), key
    prefills = [(1, len(p)) for p in prompts.values()]
    rounds = [shape for shape in target_shapes.shapes if shape not in prefills]
    assert all(width == 16 for _, width in rounds)  # after its prefill a row costs one block per round, nothing more
    joins = 3  # rounds of the rows' first tokens, decided by their prefills (a, b; c; d, e): no pass of their own
    assert sum(rows for rows, _ in rounds) == decoder.round_record.row_rounds - len(prompts)
    drafts = [shape for shape in drafter_shapes.shapes if shape not in prefills]
    assert len(drafts) == decoder.round_record.rounds - joins and all(width <= 2 * 16 for _, width in drafts)


def test_removing_a_row_leaves_the_others_unchanged_greedy_and_sampled():
    target, drafter = pair(2, 6, 12)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 12, (n,), generator=generator).tolist() for n in (4, 17, 9, 2)]

    def run(cancel: bool) -> dict:
        decoder = engine_for(target, drafter)
        for key, prompt in enumerate(prompts):
            sampled = key % 2 == 1
            decoder.add(key, prompt, RowSettings(24, do_sample=sampled, seed=100 + key,
                                                 logits_processor=processors() if sampled else LogitsProcessorList()))
        outputs = {}
        drive(decoder, outputs, rounds=2)
        if cancel:
            decoder.remove({2})
        drive(decoder, outputs)
        return outputs

    full, cancelled = run(False), run(True)
    assert len(cancelled[2]) < 24
    for key in (0, 1, 3):
        assert cancelled[key] == full[key]
    for key in (0, 2):
        assert full[key] == alone(target, prompts[key], 24)


class FailsAfter(LogitsProcessor):
    """A row's logits processor that raises from its `calls`-th use on (a failure inside that row's drafting). It may
    be called from the asynchronous worker too, hence the lock."""

    def __init__(self, calls: int):
        self.calls = calls
        self.lock = threading.Lock()

    def __call__(self, input_ids, scores):
        with self.lock:
            self.calls -= 1
            if self.calls <= 0:
                return self.fail(scores)
        return scores

    def fail(self, scores):
        raise RuntimeError("injected drafting failure")


@pytest.mark.parametrize("kind", SOURCES)
def test_a_failing_row_ends_with_its_error_and_the_others_finish(kind):
    target, drafter = pair(0, 4, 12)
    prompts = {0: [1, 2, 3], 1: [4, 5, 6, 7, 8], 2: [9]}
    decoder = engine_for(target, drafter, kind)
    for key, prompt in prompts.items():
        failing = LogitsProcessorList([FailsAfter(3)]) if key == 1 else LogitsProcessorList()
        decoder.add(key, prompt, RowSettings(20, logits_processor=failing))
    outputs = {}
    errors = drive(decoder, outputs)
    assert list(errors) == [1] and "injected" in str(errors[1])
    for key in (0, 2):
        assert outputs[key] == alone(target, prompts[key], 20)


class LeavesNothingAfter(FailsAfter):
    """A sampled row's processor that leaves every score -inf from its `calls`-th use on (on the drafter's logits and
    the target's alike): the row's distribution has no mass."""

    def fail(self, scores):
        return torch.full_like(scores, float("-inf"))


@pytest.mark.parametrize("kind", [None, *SOURCES])
def test_a_sampled_row_without_mass_ends_with_a_clear_error_and_the_others_finish(kind):
    """A row whose processors leave no token ends with its own error ("no mass"), on the CPU as a GPU would (no read
    of the weights before the round's one read): the batch's other rows finish as the target alone decodes them, its
    drafts from a q without mass are never kept, and no token outside the vocabulary reaches a pass. Before, a CPU
    raised inside the batched draw and the whole round failed (and a GPU would feed the token `vocab` to the next
    pass)."""
    target, drafter = pair(0, 4, 12)
    prompts = {0: [1, 2, 3], 1: [4, 5, 6, 7, 8], 2: [9]}
    decoder = engine_for(target, drafter if kind else None, kind or "sync")
    for key, prompt in prompts.items():
        bad = key == 1
        decoder.add(key, prompt, RowSettings(20, do_sample=bad, seed=4, logits_processor=LogitsProcessorList(
            [LeavesNothingAfter(5)] if bad else [])))
    outputs = {}
    errors = drive(decoder, outputs)
    assert list(errors) == [1] and "no mass" in str(errors[1])
    assert all(0 <= token < 12 for token in outputs.get(1, []))
    for key in (0, 2):
        assert outputs[key] == alone(target, prompts[key], 20)


class NeedsScale(LogitsProcessor):
    """A processor that takes an argument besides `(input_ids, scores)`, which no row passes."""

    def __call__(self, input_ids, scores, scale):
        return scores * scale


def test_a_rows_processors_read_their_signatures_once_and_process_as_transformers_list_does(monkeypatch):
    """A sampled row calls its processors every round: each processor's signature is read once for the row, not once
    a round as `LogitsProcessorList.__call__` reads it (`inspect.signature`, a measurable part of a small target's
    decoding step); the logits come out as transformers' list makes them, and a processor that needs an argument
    nobody passes fails its row with transformers' own error."""
    target, drafter = pair(0, 4, 12)
    reads = Counter()
    signature = inspect.signature

    def counted(function, *args, **kwargs):
        owner = getattr(function, "__self__", None)
        if isinstance(owner, LogitsProcessor):
            reads[id(owner)] += 1
        return signature(function, *args, **kwargs)

    monkeypatch.setattr(inspect, "signature", counted)
    given, scores = processors(), torch.randn(5, 12)
    processed = RowSettings(12, do_sample=True, logits_processor=given).logits_processor
    assert torch.equal(processed(torch.zeros(5, 1, dtype=torch.long), scores.clone()),
                       LogitsProcessorList(given)(torch.zeros(5, 1, dtype=torch.long), scores.clone()))
    reads.clear()
    decoder = engine_for(target, drafter)
    decoder.add(0, [1, 2, 3], RowSettings(12, do_sample=True, logits_processor=given, seed=3))
    outputs = {}
    assert drive(decoder, outputs) == {} and len(outputs[0]) == 12 and decoder.round_record.rounds > 2
    assert reads and set(reads.values()) == {1}, reads  # at most once each (the warpers after top-k: never read)
    decoder.add(1, [1, 2, 3], RowSettings(12, do_sample=True, logits_processor=LogitsProcessorList([NeedsScale()])))
    errors = drive(decoder, {})
    assert list(errors) == [1] and "Make sure that all the required parameters" in str(errors[1])


def test_a_failing_batched_pass_raises_and_reset_recovers():
    target, drafter = pair(0, 4, 12)
    decoder = engine_for(target, drafter)
    decoder.add(0, [1, 2, 3], RowSettings(10))
    def explode(*_):
        raise RuntimeError("boom")

    handle = drafter.model.layers[1].register_forward_pre_hook(explode)
    assert [outcome.added for outcome in decoder.step()] == [alone(target, [1, 2, 3], 1)]  # from the prefill
    with pytest.raises(RuntimeError, match="boom"):
        decoder.step()
    handle.remove()
    decoder.reset()
    outputs = {}
    decoder.add(1, [4, 5], RowSettings(10))
    drive(decoder, outputs)
    assert outputs[1] == alone(target, [4, 5], 10)


@pytest.fixture(scope="module")
def sampling_models():
    target = tiny_target(11, vocab_size=VOCAB)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(12, vocab_size=VOCAB), block_size=4).eval()
    return target, drafter


@pytest.mark.parametrize("kind,names", [("sync", ("short", "long")), ("async", ("long",))])  # async: half, for time
def test_each_sampled_row_follows_the_target_distribution(sampling_models, kind, names):
    """Rows of prompts of different lengths, decoded together with rows joining as others finish (continuous
    batching, the joining rows prefilled together: `add_rows`), each with its own seed: per prompt, a chi-square test
    against the exact distribution."""
    target, drafter = sampling_models
    prompts = {"short": PROMPT[0].tolist(), "long": [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 7]}
    prompts = {name: prompts[name] for name in names}
    counts = {name: Counter() for name in prompts}
    queue = [(name, index) for index in range(SAMPLES) for name in prompts]
    decoder, outputs = engine_for(target, drafter, kind), {}
    while queue or len(decoder):
        joining = [queue.pop() for _ in range(min(len(queue), 64 - len(decoder)))]
        decoder.add_rows([((name, index), prompts[name], RowSettings(NEW_TOKENS, True, logits_processor=processors(),
                                                                      seed=index * 2 + (name == "long")), None)
                          for name, index in joining])
        for outcome in decoder.step():
            assert outcome.error is None
            outputs.setdefault(outcome.key, []).extend(outcome.added)
            if outcome.finished:
                counts[outcome.key[0]][tuple(outputs.pop(outcome.key))] += 1
    assert 1 in decoder.round_record.accepted and max(decoder.round_record.accepted) >= 2
    record = decoder.round_record
    assert kind == "sync" or 0 < record.branch_hits < record.lookups  # async rows used prepared branches
    for name, prompt in prompts.items():
        expected = exact_distribution(target, torch.tensor([prompt]))
        assert chi_square_p_value(counts[name], expected, SAMPLES) > 1e-3, name


def test_rejection_sample_draws_from_p_and_fails_when_the_drafts_do_not_come_from_q():
    """The acceptance rule alone, batched over SAMPLES rows: the first token is distributed as p whatever q is,
    provided the drafts were drawn from q; drafts drawn from another distribution break it (so the per-row test
    above can fail)."""
    rng = torch.Generator().manual_seed(0)
    p_logits, q_logits, other = (torch.randn(n, VOCAB, generator=rng) for n in (3, 2, 2))
    target_logits, draft_logits = p_logits.expand(SAMPLES, -1, -1), q_logits.expand(SAMPLES, -1, -1)
    num_drafts = torch.full((SAMPLES,), 2)
    expected = {(token,): probability for token, probability in enumerate(p_logits[0].softmax(-1).tolist())}
    results = {}
    for name, source in (("honest", q_logits), ("broken", other)):
        drafts = torch.multinomial(source.softmax(-1), SAMPLES, replacement=True, generator=rng).T
        accepted, tokens = rejection_sample(drafts, num_drafts, draft_logits, target_logits, [rng] * SAMPLES)
        assert ((0 <= accepted) & (accepted <= 2)).all()
        results[name] = Counter((token,) for token in tokens[:, 0].tolist())
    assert chi_square_p_value(results["honest"], expected, SAMPLES) > 1e-3
    assert chi_square_p_value(results["broken"], expected, SAMPLES) < 1e-6


def prefilled_cache(drafter, contexts: list[list[int]], cached: list[int]) -> StaticKVCache:
    cache = StaticKVCache(drafter.config, len(contexts), 128, torch.device("cpu"), drafter.dtype)
    prefill(drafter, cache, 0, [context[:start] for context, start in zip(contexts, cached)])
    return cache


@pytest.mark.parametrize("coverage,fanout", [(4, 2), (1, 2), (3, 0), (2, 3)])
def test_each_successor_branch_of_each_row_equals_block_drafting_from_its_own_prefix(coverage, fanout):
    """The packed, ragged successor pass over a static cache: rows of different lengths, different cached prefixes
    and draft counts; afterwards each row's cache holds its context and drafts (rollback by length)."""
    _, drafter = pair(3, 5, 96)
    generator = torch.Generator().manual_seed(coverage * 10 + fanout)
    contexts = [torch.randint(0, 96, (n,), generator=generator).tolist() for n in (6, 13, 2)]
    cached = [5, 9, 0]
    cache = prefilled_cache(drafter, contexts, cached)
    blocks = [drafter.draft_block(torch.tensor([context])) for context in contexts]
    drafts = [blocks[0].tokens[0].tolist(), blocks[1].tokens[0, :2].tolist(), blocks[2].tokens[0].tolist()]  # ragged
    ranked = [block.logits[0].topk(fanout + 1, dim=-1).indices for block in blocks]
    anchors = []
    for row_drafts, row_ranked in zip(drafts, ranked):
        n = len(row_drafts)
        alternatives = plan_alternatives(torch.tensor([row_drafts]), row_ranked[None, :n], coverage, fanout)[0]
        row = [(int(token), j) for j in range(min(coverage - 1, n)) for token in alternatives[j]]
        anchors.append(row + [(row_drafts[-1], n - 1)])
    raw = successor_pass(drafter, cache, contexts, cached, drafts, anchors)
    for r, (context, row_drafts, row_anchors) in enumerate(zip(contexts, drafts, anchors)):
        assert len(row_anchors) == min(coverage - 1, len(row_drafts)) * fanout + 1
        for k, (token, j) in enumerate(row_anchors):
            prefix = context + row_drafts[:j] + [token]
            alone = drafter.draft_block(torch.tensor([prefix]))
            torch.testing.assert_close(raw[r, k], alone.logits[0], atol=1e-4, rtol=0)
            assert j == len(row_drafts) - 1 or token != row_drafts[j]  # an alternative differs from the draft
    # commit what "verification" kept: the cache is valid for each row's context and its first `a` drafts
    kept = [1, 2, 0]
    new_contexts = [c + d[:a] + [7] for c, d, a in zip(contexts, drafts, kept)]
    committed = [len(c) + a for c, a in zip(contexts, kept)]
    block = drafter.config.block_size
    raw = run_pass(drafter, cache, block_pass_layout(new_contexts, committed, block, drafter.config.mask_token_id), block - 1)
    for r, context in enumerate(new_contexts):
        torch.testing.assert_close(raw[r], drafter.draft_block(torch.tensor([context])).logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("block_size,coverage,fanout", [(5, 4, 2), (4, 4, 3), (6, 1, 2), (4, 3, 0), (3, 2, 1)])
def test_every_branch_a_successor_source_prepares_equals_block_drafting_from_its_own_prefix(block_size, coverage,
                                                                                            fanout):
    """After one propose + observe, every prepared branch of every row (rejection branches and the full-acceptance
    branch, whose first token is the guess in its key) equals `draft_block` from the prefix its key spells."""
    _, drafter = pair(0, block_size, 96)
    generator = torch.Generator().manual_seed(block_size + coverage)
    contexts = [torch.randint(0, 96, (n,), generator=generator).tolist() for n in (11, 1, 6)]
    with SuccessorSource(drafter, coverage, fanout) as source:
        source.allocate(3, 64)
        source.add(0, contexts)
        proposal = source.propose(contexts, [RowSampling() for _ in contexts])
        source.observe(contexts, [[], [], []])
        m = block_size - 1
        for r, context in enumerate(contexts):
            drafts = proposal.drafts[r].tolist()
            alone = drafter.draft_block(torch.tensor([context]))
            assert drafts == alone.tokens[0].tolist() and int(proposal.num_drafts[r]) == m
            branch = source.branches[r]
            assert branch.base == len(context)
            assert len(branch.keys) == min(coverage - 1, m) * fanout + 1
            assert sum(count + 1 for count in branch.counts) <= source.budget_tokens
            for key, k in branch.keys.items():
                full = len(key) == m + 1
                assert list(key[:-1]) == drafts[: len(key) - 1] and (full or key[-1] != drafts[len(key) - 1])
                expected = drafter.draft_block(torch.tensor([context + list(key if not full else key[:-1])]))
                expected = expected.tokens[0].tolist()
                if full:
                    assert key[-1] == expected[0]
                    expected = expected[1:]
                assert branch.tokens[k, : branch.counts[k]].tolist() == expected, (r, key)
            ranks = alone.logits[0].argsort(-1, descending=True)
            for j in range(min(coverage - 1, m)):  # the alternatives: the next most probable drafter tokens
                assert [key[-1] for key in branch.keys if len(key) == j + 1] == ranks[j, 1 : fanout + 1].tolist()


def test_asynchronous_rows_joining_and_stopping_match_the_target_alone_and_hit_branches():
    compared, hits, lookups = 0, 0, 0
    for (vocab, block, coverage, fanout), eos in itertools.product([(6, 4, 4, 2), (8, 16, 12, 2), (12, 5, 2, 3)], [None, 2]):
        target, drafter = pair(1, block, vocab)
        generator = torch.Generator().manual_seed(vocab + block)
        prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (1, 3, 9, 17, 5)]
        eos_ids = frozenset() if eos is None else frozenset({eos})
        decoder = engine_for(target, drafter, coverage=coverage, fanout=fanout)
        outputs = {}
        for key in (0, 1, 2):
            decoder.add(key, prompts[key], RowSettings(20 + key, eos_token_ids=eos_ids))
        drive(decoder, outputs, rounds=2)
        for key in (3, 4):
            decoder.add(key, prompts[key], RowSettings(20 + key, eos_token_ids=eos_ids))
        assert drive(decoder, outputs) == {}
        kwargs = {} if eos is None else dict(eos_token_id=eos, pad_token_id=eos)
        for key, prompt in enumerate(prompts):
            assert outputs[key] == alone(target, prompt, 20 + key, **kwargs), (vocab, block, eos, key)
            compared += 1
        hits, lookups = hits + decoder.round_record.branch_hits, lookups + decoder.round_record.lookups
    assert compared == 30 and 0 < hits < lookups  # both hits and misses happened




def test_a_static_cache_moves_a_rows_committed_columns_only():
    """Rows leave by one row copy: the committed columns of the last row move into the freed slot, nothing else."""
    target = tiny_target(0, vocab_size=12)
    cache = StaticKVCache(target.config, 3, 8, torch.device("cpu"), torch.float32)
    for layer in cache.keys + cache.values:
        layer.copy_(torch.randn(layer.shape))
    before = [layer.clone() for layer in cache.keys + cache.values]
    cache.commit(2, 5)
    cache.move_row(2, 0)
    assert cache.committed[0] == 5
    for old, new in zip(before, cache.keys + cache.values):
        assert torch.equal(new[0, :, :5], old[2, :, :5]) and torch.equal(new[0, :, 5:], old[0, :, 5:])
        assert torch.equal(new[1:], old[1:])
    with pytest.raises(RuntimeError, match="does not fit"):  # an internal invariant: a bug, not the user's input
        cache.plan(4, torch.zeros(4, 1, dtype=torch.long), 2)


def test_bad_input_is_refused_with_a_clear_error():
    target, drafter = pair(0, 4, 12)
    with pytest.raises(ValueError, match="vocabulary size"):
        SpeculativeEngine(tiny_target(0, vocab_size=16), BlockSource(drafter))
    with pytest.raises(ValueError, match="full attention"):
        SpeculativeEngine(tiny_target(0, vocab_size=12, layer_types=["sliding_attention", "full_attention"],
                                      sliding_window=8, use_sliding_window=True), BlockSource(drafter))
    decoder = engine_for(target, drafter, max_rows=1, max_length=64)
    with pytest.raises(ValueError, match="at least one token"):
        decoder.add(0, [], RowSettings(5))
    with pytest.raises(ValueError, match="max_new_tokens"):
        RowSettings(0)
    with pytest.raises(ValueError, match="max_length 64"):
        decoder.add(0, [1] * 50, RowSettings(20))
    with pytest.raises(ValueError, match="token ids"):
        decoder.add(0, [1, 12], RowSettings(5))
    decoder.add(0, [1, 2], RowSettings(5))
    with pytest.raises(ValueError, match="already"):
        decoder.add(0, [3], RowSettings(5))
    with pytest.raises(ValueError, match="holds 1 rows"):
        decoder.add(1, [3], RowSettings(5))
    decoder = engine_for(target, drafter, max_rows=3, max_length=64)
    with pytest.raises(ValueError, match="key 0 is already"):  # one bad request: none joins
        decoder.add_rows([(0, [1, 2], RowSettings(5), None), (0, [3], RowSettings(5), None)])
    with pytest.raises(ValueError, match="token ids"):
        decoder.add_rows([(0, [1, 2], RowSettings(5), None), (1, [12], RowSettings(5), None)])
    with pytest.raises(ValueError, match="holds 3 rows already"):
        decoder.add_rows([(key, [1, 2], RowSettings(5), None) for key in range(4)])
    assert len(decoder) == 0
    with pytest.raises(ValueError, match="drafter="):
        target.generate(torch.tensor([[1, 2]]), max_new_tokens=2, custom_generate=speculative_generate,
                        asynchronous=True)
    with pytest.raises(ValueError, match="verification must be one of"):
        target.generate(torch.tensor([[1, 2]]), max_new_tokens=2, custom_generate=speculative_generate,
                        drafter=drafter, verification="joint")


REMOTE_BATCH = """
    import torch
    from transformers import AutoModel, Qwen3Config, Qwen3ForCausalLM

    drafter = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=drafter.config.vocab_size, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8)).eval()
    ids, mask = torch.tensor([[0, 0, 5, 6], [1, 2, 3, 4]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    out = drafter.generate_batch(target, ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
    alone = [target.generate(ids[i : i + 1, 2 * (1 - i) :], max_new_tokens=9, do_sample=False)[0, -9:] for i in range(2)]
    assert torch.equal(out[:, 4:], torch.stack(alone))
    with drafter.batch_server(target, max_batch_size=2) as server:
        assert server.submit([5, 6], max_new_tokens=9).result(timeout=60) == alone[0].tolist()
    print("batched remote code ok")
"""


def test_batched_decoding_works_from_the_saved_remote_code(tmp_path):
    D3DForBlockDiffusion.from_backbone(tiny_target(3, vocab_size=96), block_size=5).save_pretrained(tmp_path / "drafter")
    assert {"engine_d3d.py", "sources_d3d.py", "successor_d3d.py", "serving_d3d.py"} <= {path.name for path in (tmp_path / "drafter").iterdir()}
    result = run_without_project(REMOTE_BATCH, str(tmp_path / "drafter"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "batched remote code ok" in result.stdout




@pytest.mark.parametrize("settings", [{"min_new_tokens": 3}, {"forced_eos_token_id": 1}, {"repetition_penalty": 1.3}])
def test_settings_that_depend_on_a_rows_own_length_follow_each_row_of_a_padded_batch(settings):
    """Processors built from the prompt's length are rebuilt per row of a left-padded batch: each row as alone."""
    target, drafter = pair(0, block_size=4, vocab_size=12)
    prompts = [torch.tensor([5, 6]), torch.tensor([3, 4, 5, 6, 9, 1])]
    ids, mask = left_pad(prompts)
    kwargs = dict(eos_token_id=2, pad_token_id=2, **settings)
    for asynchronous in (False, True):
        out = drafter.generate_batch(target, ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                     asynchronous=asynchronous, **kwargs)
        for row, prompt in enumerate(prompts):
            reference = alone(target, prompt, 6, **kwargs)
            assert out[row, ids.shape[1] : ids.shape[1] + len(reference)].tolist() == reference, (settings, row)


def check_record(record: RoundRecord, block_size: int) -> None:
    """The totals of a RoundRecord are the sums of its rounds, and each round's parts add up to its total."""
    outcomes = [outcome for round_outcomes, _ in record.history for outcome in round_outcomes]
    timings = [timing for _, timing in record.history]
    assert record.rounds == len(record.history) and record.row_rounds == len(outcomes)
    assert record.new_tokens == sum(len(outcome.added) for outcome in outcomes)
    assert sum(n * count for n, count in record.accepted.items()) == record.new_tokens
    assert sum(record.histogram(block_size)) == record.row_rounds and max(record.accepted) <= block_size
    assert record.branch_hits == sum(outcome.from_branch for outcome in outcomes) <= record.lookups
    assert all(outcome.accepted_drafts <= len(outcome.added) - (not outcome.finished) for outcome in outcomes)
    for timing in timings:
        assert min(timing.verify, timing.exposed_draft, timing.hidden_draft, timing.host) >= 0
        assert timing.total == timing.verify + timing.exposed_draft + timing.host
    for name in ("verify", "exposed_draft", "hidden_draft", "host"):
        assert getattr(record, f"{name}_seconds") == pytest.approx(sum(getattr(t, name) for t in timings), abs=1e-9)
    assert record.seconds == pytest.approx(sum(t.total for t in timings), abs=1e-9)
    assert record.tau == pytest.approx(record.new_tokens / record.row_rounds)


@pytest.mark.parametrize("path", ["sync", "async", "alone"])
def test_the_round_record_of_a_generate_call_adds_up_to_its_output(path):
    target, drafter = pair(3, 5, 8)  # models whose asynchronous run serves rows from prepared branches
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 8, (n,), generator=generator) for n in (1, 6, 13, 4)]
    eos = alone(target, prompts[1], 21)[3]  # a token the target generates: a row stops at it
    ids, mask = left_pad(prompts, pad=eos)
    record = RoundRecord()
    kwargs = dict(max_new_tokens=21, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    target.generate(ids, attention_mask=mask, custom_generate=speculative_generate, round_record=record,
                    drafter=None if path == "alone" else drafter, asynchronous=path == "async", policy=False, **kwargs)
    references = [alone(target, prompt, 21, eos_token_id=eos, pad_token_id=eos) for prompt in prompts]
    per_row = Counter()
    for outcomes, _ in record.history:
        for outcome in outcomes:
            per_row[outcome.key] += len(outcome.added)
    assert [per_row[r] for r in range(len(prompts))] == [len(reference) for reference in references]
    assert record.new_tokens == sum(len(reference) for reference in references)
    assert any(len(reference) < 21 for reference in references)  # a row stopped at EOS
    check_record(record, 1 if path == "alone" else 5)
    if path == "async":
        assert 0 < record.branch_hits <= record.lookups and record.hidden_draft_seconds > 0
    if path == "alone":
        assert set(record.accepted) == {1} and record.exposed_draft_seconds == 0


@pytest.mark.parametrize("kind", SOURCES)
def test_each_rounds_timing_fits_inside_the_step_that_ran_it(kind):
    """Driving the engine: every round's total is measured within its `step` call, and its record adds up."""
    target, drafter = pair(0, 4, 12)
    decoder = engine_for(target, drafter, kind)
    for key, prompt in enumerate([[1, 2, 3], [4, 5, 6, 7, 8], [9]]):
        decoder.add(key, prompt, RowSettings(15))
    outputs = {}
    while len(decoder):
        start = time.perf_counter()
        for outcome in decoder.step():
            outputs.setdefault(outcome.key, []).extend(outcome.added)
        wall = time.perf_counter() - start
        assert decoder.round_record.history[-1][1].total <= wall
    decoder.close()
    assert decoder.round_record.new_tokens == sum(len(tokens) for tokens in outputs.values()) == 45
    check_record(decoder.round_record, 4)


def test_a_criterion_that_fires_before_an_eos_in_the_same_round_stops_there():
    """One round's accepted tokens hold, in this order, the token after which a stopping criterion fires and an
    EOS: the row stops at the first of the two, as `generate`'s token-by-token loop does (and the other way round)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from modeling_d3d.engine_d3d import Row

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == 6

    settings = RowSettings(20, eos_token_ids=frozenset({8}), stopping_criteria=StoppingCriteriaList([StopAfter()]))
    row = Row(0, [1, 2, 3], [1, 2, 3], settings, RowSampling(), torch.Generator())
    logits = torch.zeros(5, 12)
    assert SpeculativeEngine._stop(row, [5, 6, 7, 8, 9], logits) == ([5, 6], True)
    assert SpeculativeEngine._stop(row, [5, 8, 6, 9], logits) == ([5, 8], True)
    assert SpeculativeEngine._stop(row, [5, 7, 9], logits) == ([5, 7, 9], False)


def test_requests_of_similar_lengths_share_one_prefill_pass_and_decode_as_alone():
    """`add_rows`: eight prompts of 10-12 tokens and two of 30 are prefilled in two target passes, not ten (the
    drafter's in two passes too, on the first round that drafts, before its block pass), and every row decodes to
    what the target alone gives it."""
    target, drafter = pair(3, 4, 32)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32, (n,), generator=generator).tolist() for n in (11, 30, 10, 12, 12, 11, 10, 31, 12, 10)]
    calls = {"target": 0, "drafter": 0}
    hooks = [model.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
             for name, model in (("target", target), ("drafter", drafter))]
    decoder = engine_for(target, drafter, max_rows=len(prompts), max_length=64)
    decoder.add_rows([])  # the server's loop with nothing admitted: nothing runs, nothing is timed
    assert len(decoder) == 0 and decoder.round_record.prefill_seconds == 0.0
    try:
        decoder.add_rows([(key, prompt, RowSettings(8), None) for key, prompt in enumerate(prompts)])
        assert calls == {"target": 2, "drafter": 0}
        outputs = {}
        assert drive(decoder, outputs, rounds=2) == {}  # the first tokens (from the prefill), then a round
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == {"target": 3, "drafter": 3}
    assert drive(decoder, outputs) == {}
    assert outputs == {key: alone(target, prompt, 8) for key, prompt in enumerate(prompts)}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_drafter_prefills_a_row_on_its_first_block_round_only(kind):
    """Rows join with the target's prefill alone (a request's first token waits for no drafter pass); the drafter
    reads a row's context on the row's first round that verifies its block (`sources_d3d.catch_up`), so rows whose
    rounds never verify the drafter's block (plain steps, the policy's choice where drafting does not pay) never run
    it. Both decode as the target alone."""
    target, drafter = pair(21, 4, 40)
    passes = []
    drafter.register_forward_hook(lambda *_: passes.append(1))
    prompts = [torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (15, 23, 9)]
    plain = VerifyPolicy(4, costs={"narrow": 1.0, "wide": 50.0, "drafter": 50.0}, probe_every=1000)
    for policy, drafts in ((plain, False), (None, True)):  # None: the drafter's block every round
        passes.clear()
        engine = SpeculativeEngine(target, SOURCES[kind](drafter), max_rows=4, max_length=64, policy=policy)
        engine.add_rows([(i, prompt, RowSettings(10), None) for i, prompt in enumerate(prompts)])
        assert passes == []  # the join ran the target only
        outputs = {}
        assert drive(engine, outputs) == {}
        engine.close()
        assert bool(passes) == drafts
        for i, prompt in enumerate(prompts):
            assert outputs[i] == alone(target, prompt, 10), (policy, i)
