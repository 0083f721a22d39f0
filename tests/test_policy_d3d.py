"""The one chooser (`policy_d3d.VerifyPolicy`) and prompt lookup in the engine (`lookup_d3d.LookupSource`): the
lookup finds the earlier occurrence of the longest suffix whose text before agrees longest; the policy's decisions follow expected tokens per
second; sampled rows under every kind of plan follow the target's exact distribution, and a plan that peeks at the
round's verification fails the same test."""

import time
from collections import Counter

import pytest
import torch

from transformers import LogitsProcessor, LogitsProcessorList

from conftest import tiny_drafter, tiny_target
from distribution import NEW_TOKENS, SAMPLES, VOCAB, chi_square_p_value, exact_distribution, processors
from modeling_d3d import (BlockSource, D3DBatchServer, D3DForBlockDiffusion, RoundRecord, RowSettings,
                          SpeculativeEngine, SuccessorSource)
from modeling_d3d.generation_d3d import speculative_generate
from modeling_d3d.lookup_d3d import CANDIDATES, MAX_MATCH, LookupSource, NgramIndex
from modeling_d3d.sources_d3d import Proposal
from modeling_d3d.policy_d3d import (BLOCK, BOTH, FULL, LONG, LOOKUP, NOTHING, SHORT_DRAFTS, RoundPlan, VerifyPolicy,
                                     age_bucket, apply_plan, make_chooser, match_bucket, pass_kind, tree_width,
                                     untangled, verify_width)
from policies import EveryChoice

REPEATING = [1, 5, 2, 7, 3, 1, 5, 2, 7, 3, 1, 5]  # its suffix [1, 5] occurred before: lookups find [2, 7, 3, ...]
# every token of the vocabulary followed its last token (5) before: whatever a row's first token (its prefill's),
# its first round finds a lookup (what followed that pair)
EVERY_NEXT = [5, 0, 5, 1, 5, 2, 5, 3, 5, 4, 5, 6, 5, 7, 5, 5]


def test_a_lookup_continues_the_longest_suffix_where_the_text_before_it_agrees_longest():
    index = NgramIndex(max_ngram=3)
    index.extend([4, 1, 2, 9, 1, 2, 6, 7, 3, 2])
    # suffix [2] ended at 3, 6 and 9; the text before agrees one token at each: the latest wins the tie
    assert index.continuation(min_ngram=1, count=3) == ([6, 7, 3], 1)
    index.extend([4, 1, 2, 9, 1, 2, 6, 7, 3, 2, 5, 1, 2])
    assert index.continuation(min_ngram=1, count=4) == ([6, 7, 3, 2], 2)  # [1, 2] ended before 9 and before 6
    index.extend([4, 1, 2, 9, 1, 2, 6, 7, 3, 2, 5, 1, 2, 8])
    assert index.continuation(min_ngram=2, count=4) == ([], 0)  # "2 8" never occurred before
    assert index.continuation(min_ngram=1, count=2) == ([], 0)  # nor did 8
    # [1, 2] ended before 5 and, later, before 6; before the first, 3 tokens agree with the text's end (7 1 2),
    # before the latest 2 (0 1 2 against 7 1 2): the first one's continuation is drafted
    longest = NgramIndex(max_ngram=2)
    longest.extend([7, 1, 2, 5, 0, 1, 2, 6, 7, 1, 2])
    assert longest.continuation(min_ngram=2, count=3) == ([5, 0, 1], 3)


def test_a_lookup_index_refuses_a_context_that_does_not_extend_its_text():
    """An index only grows with its row's text: a shorter context, or one whose token at the indexed end differs, is
    an engine bug (it would draft from another text), not a silent stale index."""
    index = NgramIndex(max_ngram=2)
    index.extend([4, 1, 2, 9])
    index.extend([4, 1, 2, 9, 5])
    for other in ([4, 1, 2], [4, 1, 2, 9, 6, 6]):
        with pytest.raises(RuntimeError, match="does not extend"):
            index.extend(other)


def test_a_lookups_match_is_its_agreement_with_the_text_capped_and_compared_chunk_by_chunk():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        length = int(torch.randint(2, 160, (1,), generator=generator))
        text = torch.randint(0, 3, (length,), generator=generator).tolist()
        index = NgramIndex(2)
        index.extend(text)
        for end in range(1, length):
            expected = next((k for k in range(min(MAX_MATCH, end)) if text[end - 1 - k] != text[-1 - k]),
                            min(MAX_MATCH, end))
            assert index.agreement(end) == index.agreement(end, chunk=1) == expected


def test_a_lookup_drafts_what_a_scan_of_every_earlier_occurrence_finds():
    """The index (the latest end of shorter n-grams, every end of the longest, an int until it repeats; the latest
    candidates compared first, stopping at `MAX_MATCH`) against a plain scan of the text, on texts grown round by
    round: periodic ones (every candidate agrees over `MAX_MATCH` tokens) and random ones over 2-4 token ids."""
    generator = torch.Generator().manual_seed(0)

    def scan(text: list[int], max_ngram: int, min_ngram: int, count: int) -> tuple[list[int], int]:
        for n in range(min(max_ngram, len(text)), min_ngram - 1, -1):
            ends = [e for e in range(n, len(text)) if text[e - n : e] == text[-n:]][-CANDIDATES:]
            if ends:
                agreement = [next((k for k in range(min(MAX_MATCH, e)) if text[e - 1 - k] != text[-1 - k]),
                                  min(MAX_MATCH, e)) for e in ends]
                match, end = max(zip(agreement, ends))
                copied = []
                for k in range(count):
                    copied.append(text[end + k] if end + k < len(text) else copied[end + k - len(text)])
                return copied, match
        return [], 0

    texts = [[1, 2, 3] * 60, [5] * 100, list(range(7)) * 30]
    texts += [torch.randint(0, int(v), (int(n),), generator=generator).tolist()
              for v, n in zip(torch.randint(2, 5, (30,), generator=generator),
                              torch.randint(1, 200, (30,), generator=generator))]
    for text in texts:
        index = NgramIndex(4)
        for end in range(1, len(text) + 1, 7):
            index.extend(text[:end])
            assert index.continuation(2, 6) == scan(text[:end], 4, 2, 6)
            assert index.continuation(1, 3) == scan(text[:end], 4, 1, 3)


def test_a_lookup_compares_only_the_latest_occurrences_of_its_suffix():
    """A common n-gram may occur thousands of times: the lookup weighs the latest `CANDIDATES` only."""
    old_copy = [5, 6, 7, 8, 9, 1, 2]  # agrees with the text's end over 7 tokens, but too long ago
    text = old_copy + [3] + [0, 1, 2, 4] * CANDIDATES + [5, 6, 7, 8, 9, 1, 2]
    index = NgramIndex(2)
    index.extend(text)
    drafts, match = index.continuation(2, 2)
    assert (drafts, match) == ([4, 5], 2)  # the latest of the recent ones, which agree over 2 tokens (0 1 2)
    index = NgramIndex(2)
    index.extend(old_copy + [3] + [0, 1, 2, 4] * (CANDIDATES - 1) + [5, 6, 7, 8, 9, 1, 2])
    assert index.continuation(2, 2) == ([3, 0], 7)  # within the latest CANDIDATES: the old copy wins


def test_a_lookup_in_a_repeating_cycle_continues_the_cycle_past_the_texts_end():
    index = NgramIndex(max_ngram=2)
    index.extend([9, 5, 6, 7, 5, 6, 7, 5, 6])
    # "5 6" last ended before the final 7: the copy runs past the text's end into its own drafts
    assert index.continuation(min_ngram=2, count=8) == ([7, 5, 6, 7, 5, 6, 7, 5], 5)


def test_a_lookup_index_grown_round_by_round_equals_one_built_at_once():
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(0, 5, (80,), generator=generator).tolist()
    grown = NgramIndex(4)
    for end in range(1, len(text) + 1, 3):
        grown.extend(text[:end])
        at_once = NgramIndex(4)
        at_once.extend(text[:end])
        assert grown.ends == at_once.ends
        assert grown.continuation(2, 5) == at_once.continuation(2, 5)


def test_lookup_drafts_come_from_each_rows_own_text():
    source = LookupSource(block_size=4, min_ngram=2)
    source.allocate(2, 64)
    source.add(0, [REPEATING, [3, 3, 4]])
    assert source.propose([REPEATING, [3, 3, 4]]) == ([[2, 7, 3], []], [7, 0])  # REPEATING[5:] repeats [:7]
    source.move(0, 1)  # row 0 left: row 1 moved up, a new row joins
    source.add(1, [[9]])
    assert source.propose([REPEATING + [2], [9]]) == ([[7, 3, 1], []], [8, 0])


def plan_of(policy: VerifyPolicy, lookups: list[list[int]], drafter: bool = True) -> list[str]:
    return policy.plan(list(range(len(lookups))), lookups, drafter).choices


def test_the_policy_verifies_nothing_when_drafting_costs_more_than_it_keeps():
    policy = VerifyPolicy(16, costs={"narrow": 1.0, "wide": 1.2, "drafter": 0.5})
    assert plan_of(policy, [[], []]) == [BLOCK, BLOCK]  # new rows: half a block expected, worth 1.7x the cost
    for _ in range(12):  # the drafter's blocks keep nothing
        plan = policy.plan([0, 1], [[], []], True)
        policy.observe([0, 1], plan, [0, 0], 1.0, 0.5)
    plan = policy.plan([0, 1], [[], []], True)
    assert plan == RoundPlan([NOTHING, NOTHING], False, 1)


def test_the_policy_takes_the_lookup_where_it_keeps_more_and_skips_the_drafter_when_no_row_needs_it():
    policy = VerifyPolicy(16, costs={"narrow": 1.0, "wide": 1.0, "drafter": 1.0}, pooling=0.0)  # the row's own rates
    policy.row(0).block, policy.row(0).lookup = 0.2, 6.0
    assert policy.plan([0], [[1] * 10], True) == RoundPlan([LOOKUP], False, 16)  # 7 tokens for 1 s, not 7 for 2 s
    assert plan_of(policy, [[]]) == [NOTHING]  # no continuation: the block's 1.2 tokens are not worth 2 s


def test_a_tree_is_planned_for_greedy_rows_with_a_lookup_where_it_pays_and_never_for_sampled_rows():
    """Both proposals in one pass (`BOTH`, `2B - 1` columns) when a tree's extra drafts are worth its wider pass."""
    cheap = VerifyPolicy(4, costs={"narrow": 1.0, "wide": 1.0, "tree": 1.0, "drafter": 0.0})
    plan = cheap.plan([0, 1, 2], [[5, 6], [5, 6], []], True, greedy=[True, False, True], trees=True)
    assert plan == RoundPlan([BOTH, BLOCK, BLOCK], True, 7)  # a sampled row and a row without a lookup: no tree
    assert BOTH not in cheap.plan([0, 1, 2], [[5, 6], [5, 6], []], True, greedy=[True] * 3).choices  # no trees here
    dear = VerifyPolicy(4, costs={"narrow": 1.0, "wide": 1.0, "tree": 3.0, "drafter": 0.0})
    assert dear.plan([0], [[5, 6]], True, greedy=[True], trees=True) == RoundPlan([BLOCK], True, 4)


def test_a_tree_whose_branches_begin_one_with_the_other_verifies_only_the_longer():
    plan = RoundPlan([BOTH, BOTH, BOTH, LOOKUP], True, 7)
    proposal = Proposal(torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 1, 1]]), torch.tensor([3, 3, 1, 3]), None,
                        [False] * 4, [False] * 4)
    lookups = [[5, 6], [5, 9], [5, 8, 8], [1]]
    # row 0: the lookup repeats the block's start; row 1: they differ; row 2: the block (1 draft) begins the lookup
    assert untangled(plan, proposal, lookups, 4) == RoundPlan([BLOCK, BOTH, LOOKUP, LOOKUP], True, 7)
    assert untangled(RoundPlan([BOTH], True, 7), proposal, lookups, 4) == RoundPlan([BLOCK], True, 4)


def test_a_tree_teaches_both_kinds_and_what_a_tree_adds():
    policy = VerifyPolicy(4, costs={"narrow": 1.0, "wide": 1.0, "tree": 1.0, "drafter": 0.0}, pooling=0.0)
    before = policy.row(0)
    block, lookup = before.block, before.lookup  # 1.5 each
    policy.observe([0], RoundPlan([BOTH], True, 7), [3], 1.0, 0.0, [(0, 3)])
    history = policy.row(0)
    assert history.block < block and history.lookup > lookup and history.since_block == history.since_lookup == 0
    # the block was expected to keep as much (1.5 each, the block first): the tree added the lookup's 3 over its 0
    assert policy.priors[BOTH] == pytest.approx(1.0 + 0.5 * (3 - 1.0))  # its first tree: half the way


def test_a_tree_gains_what_it_kept_over_the_branch_the_plan_would_have_verified_alone():
    """A one-token lookup caps what it is expected to keep: the plan would verify the block alone (1.0 expected
    against the lookup's 1), so a tree whose block kept 2 and lookup 1 added nothing. Measured against the row's
    uncapped lookup average (3.0), it looked like one draft more, and trees were priced too high."""
    policy = VerifyPolicy(4, costs={"narrow": 1.0, "wide": 1.0, "tree": 1.0, "drafter": 0.0}, pooling=0.0)
    policy.priors[BOTH] = 0.0
    history = policy.row(0)
    history.block, history.lookup = 1.0, 3.0
    plan = policy.plan([0], [[5]], True, greedy=[True], trees=True)
    assert plan.choices == [BOTH] and plan.alone == [BLOCK]
    policy.observe([0], plan, [2], 1.0, 0.0, [(2, 1)])
    assert policy.priors[BOTH] == 0.0


def test_given_costs_that_name_no_tree_price_a_tree_as_a_wide_pass():
    """Costs given before trees existed (no "tree"): a tree costs a wide pass, as when not measured yet."""
    policy = VerifyPolicy(4, costs={"narrow": 1.0, "wide": 1.0, "drafter": 0.0})
    assert policy.cost("tree", 1) == 1.0
    assert policy.plan([0], [[5, 6]], True, greedy=[True], trees=True).choices == [BOTH]


def test_a_long_lookup_is_verified_whole_while_what_it_keeps_past_a_block_pays_for_the_wider_pass():
    """Where trees are verified, a lookup longer than a block's drafts may be verified whole in a causal pass of the
    tree's width (`RoundPlan.long`), priced per match length by how often lookups kept all `B - 1` drafts
    (`full_priors`: at first none did, so no long round is tried where lookups keep little) times what long ones then
    kept beyond (`long_priors`); its first `B - 1` drafts teach the row's lookup average as a short lookup's."""
    policy = VerifyPolicy(4, costs={"narrow": 1.0, "wide": 1.0, "tree": 1.1, "drafter": 0.5}, pooling=0.0)
    policy.row(0).block, policy.row(0).lookup = 0.0, 3.0
    found, bucket = [5, 6, 7, 5, 6, 7], match_bucket(9)

    def plan():
        return policy.plan([0], [found], True, greedy=[False], trees=True, matches=[9])

    assert plan() == RoundPlan([LOOKUP], False, 4)  # no lookup has kept a whole block yet
    policy.observe([0], plan(), [3], 1.0, 0.0)  # this one did: half of the bucket's lookups, so far
    assert policy.full_priors[bucket] == 0.5
    assert plan() == RoundPlan([LOOKUP], False, 7, long=[True])  # 4 + 0.5 x 1.5 tokens for 1.1 s beat 4 for 1 s
    assert policy.plan([0], [found], True, greedy=[False], trees=False, matches=[9]).long is None  # no trees here
    assert policy.plan([0], [found[:3]], True, greedy=[False], trees=True, matches=[9]).long is None  # one block
    policy.observe([0], plan(), [5], 1.1, 0.0)  # kept 2 past the block: the row's lookup learns 3, the pool 2
    assert policy.row(0).lookup == 3.0 and policy.long_priors[bucket] == pytest.approx(1.75)
    for _ in range(12):  # long lookups that keep nothing past the block: the short one pays more
        policy.observe([0], plan(), [3], 1.1, 0.0)
    assert plan() == RoundPlan([LOOKUP], False, 4)
    # a match of another length has its own pools, which start from the pools over every lookup
    assert policy.expected_long_lookup(3.0, found, 40) == pytest.approx(3.0 + policy.priors[FULL] * policy.priors[LONG])


def test_lookups_that_keep_little_never_make_a_long_round():
    """Sampled decoding of an uncertain target: lookups keep a draft or so, never a whole block, so their long rounds
    are never priced above the short ones, however cheap the wider pass."""
    policy = VerifyPolicy(4, costs={"narrow": 1.0, "wide": 1.0, "tree": 1.0, "drafter": 0.5})
    for _ in range(20):
        plan = policy.plan([0], [[5, 6, 7, 5, 6, 7]], True, greedy=[False], trees=True, matches=[3])
        assert plan.long is None
        policy.observe([0], plan, [1], 1.0, 0.0)


def test_lookups_that_keep_little_verify_their_first_drafts_in_a_short_round_where_its_pass_is_cheaper():
    """Sampled decoding of an uncertain target: a lookup keeps a fraction of a draft, too little for a block's
    pass (1.6 plain steps here) but enough for a short round's (`short_drafts + 1` columns, 1.1 plain steps here);
    what lookups kept of their first `short_drafts` is learnt from every verified lookup, a short round's teaching
    nothing of the drafts after them; a row whose whole lookup went unverified for `lookup_interval` rounds verifies
    it in a round of a block's width."""
    policy = VerifyPolicy(16, costs={"narrow": 1.0, "short": 1.1, "wide": 1.6}, pooling=0.0)
    assert policy.short_width() == SHORT_DRAFTS + 1
    found = [1] * 10
    policy.row(0).lookup, policy.row(0).short = 0.5, 0.4
    plan = policy.plan([0, 1], [found, []], False)
    assert plan == RoundPlan([LOOKUP, NOTHING], False, SHORT_DRAFTS + 1)  # 2.4 tokens for 1.1 s: more than 2 for 1
    policy.observe([0, 1], plan, [1, 0], 1.1, 0.0)
    history = policy.row(0)
    assert history.short == pytest.approx(0.4 + policy.smoothing * 0.6) and history.lookup == 0.5
    assert history.since_lookup == 1 and policy.priors[FULL] == 0.0  # nothing learnt of the whole lookup
    policy.row(2).lookup, policy.row(2).short = 8.0, 2.0  # lookups that keep much: a block's pass pays more
    plan = policy.plan([2], [found], False)
    assert plan == RoundPlan([LOOKUP], False, 16)
    policy.observe([2], plan, [9], 1.6, 0.0)  # a whole lookup teaches what its first drafts kept too
    assert policy.row(2).short == pytest.approx(2.0 + policy.smoothing * 1.0)
    policy.row(3).lookup = policy.row(3).short = 0.05  # keeping next to nothing, no round with drafts pays
    assert policy.plan([3], [found], False).choices == [NOTHING]
    history.since_lookup = policy.lookup_interval
    assert policy.plan([0, 1], [found, []], False) == RoundPlan([LOOKUP, NOTHING], False, 16)  # its probe
    assert VerifyPolicy(4).short_width() is None and VerifyPolicy(16, short_drafts=0).short_width() is None
    with pytest.raises(ValueError, match="short_drafts"):
        VerifyPolicy(16, short_drafts=-1)


def test_a_short_round_is_priced_as_a_plain_step_until_measured_and_never_above_a_wide_one():
    policy, found = VerifyPolicy(16, pooling=0.0), [1] * 10
    policy.row(0).lookup, policy.row(0).short = 0.5, 0.4
    for _ in range(2):  # another row measures a plain step and a lookup of a block
        policy.observe([1], RoundPlan([NOTHING], False, 1), [0], 1.0, 0.0)
        policy.observe([1], RoundPlan([LOOKUP], False, 16), [0], 2.0, 0.0)
    assert policy.cost("short", 1) == 1.0  # not measured: the narrow pass's cost, so it is tried
    plan = policy.plan([0], [found], False)
    assert plan == RoundPlan([LOOKUP], False, SHORT_DRAFTS + 1)
    for _ in range(2):
        policy.observe([0], plan, [0], 3.0, 0.0)
    assert policy.cost("short", 1) == 2.0 and policy.cost("narrow", 1) == 1.0  # a slow short pass: as a wide one
    assert VerifyPolicy(16, costs={"narrow": 1.0, "wide": 1.5}).cost("short", 1) == 1.5  # not given: never chosen


def test_a_short_round_verifies_each_lookups_first_drafts_in_its_narrow_pass():
    vocab, width = 10, SHORT_DRAFTS + 1
    plan = RoundPlan([LOOKUP, NOTHING, LOOKUP], False, width)
    lookups = [[4, 5, 6, 7, 8], [], [9, 2]]
    plan, applied = apply_plan(plan, None, lookups, vocab, True, torch.device("cpu"), 16)
    assert applied.drafts.tolist() == [[4, 5, 6], [0, 0, 0], [9, 2, 0]]
    assert applied.num_drafts.tolist() == [3, 0, 2]
    assert applied.logits.shape == (3, SHORT_DRAFTS, vocab)
    assert applied.logits[0].argmax(-1).tolist() == [4, 5, 6]  # q one-hot on the lookup's drafts


def test_a_tree_untangled_to_a_lookup_longer_than_a_block_verifies_it_whole_where_no_tree_is_left():
    proposal = Proposal(torch.tensor([[5, 6, 7], [1, 2, 3]]), torch.tensor([3, 3]), None, [False] * 2, [False] * 2)
    long_found, other = [5, 6, 7, 8, 9], [1, 4]
    assert untangled(RoundPlan([BOTH, BLOCK], True, 7), proposal, [long_found, other], 4) == RoundPlan(
        [LOOKUP, BLOCK], True, 7, long=[True, False])
    # a tree left in the round: its branches are a block wide, so the lookup verifies its first B - 1 drafts
    assert untangled(RoundPlan([BOTH, BOTH], True, 7), proposal, [long_found, other], 4) == RoundPlan(
        [LOOKUP, BOTH], True, 7)


def test_a_long_round_pads_every_rows_drafts_to_the_trees_width_and_verifies_each_lookup_whole_or_by_a_block():
    vocab = 10
    proposal = Proposal(torch.tensor([[1, 2, 3]] * 3), torch.tensor([3, 3, 3]), torch.randn(3, 3, vocab),
                        [False] * 3, [False] * 3)
    plan = RoundPlan([BLOCK, LOOKUP, LOOKUP], True, 7, long=[False, True, False])
    lookups = [[], [4, 5, 6, 7, 8], [9, 9, 9, 9]]
    plan, applied = apply_plan(plan, proposal, lookups, vocab, True, torch.device("cpu"), 4)
    assert applied.drafts.tolist() == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 0], [9, 9, 9, 0, 0, 0]]
    assert applied.num_drafts.tolist() == [3, 5, 3]
    assert torch.equal(applied.logits[0, :3], proposal.logits[0]) and applied.logits.shape == (3, 6, vocab)
    assert applied.logits[1, :5].argmax(-1).tolist() == [4, 5, 6, 7, 8]  # q one-hot on the lookup's drafts


class NoZero(LogitsProcessor):
    """Bans token 0 and fails on a context holding one: these rows' prompts, drafts and lookups never do, so only
    columns a row does not verify (zero padding) could show it one."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if (input_ids == 0).any():
            raise ValueError("a context this row never verified reached its processor")
        return scores.index_fill(-1, torch.tensor([0], device=scores.device), float("-inf"))


def test_processors_see_only_the_columns_their_row_verifies(sampling_models):
    """Rows verifying nothing in a wide round, and rows beside a tree, are not in the padding columns' contexts:
    their processors run on the columns they verify only (a processor that reads its context, here one that
    fails on the padding's token 0, ended such rows before), and every output is `generate`'s."""
    target, drafter, _ = sampling_models
    settings = RowSettings(12, logits_processor=LogitsProcessorList([NoZero()]))
    engine = SpeculativeEngine(target, BlockSource(drafter), max_rows=3, max_length=64,
                               lookup=LookupSource(4, min_ngram=2), policy=EveryChoice(4))
    prompts = [REPEATING, REPEATING[2:], REPEATING[:-3]]
    outputs = {}
    try:
        for key, prompt in enumerate(prompts):
            engine.add(key, prompt, settings)
        while len(engine):
            for outcome in engine.step():
                assert outcome.error is None, outcome.error
                outputs.setdefault(outcome.key, []).extend(outcome.added)
    finally:
        engine.close()
    assert set(engine.round_record.verified) == {NOTHING, BLOCK, LOOKUP, BOTH}
    for key, prompt in enumerate(prompts):
        reference = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                    logits_processor=LogitsProcessorList([NoZero()]))
        assert outputs[key] == reference[0, len(prompt):].tolist()


class SampledTrees(VerifyPolicy):
    """A broken policy: a tree for every row, sampled or not."""

    def plan(self, keys, lookups, drafter, greedy=None, trees=False, matches=None):
        return self.round_of([BOTH] * len(keys))


def test_an_engine_refuses_a_policy_of_another_block_size():
    """A policy plans rounds of its own width: one of another block size than the drafter's or the lookup's failed
    inside the first round's pass (a tensor-size error); the engine refuses it when it is built."""
    target = tiny_target(0)
    for source, lookup in ((BlockSource(tiny_drafter(1)), None), (None, LookupSource(4))):
        with pytest.raises(ValueError, match="policy's block size 8 differs from the verify width 4"):
            SpeculativeEngine(target, source, max_length=32, lookup=lookup, policy=VerifyPolicy(8))


def test_a_policy_choosing_a_tree_for_a_sampled_row_is_refused(sampling_models):
    """A tree's better branch is picked by greedy matching: for a sampled row it would not be exact."""
    target, drafter, _ = sampling_models
    engine = SpeculativeEngine(target, BlockSource(drafter), max_rows=1, max_length=64,
                               lookup=LookupSource(4, min_ngram=2), policy=SampledTrees(4))
    try:
        engine.add(0, EVERY_NEXT, RowSettings(4, True, logits_processor=processors(), seed=0))
        engine.step()  # its first token, from the prefill
        with pytest.raises(RuntimeError, match="both proposals for a row that samples"):
            engine.step()
    finally:
        engine.close()


def test_a_row_that_skipped_the_drafter_verifies_its_block_again_less_often_while_probes_keep_nothing():
    policy = VerifyPolicy(16, probe_every=3, costs={"narrow": 1.0, "wide": 1.0, "drafter": 5.0})
    policy.row(0).block = 0.0
    choices = []
    for _ in range(11):
        plan = policy.plan([0], [[]], True)
        policy.observe([0], plan, [0], 1.0, 5.0)
        choices.append(plan.choices[0][0])
    # probes after 3, then 6 skipped rounds (each kept nothing: the interval doubles), then 12; one that keeps
    # drafts brings it back to 3 (and the block's estimate up: it is verified again at once)
    assert "".join(choices) == "nnnbnnnnnnb" and policy.interval == 12
    policy.row(0).since_block = 12
    plan = policy.plan([0], [[]], True)
    policy.observe([0], plan, [2], 1.0, 5.0)
    assert plan.choices == [BLOCK] and policy.interval == 3


def test_a_row_in_a_hard_stretch_keeps_a_good_drafter_while_its_pooled_rate_says_it_pays():
    """Pooling: a drafter that kept 5 drafts a round over many rounds is still verified for a row whose last rounds
    kept nothing (half its estimate is the pooled rate); without pooling that row would skip it."""
    costs = {"narrow": 1.0, "wide": 1.2, "drafter": 0.5}
    for pooling, expected in ((0.5, BLOCK), (0.0, NOTHING)):
        policy = VerifyPolicy(16, costs=costs, pooling=pooling)
        for key in range(40):  # many earlier rows: 5 drafts kept a round
            policy.observe([key], RoundPlan([BLOCK], True, 16), [5], 1.2, 0.5)
        for _ in range(10):  # this row's hard stretch
            policy.observe([99], RoundPlan([BLOCK], True, 16), [0], 1.2, 0.5)
        assert plan_of_keys(policy, [99]) == [expected], pooling


def test_a_rows_first_rounds_are_priced_by_what_blocks_kept_at_the_start_of_earlier_rows():
    """Where the drafter keeps nothing in the first rounds of an answer and much later (the pydoc prompts: the target
    copies its prompt once it has begun), a new row skips the block at first and verifies it once it is as old as
    the rows whose blocks paid: blocks are pooled per row age (`age_bucket`). One pool over every round would verify
    the block from a row's first round."""
    policy = VerifyPolicy(16, costs={"narrow": 1.0, "wide": 1.2, "drafter": 0.5})
    for key in range(20):
        for age in range(20):
            policy.observe([key], RoundPlan([BLOCK], True, 16), [0 if age < 4 else 6], 1.2, 0.5)
        policy.forget(key)
    assert plan_of_keys(policy, [100]) == [NOTHING]
    for _ in range(8):  # a row that skipped the block so far, now as old as the rows whose blocks kept 6 drafts
        policy.observe([100], policy.round_of([NOTHING]), [0], 1.0, 0.0)
    assert plan_of_keys(policy, [100]) == [BLOCK]
    assert [age_bucket(rounds) for rounds in (0, 1, 2, 3, 4, 7, 8, 15, 16, 1000)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_a_process_turning_to_another_kind_of_prompt_learns_its_first_rounds_within_a_few_rows():
    """After 100 rows whose blocks kept 6 drafts in their first round, 10 rows whose first blocks kept nothing (d3d
    bench turning from HumanEval to pydoc; a server whose traffic changes): the next row skips the block at first.
    Moving by `pool_smoothing` (0.03) a round, the pool of first rounds would still be near 5 drafts."""
    policy = VerifyPolicy(16, costs={"narrow": 1.0, "wide": 1.2, "drafter": 0.5})
    for key, kept in enumerate([6] * 100 + [0] * 10):
        policy.observe([key], RoundPlan([BLOCK], True, 16), [kept], 1.2, 0.5)
        policy.forget(key)
    assert plan_of_keys(policy, [1000]) == [NOTHING]
    assert [policy.age_smoothing(bucket) for bucket in range(6)] == [0.25, 0.25, 0.125, 0.0625, 0.03125, 0.03]


def test_a_row_that_skipped_its_lookups_verifies_one_again_less_often_while_probes_keep_nothing():
    policy = VerifyPolicy(16, probe_every=4, costs={"narrow": 1.0, "wide": 2.0, "drafter": 1.0}, pooling=0.0)
    policy.row(0).lookup = 0.0  # its lookups kept nothing so far (its own average only): not worth a wide pass
    choices = []
    for _ in range(19):
        plan = policy.plan([0], [[3, 4]], False)
        policy.observe([0], plan, [0], 1.0, 0.0)
        choices.append(plan.choices[0][0])
    # a probe after 4 skipped rounds, then 8 (the first kept nothing), then 16 (so far 4 + 1 + 8 + 1 + 5 rounds)
    assert "".join(choices) == "nnnnl" + "nnnnnnnnl" + "nnnnn" and policy.lookup_interval == 16
    policy.row(0).since_lookup = 16
    plan = policy.plan([0], [[3, 4]], False)
    policy.observe([0], plan, [1], 1.0, 0.0)
    assert plan.choices == [LOOKUP] and policy.lookup_interval == 4  # a probe that kept a draft: back to 4


def test_the_policy_prices_a_lookup_by_what_lookups_of_its_match_length_kept():
    """How far the text before a found occurrence agrees with the row's own predicts what the lookup keeps (a 2-token
    match is often chance, a 20-token one a copy): lookups are pooled per match bucket (`match_bucket`)."""
    policy = VerifyPolicy(16, costs={"narrow": 1.0, "wide": 2.0, "drafter": 1.0}, pooling=1.0)
    for key in range(40):  # lookups of short matches (2-3 tokens) kept nothing, of long ones (16-31) 12 drafts
        for match, kept in ((2, 0), (20, 12)):
            policy.observe([key], policy.round_of([LOOKUP], matches=[match]), [kept], 2.0, 0.0)
    found = [[3] * 15]
    assert policy.plan([100], found, False, matches=[3]).choices == [NOTHING]  # ~0.2 drafts for 2x a plain step
    assert policy.plan([101], found, False, matches=[17]).choices == [LOOKUP]
    assert [match_bucket(m) for m in (1, 2, 3, 4, 7, 8, 15, 16, 63, 64)] == [1, 2, 2, 3, 3, 4, 4, 5, 6, 7]


def plan_of_keys(policy: VerifyPolicy, keys: list) -> list[str]:
    return policy.plan(keys, [[] for _ in keys], True).choices


def test_costs_not_measured_yet_are_taken_as_the_cheapest_they_can_be():
    policy = VerifyPolicy(16)
    assert plan_of(policy, [[]]) == [NOTHING]  # nothing measured: a plain step looks free, and measures its pass
    policy.observe([0], RoundPlan([NOTHING], False, 1), [0], 1.0, 0.0)
    assert plan_of(policy, [[]]) == [NOTHING]  # its first pass was a warm-up: a plain step still looks free
    policy.observe([0], RoundPlan([NOTHING], False, 1), [0], 1.0, 0.0)
    assert plan_of(policy, [[]]) == [BLOCK]  # a wide pass priced as a narrow one, drafting free
    policy.observe([0], RoundPlan([BLOCK], True, 16), [0], 1.0, 10.0)
    policy.observe([0], RoundPlan([BLOCK], True, 16), [0], 1.0, 10.0)
    assert policy.cost("narrow", 1) == 1.0 and policy.cost("drafter", 1) == 10.0
    assert plan_of(policy, [[]]) == [NOTHING]  # now measured: 1 token a second beats ~5 tokens per 11 seconds


class Slow(LogitsProcessor):
    """Leaves the scores as they are, taking `DELAY` seconds a call (the engine calls it once per verified position:
    it reads the context)."""

    DELAY = 0.01

    def __call__(self, input_ids, scores):
        time.sleep(self.DELAY)
        return scores


def test_the_policy_prices_a_round_by_its_verification_and_the_acceptance_after_it():
    """A row's processing runs over every column a round verifies: a wide sampled round's acceptance can cost more
    than its pass (top-p sorts each column's vocabulary), and a policy that priced only the pass verified drafts that
    did not pay at T=0.6. Each measured cost holds the processing of the columns it verified."""
    target, drafter = tiny_target(3, vocab_size=VOCAB), tiny_drafter(4, block_size=4, vocab_size=VOCAB)
    policy = EveryChoice(4)  # plain steps and blocks in turn
    engine = SpeculativeEngine(target, BlockSource(drafter), max_length=64, policy=policy)
    engine.add(0, [1, 2, 3], RowSettings(40, do_sample=True, logits_processor=LogitsProcessorList([Slow()]), seed=1))
    while len(engine):
        engine.step()
    assert policy.measured[("narrow", 1)] >= Slow.DELAY
    assert policy.measured[("wide", 1)] >= 4 * Slow.DELAY


@pytest.mark.parametrize("lookup,policy,message", [
    (0, None, "got 0"), (31, None, "1..30"), ("yes", None, "lookup must be"), (True, False, "needs the verify policy"),
    (False, "on", "policy must be"), (True, VerifyPolicy(8), "block size 8"),
])
def test_chooser_settings_of_the_wrong_kind_are_refused_in_one_line(lookup, policy, message):
    with pytest.raises(ValueError, match=message) as raised:
        make_chooser(lookup, policy, 16)
    assert "\n" not in str(raised.value)


@pytest.fixture(scope="module")
def sampling_models():
    target = tiny_target(11, vocab_size=VOCAB)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(12, vocab_size=VOCAB), block_size=4).eval()
    return target, drafter, exact_distribution(target, torch.tensor([EVERY_NEXT]))


class PeekingEngine(SpeculativeEngine):
    """A broken chooser: it runs the target on each row and replays the row's verification draw, and verifies the
    lookup's first draft only when it would be accepted (else nothing). Its plan reads this round's verification
    (token-wise, where the first draw alone decides the first draft)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, verification="token", **kwargs)

    def plan(self, keys, lookups, matches):
        last = {}  # each row's target logits after its last token: one batched pass per text length
        for length in {len(row.tokens) for row in self.rows}:
            indices = [r for r, row in enumerate(self.rows) if len(row.tokens) == length]
            logits = self.target(torch.tensor([self.rows[r].tokens for r in indices])).logits[:, -1:].float()
            last.update(zip(indices, logits))
        choices = []
        for r, (row, found) in enumerate(zip(self.rows, lookups)):
            p = row.settings.logits_processor(torch.tensor([row.tokens]), last[r]).softmax(-1)[0]
            state = row.verify_rng.get_state()
            draw = float(torch.rand(self.width - 1, generator=row.verify_rng)[0])
            row.verify_rng.set_state(state)
            choices.append(LOOKUP if found and draw < p[found[0]] else NOTHING)
        return RoundPlan(choices, False, self.width if LOOKUP in choices else 1)


def sampled_counts(target, drafter, kind: str) -> tuple[Counter, SpeculativeEngine]:
    """SAMPLES sampled rows of EVERY_NEXT through an engine with lookup, up to 64 at a time, each its own seed, beside
    one greedy row at all times (a new one when it ends), whose trees put the sampled rows in tree rounds."""
    engine_class = PeekingEngine if kind == "peeking" else SpeculativeEngine
    source = SuccessorSource(drafter, 3, 2) if kind == "async" else BlockSource(drafter)
    engine = engine_class(target, source, max_rows=65, max_length=64,
                          lookup=LookupSource(4, min_ngram=2, max_drafts=6),
                          policy=EveryChoice(4, short_drafts=1, short_every=6))
    counts, outputs, queue, greedy = Counter(), {}, list(range(SAMPLES)), 0
    try:
        engine.add(("greedy", greedy), EVERY_NEXT, RowSettings(NEW_TOKENS))
        while queue or any(isinstance(row.key, int) for row in engine.rows):
            joining = [queue.pop() for _ in range(min(len(queue), 65 - len(engine)))]  # prefilled together
            engine.add_rows([(index, EVERY_NEXT, RowSettings(NEW_TOKENS, True, logits_processor=processors(), seed=index),
                              None) for index in joining])
            for outcome in engine.step():
                assert outcome.error is None
                if not isinstance(outcome.key, int):
                    if outcome.finished:
                        greedy += 1
                        engine.add(("greedy", greedy), EVERY_NEXT, RowSettings(NEW_TOKENS))
                    continue
                outputs.setdefault(outcome.key, []).extend(outcome.added)
                if outcome.finished:
                    counts[tuple(outputs.pop(outcome.key))] += 1
    finally:
        engine.close()
    return counts, engine


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_sampled_rows_under_every_kind_of_plan_follow_the_target_distribution(sampling_models, kind):
    target, drafter, expected = sampling_models
    counts, engine = sampled_counts(target, drafter, kind)
    assert set(engine.round_record.verified) == {NOTHING, BLOCK, LOOKUP, BOTH}  # BOTH: the greedy rows' trees
    assert engine.round_record.long_lookups > 0  # and lookups verified whole, past the block
    assert engine.round_record.short_lookups > 0  # and only their first draft, in a 2-column pass
    assert max(engine.round_record.accepted) >= 2  # drafts were accepted, lookups among them
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3


def test_a_plan_that_peeks_at_the_verification_fails_the_test(sampling_models):
    target, drafter, expected = sampling_models
    counts, engine = sampled_counts(target, drafter, "peeking")
    assert engine.round_record.verified[LOOKUP] > 0
    assert chi_square_p_value(counts, expected, SAMPLES) < 1e-6


def test_a_policy_is_kept_on_its_model_per_block_size_mode_and_chooser():
    """What a policy learns serves the next call of the same model, mode and chooser; never a compiled call's costs
    an eager call's, nor a drafter-only call's acceptance a call with lookup (beside a lookup the block is verified
    where no good lookup was found: pydoc's blocks kept 10 drafts a round alone, 0.5 there, and a shared pool made
    the hybrid verify them where a plain step was faster)."""
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(0, vocab_size=16), block_size=4).eval()
    _, eager = make_chooser(False, True, 4, drafter)
    _, again = make_chooser(False, None, 4, drafter)
    _, compiled = make_chooser(False, True, 4, drafter, compiled=True)
    _, hybrid = make_chooser(True, None, 4, drafter)
    assert eager is again and compiled is not eager and hybrid is not eager
    assert make_chooser(True, True, 4, drafter)[1] is hybrid
    assert make_chooser(False, True, 4)[1] is not eager  # no holder: a new one


def test_synchronous_and_asynchronous_drafting_each_keep_their_own_costs():
    """A worker drafting beside the target slows the target's passes (a wide pass at one row 15.7 ms beside it
    against 4.6 ms alone, on a 2-core CPU) and hides most of the drafter's: what asynchronous calls measure is not
    what a synchronous call costs. Shared, they made D3D sync settle on plain steps after `d3d bench`'s async runs.
    Each kind of call (and each async budget, and the batch server like the front door) counts only its own passes."""
    target, drafter = tiny_target(0), tiny_drafter(1)
    prompt = torch.tensor([[3, 4, 5, 6]])

    def passes(policy) -> int:
        return sum(policy.pass_counts.get((kind, 1), 0) for kind in ("narrow", "wide", "tree"))

    def decode(**kwargs) -> RoundRecord:
        record = RoundRecord()
        target.generate(prompt, custom_generate=speculative_generate, drafter=drafter, max_new_tokens=12,
                        do_sample=False, round_record=record, **kwargs)
        return record

    synchronous = decode()
    (policy,) = drafter.d3d_verify_policies.values()
    verified = synchronous.rounds - 1  # the first token's round (the prefill's) runs no pass
    assert passes(policy) == verified
    for budget in ((2, 1), (3, 2)):
        asynchronous = decode(asynchronous=True, coverage=budget[0], fanout=budget[1])
        assert asynchronous.rounds > 0 and passes(policy) == verified  # not counted in the sync policy
    assert len(drafter.d3d_verify_policies) == 3  # sync, and one per async budget
    with D3DBatchServer(target, drafter, max_batch_size=1, asynchronous=True, coverage=2, fanout=1) as server:
        assert server.engine.policy is make_chooser(None, True, 4, drafter, drafting=("async", 2, 1))[1]
        assert server.engine.policy is not policy


def test_the_policy_is_on_by_default_with_a_drafter_or_a_lookup_and_off_when_asked():
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(0, vocab_size=16), block_size=4).eval()
    assert make_chooser(False, None, 4, drafter)[1] is make_chooser(False, True, 4, drafter)[1] is not None
    assert isinstance(make_chooser(True, None, None)[1], VerifyPolicy)  # lookup without a drafter
    assert make_chooser(False, False, 4, drafter) == (None, None)  # the paper's rule: the whole block every round
    assert make_chooser(False, None, None) == (None, None)  # the target alone: nothing to choose


def test_the_front_doors_decode_with_the_hybrid_by_default_and_the_drafter_alone_when_asked():
    """Beside a drafter the default chooser also weighs a prompt lookup (free drafts where the text repeats); without
    the policy (the paper's fixed block) or without a drafter (the target alone) there is no lookup unless asked."""
    target, drafter = tiny_target(0), tiny_drafter(1)
    lookup, policy = make_chooser(None, None, 4, drafter)
    assert isinstance(lookup, LookupSource) and lookup.max_drafts == tree_width(4) - 1
    assert policy is make_chooser(True, None, 4, drafter)[1]  # the hybrid's own kept policy
    assert make_chooser(None, False, 4, drafter) == (None, None)  # the paper's rule: the whole block every round
    assert make_chooser(None, None, None) == (None, None)  # the target alone
    assert make_chooser(False, None, 4, drafter)[0] is None  # the drafter alone
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    for asked, looked_up in ((None, True), (False, False)):
        record = RoundRecord()
        out = target.generate(prompt, custom_generate=speculative_generate, drafter=drafter, max_new_tokens=24,
                              do_sample=False, round_record=record, **({} if asked is None else {"lookup": asked}))
        assert torch.equal(out, target.generate(prompt, max_new_tokens=24, do_sample=False))
        assert (record.verified[LOOKUP] + record.verified[BOTH] > 0) == looked_up
    with D3DBatchServer(target, drafter, max_batch_size=1) as server:
        assert isinstance(server.engine.lookup, LookupSource)


def test_a_slow_pass_right_after_the_warm_up_does_not_set_the_cost():
    """The pass after a kind's warm-up sets its cost; a pause of the process there (10x) would make a drafter that
    pays look dear, and a pass thought dear is not chosen, so not measured again: the slower of the two is dropped."""
    policy = VerifyPolicy(16, pooling=0.0)
    keys = [0]
    for seconds in (0.01, 0.1):  # the drafter's warm-up pass, then a pause in the pass after it
        policy.observe(keys, RoundPlan([BLOCK], True, 16), [3], 0.02, seconds)
    for _ in range(2):  # plain steps: a warm-up, then one measured
        policy.observe(keys, RoundPlan([NOTHING], False, 1), [0], 0.015, 0.0)
    assert policy.cost("drafter", 1) == 0.01
    assert plan_of(policy, [[]]) == [BLOCK]  # ~4 tokens per 0.03 s beat 1 per 0.015 s


def test_one_slow_round_does_not_make_a_drafter_that_pays_look_too_costly():
    """A pause of the process during one drafting pass (100x its cost) moves the estimate by at most `smoothing`
    times the estimate: the policy keeps the block, which it would skip (and stop re-measuring) if the pause counted
    in full."""
    policy = VerifyPolicy(16, pooling=0.0)
    keys = [0]
    for seconds in (0.01, 0.01, 1.0):  # drafter passes: two ordinary ones, then one 100x slower
        plan = RoundPlan([BLOCK], True, 16)
        policy.observe(keys, plan, [3], 0.02, seconds)
    for _ in range(2):  # plain steps: a warm-up, then one measured
        policy.observe(keys, RoundPlan([NOTHING], False, 1), [0], 0.015, 0.0)
    assert policy.cost("drafter", 1) <= 0.01 * (1 + policy.smoothing) + 1e-12
    assert plan_of(policy, [[]]) == [BLOCK]  # ~4 tokens per 0.03 s beat 1 per 0.015 s


def test_one_slow_plain_step_does_not_make_every_round_draft():
    """The first narrow rounds measured during a pause (50x a wide one) would make drafting look worth it for good
    (a narrow pass that is never chosen is never measured again): a narrow pass counts as no dearer than a wide one,
    so the policy still skips a drafter that keeps nothing."""
    policy = VerifyPolicy(16)
    for _ in range(40):  # blocks that keep nothing: the drafter's expected gain falls towards 0
        policy.observe([0], RoundPlan([BLOCK], True, 16), [0], 0.006, 0.004)
    for _ in range(2):  # a plain step's warm-up and the step after it, both during a pause
        policy.observe([0], RoundPlan([NOTHING], False, 1), [0], 0.3, 0.0)
    assert policy.cost("narrow", 1) == policy.cost("wide", 1)
    assert plan_of(policy, [[]]) == [NOTHING]  # 1 token per 6 ms beats ~1.1 per 10 ms
    alone = VerifyPolicy(16)  # a narrow pass measured before any wide one (a lookup that found nothing) is itself
    for _ in range(2):
        alone.observe([0], RoundPlan([NOTHING], False, 1), [0], 2.5, 0.0)
    assert alone.cost("narrow", 1) == alone.cost("wide", 1) == 2.5


def test_a_spell_of_a_slower_machine_does_not_stick_to_a_pass_chosen_rarely():
    """Sampled decoding: plain steps are measured every round, a block's pass only now and then. One measured during a
    spell when every pass ran 2x slower (another process's burst) would, kept in seconds, price that pass 1.25x for
    good (it is then chosen less, so measured less) and skip lookups that pay; kept relative to the plain step's level
    (`levels`), its cost comes back with the plain step's when the spell ends."""
    policy = VerifyPolicy(16, pooling=0.0, short_drafts=0)
    policy.row(0).lookup = 0.6  # 1.6 tokens for 1.5 plain steps' time: worth a block's pass
    for _ in range(2):
        policy.observe([1], RoundPlan([NOTHING], False, 1), [0], 1.0, 0.0)
        policy.observe([1], RoundPlan([LOOKUP], False, 16), [0], 1.5, 0.0)
    for _ in range(20):  # the spell: plain steps take 2 s
        policy.observe([1], RoundPlan([NOTHING], False, 1), [0], 2.0, 0.0)
    policy.observe([1], RoundPlan([LOOKUP], False, 16), [0], 3.0, 0.0)  # and a block's pass 3 s
    for _ in range(20):  # after it
        policy.observe([1], RoundPlan([NOTHING], False, 1), [0], 1.0, 0.0)
    assert policy.cost("narrow", 1) == pytest.approx(1.0, rel=0.01)
    assert policy.cost("wide", 1) == pytest.approx(1.5, rel=0.01)
    assert policy.plan([0], [[1] * 10], False).choices == [LOOKUP]


def test_a_slow_first_pass_of_a_kind_does_not_set_its_cost():
    """The first pass of each kind at a batch size pays one-time costs (a compile, the first use of kernels and
    buffers): counted in full, a first wide pass and drafter pass 1000x their cost make drafting look dear, and a
    policy that then skips them re-measures them only on its probes. The first pass is a warm-up: the next replaces
    it, and until then the kind counts as not measured."""
    policy, seen, choices = VerifyPolicy(16, pooling=0.0), set(), Counter()
    seconds, first = {"narrow": 0.010, "wide": 0.012, "drafter": 0.005}, {"narrow": 0.010, "wide": 12.0, "drafter": 5.0}
    for _ in range(48):
        plan = policy.plan([0], [[]], True)
        kinds = ["wide" if plan.width > 1 else "narrow"] + (["drafter"] if plan.drafter else [])
        taken = {kind: (seconds if kind in seen else first)[kind] for kind in kinds}
        policy.observe([0], plan, [5 if plan.drafter else 0], taken[kinds[0]], taken.get("drafter", 0.0))
        seen |= set(kinds)
        choices[plan.choices[0]] += 1
    assert policy.cost("wide", 1) == 0.012 and policy.cost("drafter", 1) == 0.005
    assert choices[BLOCK] >= 44  # 6 tokens per 17 ms beat 1 per 10 ms: every round drafts once it is measured


def test_the_policy_measures_plain_steps_and_skips_drafting_where_a_batch_makes_wide_rounds_dear():
    """16 rows whose blocks keep 2.7 drafts each, on a device where a wide round with its drafter pass costs 4.5
    plain steps (a CPU at 16 rows): plain steps keep more tokens per second (16 per 10 ms against 59 per 45 ms). The
    policy must measure a plain step to know it (priced as a wide pass until measured, it never was), then verify
    nothing but its probes."""
    policy, keys = VerifyPolicy(16), list(range(16))
    seconds = {"narrow": 0.010, "wide": 0.035, "drafter": 0.010}
    choices = Counter()
    for _ in range(64):
        plan = policy.plan(keys, [[] for _ in keys], True)
        wide = plan.width > 1
        policy.observe(keys, plan, [2.7 if choice == BLOCK else 0 for choice in plan.choices],
                       seconds["wide" if wide else "narrow"], seconds["drafter"] if plan.drafter else 0.0)
        choices[plan.choices[0]] += 1
    assert policy.cost("narrow", 16) == seconds["narrow"]
    assert choices[NOTHING] > 3 * choices[BLOCK]


def test_each_verify_width_is_one_kind_of_pass_and_no_other_width_is_priced():
    """The widths a plan verifies (`verify_width`) and the kinds of pass the policy prices are one rule: 1 column a
    narrow pass, a short round's width a short one, `B` a wide one, `2B - 1` a tree; a pass of any other width is an
    engine bug, not a tree."""
    for block_size in (2, 4, 16):
        kinds = [pass_kind(verify_width(choices, block_size), block_size)
                 for choices in ([NOTHING], [BLOCK, NOTHING], [LOOKUP], [BOTH, BLOCK])]
        assert kinds == ["narrow", "wide", "wide", "tree"]
        short = VerifyPolicy(block_size).short_width()
        if short is not None:  # a short round's lookups; a block beside them makes the round a block wide
            assert [pass_kind(verify_width(choices, block_size, short=short), block_size, short)
                    for choices in ([LOOKUP, NOTHING], [LOOKUP, BLOCK], [NOTHING])] == ["short", "wide", "narrow"]
    with pytest.raises(RuntimeError, match="8 columns"):
        pass_kind(8, 16)


def test_drafting_is_priced_without_the_drafters_prefill_of_rows_that_joined():
    """A row's first block round first prefills its drafter context (`sources_d3d.catch_up`); the policy learns the
    drafter's cost from that round without the prefill (its seconds, `Proposal.caught_up_seconds`, taken off what the
    target waited for), neither skipping the round (a policy whose block rounds all follow joins would never learn
    what drafting costs) nor counting the prefill as drafting (a drafter that pays would look dear after every
    join)."""
    target = tiny_target(13, vocab_size=VOCAB)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(14, vocab_size=VOCAB), block_size=4).eval()
    policy = EveryChoice(4)  # row 0 verifies the drafter's block in round 1
    engine = SpeculativeEngine(target, BlockSource(drafter), max_rows=1, max_length=400, policy=policy)
    engine.add(0, torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(0)).tolist(), RowSettings(4))
    engine.step()  # its first token, from the prefill
    outcomes = engine.step()
    assert outcomes[0].verified == BLOCK and policy.pass_counts[("drafter", 1)] == 1
    _, timing = engine.round_record.history[-1]
    assert 0.0 < policy.measured[("drafter", 1)] < timing.exposed_draft
    engine.close()
