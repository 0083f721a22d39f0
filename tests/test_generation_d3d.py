"""Every front door of the engine (`generation_d3d.speculative_generate` through `target.generate`) and the
`assistant_model=` adapters give, in float32 greedy decoding, exactly the target's own `generate` output; stop
strings and custom stopping criteria stop exactly where the target alone stops, also in the middle of an accepted
block; settings the engine does not run are refused."""

import itertools

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria

from conftest import RecordingStreamer, always_predicts, left_pad, tiny_target, word_tokenizer
from modeling_d3d import D3DAssistedGenerator, D3DForBlockDiffusion, RoundRecord, speculative_generate
from policies import EveryChoice

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAIRS = [(8, 4, 0), (12, 6, 1), (10, 3, 2)]  # (vocab, block size, seed): small vocabularies, drafts get accepted
EOS = 2


def pair(vocab: int, block: int, seed: int):
    target = tiny_target(seed, vocab_size=vocab)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(seed + 10, vocab_size=vocab), block_size=block).eval()
    return target, drafter


def make_cases():
    """54 random cases plus one prompt that reaches max_position_embeddings (512): (pair index, prompt, max new
    tokens, eos or None)."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for index, (vocab, block, _) in enumerate(PAIRS):
        lengths = [1, 1, 2, block - 1, block, block + 1, 2 * block + 3, 9, 17]
        for n, (max_new, eos) in zip(lengths * 2, itertools.product([1, 2, 7, 19], [None, EOS])):
            cases.append((index, torch.randint(0, vocab, (1, n), generator=generator), max_new, eos))
        lengths = [1, 5, 12, 3, 8, 2, 14, 6, 11]
        for n, max_new, eos in zip(lengths, [2, 13, 19, 1, 9, 19, 4, 16, 19], [EOS, EOS, EOS, None, EOS, None, EOS, None, EOS]):
            cases.append((index, torch.randint(0, vocab, (1, n), generator=generator), max_new, eos))
    cases.append((0, torch.randint(0, PAIRS[0][0], (1, 505), generator=generator), 7, None))
    return cases


def eos_kwargs(eos):
    return {} if eos is None else dict(eos_token_id=eos, pad_token_id=eos)


@pytest.fixture(scope="module")
def setup():
    models = [pair(*spec) for spec in PAIRS]
    cases = make_cases()
    references = [models[i][0].generate(ids, max_new_tokens=n, do_sample=False, **eos_kwargs(eos))
                  for i, ids, n, eos in cases]
    return models, cases, references


def test_the_cases_cover_eos_inside_a_block_short_outputs_and_the_position_limit(setup):
    models, cases, references = setup
    assert len(cases) >= 50 and min(ids.shape[1] for _, ids, _, _ in cases) == 1
    assert {1, 2} <= {n for _, _, n, _ in cases}
    assert max(ids.shape[1] + n for _, ids, n, _ in cases) == 512 == models[0][0].config.max_position_embeddings
    stopped = [ref.shape[1] < ids.shape[1] + n for (_, ids, n, _), ref in zip(cases, references)]
    assert 3 <= sum(stopped) < len(cases)  # some rows stop at EOS before max_new_tokens, most do not


ENGINE_PATHS = {  # policy=False: the drafter's block every round (the default policy may skip a random drafter)
    "sync": dict(policy=False),
    "async-C1-F0": dict(asynchronous=True, coverage=1, fanout=0, policy=False),
    "async-C2-F3": dict(asynchronous=True, coverage=2, fanout=3, policy=False),
    "async-C3-F2": dict(asynchronous=True, coverage=3, fanout=2, policy=False),
    "async-Cmax-F1": dict(asynchronous=True, fanout=1, policy=False),
    "sync-default": dict(),  # the front door's default: the verify policy
    "sync-policy": dict(policy=True, lookup=True),
    "sync-every-choice": dict(lookup=True),
    "async-every-choice": dict(asynchronous=True, coverage=3, fanout=2, lookup=True),
}


@pytest.mark.parametrize("path", [*ENGINE_PATHS, "target-alone", "lookup-alone", "assistant-drafter",
                                  "assistant-generator"])
def test_greedy_output_is_token_identical_to_the_targets_own_generate(setup, path):
    models, cases, references = setup
    accepted, verified, kept, short = set(), set(), set(), 0
    for case, reference in zip(cases, references):
        index, ids, max_new, eos = case
        target, drafter = models[index]
        kwargs = dict(max_new_tokens=max_new, do_sample=False, **eos_kwargs(eos))
        if path in ENGINE_PATHS:
            settings = dict(ENGINE_PATHS[path])
            if path == "async-Cmax-F1":
                settings["coverage"] = drafter.config.block_size
            if "every-choice" in path:
                settings["policy"] = EveryChoice(drafter.config.block_size, short_every=6)
            out = target.generate(ids, custom_generate=speculative_generate, drafter=drafter, **settings, **kwargs)
            accepted |= set(drafter.round_record.accepted)
            verified |= set(drafter.round_record.verified)
            short += drafter.round_record.short_lookups
            kept |= {o.branch for outcomes, _ in drafter.round_record.history for o in outcomes if o.branch}
        elif path == "target-alone":
            record = RoundRecord()
            out = target.generate(ids, custom_generate=speculative_generate, drafter=None, round_record=record, **kwargs)
            assert set(record.accepted) == {1}
        elif path == "lookup-alone":
            record = RoundRecord()
            out = target.generate(ids, custom_generate=speculative_generate, drafter=None, lookup=True,
                                  policy=EveryChoice(16, short_every=6), round_record=record, **kwargs)
            accepted |= set(record.accepted)
            verified |= set(record.verified)
            short += record.short_lookups
        elif path == "assistant-drafter":
            out = target.generate(ids, assistant_model=drafter, **kwargs)
            if max_new > 1:
                accepted |= set(drafter.settle(out).accepted)
        else:
            with D3DAssistedGenerator(drafter, coverage=3, fanout=2) as generator:
                out = target.generate(ids, assistant_model=generator, **kwargs)
                if max_new > 1:
                    accepted |= set(generator.settle(out).accepted)
        assert torch.equal(out, reference), (path, index, ids.shape[1], max_new, eos)
    if path not in ("target-alone", "sync-default", "sync-policy"):  # the policy's choices follow measured times
        assert 1 in accepted and max(accepted) >= 3  # rejections and multi-token acceptances both happened
    if "every-choice" in path or path == "lookup-alone":
        assert verified == ({"nothing", "lookup"} if path == "lookup-alone" else {"nothing", "block", "lookup", "both"})
        assert short > 0  # lookups whose first drafts alone were verified, in a short round
    if "every-choice" in path:  # trees kept either branch: a kept lookup branch moved its cache columns
        assert kept == {"block", "lookup"}



@pytest.mark.parametrize("asynchronous,every_choice", [(False, False), (True, False), (False, True), (True, True)])
def test_every_row_of_a_left_padded_batch_is_token_identical_to_the_target_alone(setup, asynchronous, every_choice):
    """The cases grouped by model and settings into batches of rows of different lengths, left-padded; with
    `every_choice`, the rows of a round verify different kinds of proposals (`policies.EveryChoice`)."""
    models, cases, references = setup
    groups: dict = {}
    for case, reference in zip(cases, references):
        groups.setdefault((case[0], case[2], case[3]), []).append((case[1][0], reference[0, case[1].shape[1] :]))
    assert sum(len(rows) > 1 for rows in groups.values()) >= 5
    for (index, max_new, eos), rows in groups.items():
        target, drafter = models[index]
        ids, mask = left_pad([prompt for prompt, _ in rows], pad=EOS if eos is not None else 0)
        chooser = dict(lookup=True, policy=EveryChoice(drafter.config.block_size)) if every_choice else {}
        out = drafter.generate_batch(target, ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                     asynchronous=asynchronous, coverage=min(3, drafter.config.block_size), fanout=2,
                                     **chooser, **eos_kwargs(eos))
        for row, (_, reference) in enumerate(rows):
            tail = out[row, ids.shape[1] :].tolist()
            assert tail[: len(reference)] == reference.tolist(), (index, max_new, eos, row)
            assert set(tail[len(reference) :]) <= {EOS}


class StopAfterToken(StoppingCriteria):
    """A custom criterion: a row is done once its last `times` tokens are `token`."""

    def __init__(self, token: int, times: int = 1):
        self.token, self.times = token, times

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -self.times :] == self.token).all(-1)


STOP_VOCAB = 12
# w0..w8, then the word StopStringCriteria tokenizes to find each token's string, <eos> = 10, <pad> = 11
TOKENIZER = word_tokenizer(num_words=STOP_VOCAB - 2, words=("abcdef",))
WORDS = STOP_VOCAB - 3  # ids of plain words
PAD = TOKENIZER.pad_token_id


def stop_kwargs(kind: str, token: int, times: int = 1) -> dict:
    """Stop once the last `times` tokens are `token`: a stop string, or a criterion of one's own."""
    if kind == "stop_strings":
        return dict(stop_strings=[TOKENIZER.decode([token] * times)], tokenizer=TOKENIZER)
    return dict(stopping_criteria=StoppingCriteriaList([StopAfterToken(token, times)]))


def test_stop_string_criteria_passed_to_custom_generate_directly_are_lossless():
    """`target.generate(custom_generate=..., stop_strings=..., tokenizer=...)` cannot work (generate drops the
    tokenizer before calling a custom_generate callable); the same criterion passed as `stopping_criteria` does."""
    target, drafter = pair(STOP_VOCAB, 4, 0)
    always_predicts(target, 7)
    always_predicts(drafter, 7)
    ids = torch.tensor([[1, 2, 3]])
    criteria = StoppingCriteriaList([StopStringCriteria(TOKENIZER, ["w7"])])
    reference = target.generate(ids, max_new_tokens=9, do_sample=False, stopping_criteria=criteria)
    out = target.generate(ids, max_new_tokens=9, do_sample=False, stopping_criteria=criteria,
                          custom_generate=speculative_generate, drafter=drafter)
    assert torch.equal(out, reference) and out.shape[1] == 4


def run_path(path: str, target, drafter, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor, RoundRecord]:
    """The output, the prompt the target read (reduced under selective prefill) and the round record."""
    if path == "selective-prefill":
        result = drafter.selective_prefill_generate(target, ids, selective_prefill=0.5, chunk_size=4, policy=False,
                                                    **kwargs)
        return result.output, result.prompt_ids, result.round_record
    record = RoundRecord()
    # the drafter's block every round (the default policy's choices follow measured times)
    settings = dict(asynchronous=True, coverage=3, fanout=2, policy=False) if path == "async" else dict(policy=False)
    if path == "every-choice":
        settings = dict(lookup=True, policy=EveryChoice(drafter.config.block_size))
    if "stop_strings" in kwargs:  # generate drops `tokenizer=` before a custom_generate callable: the front door
        out = drafter.generate_batch(target, ids, round_record=record, **settings, **kwargs)
    else:
        out = target.generate(ids, custom_generate=speculative_generate, drafter=drafter, round_record=record,
                              **settings, **kwargs)
    return out, ids, record


STOP_PATHS = ["sync", "async", "selective-prefill", "every-choice"]


@pytest.mark.parametrize("kind", ["stop_strings", "criteria"])
@pytest.mark.parametrize("path", STOP_PATHS)
def test_a_stop_in_the_middle_of_an_accepted_block_stops_exactly_there(kind, path):
    """A drafter that always agrees: every round would accept a whole block; the stop fires at the second token (the
    first comes from the prefill), the first of the first round's block, so accepting the block and then checking
    would return B tokens instead of one."""
    target, drafter = pair(STOP_VOCAB, 4, 0)
    always_predicts(target, 7)
    always_predicts(drafter, 7)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 8, 9]])
    kwargs = dict(max_new_tokens=12, do_sample=False, **stop_kwargs(kind, 7, times=2))
    out, prompt, record = run_path(path, target, drafter, ids, **kwargs)
    reference = target.generate(prompt, **kwargs)
    assert reference.shape[1] == prompt.shape[1] + 2 and torch.equal(out, reference)
    assert record.new_tokens == 2 and record.rounds == 2  # the first token's round (the prefill's), then one
    _, _, unstopped = run_path(path, target, drafter, ids, max_new_tokens=12, do_sample=False)
    assert len(unstopped.history[1][0][0].added) == 4  # without the stop, that round adds a whole block


def stop_inside_a_round(record: RoundRecord, position: int) -> bool:
    """Whether generated token `position` was not the last token its round added (a stop there cuts the round)."""
    done = 0
    for outcomes, _ in record.history:
        added = len(outcomes[0].added)
        if done <= position < done + added - 1:
            return True
        done += added
    return False


@pytest.mark.parametrize("kind", ["stop_strings", "criteria"])
@pytest.mark.parametrize("path", STOP_PATHS + ["batched"])
def test_stop_conditions_on_random_prompts_are_token_identical_to_the_target_alone(kind, path):
    """The stop token is one the target alone generates (first occurrence), so the stop really fires; at least one
    case stops inside a round of several accepted tokens."""
    generator = torch.Generator().manual_seed(1)
    compared, inside = 0, 0
    for seed in range(3):
        target = tiny_target(seed, vocab_size=STOP_VOCAB)
        drafter = D3DForBlockDiffusion.from_backbone(target, block_size=5).eval()  # its own weights: it agrees often
        prompts = [torch.randint(0, WORDS, (n,), generator=generator) for n in (3, 7, 1, 12)]
        chosen = []
        for prompt in prompts:
            free = target.generate(prompt[None], max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
            firsts = [i for i, t in enumerate(free) if t not in free[:i] and i >= 1 and t < WORDS] or [0]
            # prefer a stop the unstopped run reaches in the middle of a round (accept-then-check overshoots there)
            _, _, record = run_path("sync", target, drafter, prompt[None], max_new_tokens=16, do_sample=False)
            inner = [i for i in firsts if stop_inside_a_round(record, i)]
            chosen.append((free[(inner or firsts)[-1]], (inner or firsts)[-1]))
        if path == "batched":
            # one stop token for the batch: the first row's; each row compared with itself decoded alone
            token = chosen[0][0]
            ids, mask = left_pad(prompts, pad=PAD)  # a pad id no prompt holds (generate infers masks from it)
            kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=PAD, **stop_kwargs(kind, token))
            out = drafter.generate_batch(target, ids, attention_mask=mask, policy=False, **kwargs)
            for row, prompt in enumerate(prompts):
                reference = target.generate(prompt[None], **kwargs)[0, len(prompt) :].tolist()
                assert out[row, ids.shape[1] : ids.shape[1] + len(reference)].tolist() == reference, (seed, row)
                compared += 1
            free = drafter.generate_batch(target, prompts[0][None], max_new_tokens=16, do_sample=False, policy=False)
            inside += stop_inside_a_round(drafter.round_record, chosen[0][1])
            continue
        for prompt, (token, position) in zip(prompts, chosen):
            kwargs = dict(max_new_tokens=16, do_sample=False, **stop_kwargs(kind, token))
            out, ids, _ = run_path(path, target, drafter, prompt[None], **kwargs)
            reference = target.generate(ids, **kwargs)
            assert torch.equal(out, reference), (path, kind, seed, prompt.tolist())
            compared += 1
            _, _, record = run_path(path, target, drafter, prompt[None], max_new_tokens=16, do_sample=False)
            inside += path != "selective-prefill" and stop_inside_a_round(record, position)
    assert compared == 12 and (inside >= 1 or path == "selective-prefill")


@pytest.mark.parametrize("settings", [dict(num_beams=3), dict(do_sample=True, num_return_sequences=2),
                                      dict(num_beams=3, num_return_sequences=2)])
def test_beam_search_and_several_sequences_per_prompt_are_refused(settings):
    target, drafter = pair(12, 4, 0)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError):
        drafter.generate_batch(target, ids, max_new_tokens=4, **settings)
    for source in (dict(drafter=drafter), dict(drafter=drafter, asynchronous=True), dict(drafter=None)):
        with pytest.raises(ValueError, match="D3D speculative decoding"):
            target.generate(ids, max_new_tokens=4, custom_generate=speculative_generate, **source, **settings)



@pytest.mark.parametrize("path", ["sync", "async", "selective-prefill"])
def test_a_streamer_through_the_front_doors_gets_the_prompt_then_each_round(path):
    target, drafter = pair(8, 4, 0)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 1, 2]])
    streamer = RecordingStreamer()
    kwargs = dict(max_new_tokens=20, do_sample=False, streamer=streamer)
    if path == "selective-prefill":
        result = drafter.selective_prefill_generate(target, ids, selective_prefill=0.5, chunk_size=4, **kwargs)
        out, prompt, record = result.output, result.prompt_ids, result.round_record
    else:
        record = RoundRecord()
        out = drafter.generate_batch(target, ids, asynchronous=path == "async", round_record=record, **kwargs)
        prompt = ids
    assert torch.equal(out, target.generate(prompt, max_new_tokens=20, do_sample=False))
    assert streamer.ended and streamer.chunks[0] == prompt[0].tolist()
    assert [len(chunk) for chunk in streamer.chunks[1:]] == [len(o.added) for r, _ in record.history for o in r]
    assert sum(streamer.chunks[1:], []) == out[0, prompt.shape[1] :].tolist()


def test_compiled_passes_are_token_identical_to_the_targets_own_generate(setup):
    """`compile=True` (inductor on a CPU): the compiled verify and drafting passes, over prompts of several lengths
    (so the compiled lengths change), give the target's own greedy output."""
    models, cases, references = setup
    target, drafter = models[0]
    compared = 0
    for (index, ids, max_new, eos), reference in zip(cases, references):
        if index != 0 or max_new < 7 or ids.shape[1] > 100:
            continue
        out = target.generate(ids, max_new_tokens=max_new, do_sample=False, custom_generate=speculative_generate,
                              drafter=drafter, compile=True, **eos_kwargs(eos))
        assert torch.equal(out, reference), ids.shape
        compared += 1
    assert compared >= 5


MIN_PATHS = ["generate_batch", "custom_generate", "async", "alone", "every-choice"]


def run_min_path(path: str, target, drafter, ids: torch.Tensor, mask: torch.Tensor, **kwargs) -> torch.Tensor:
    if path == "generate_batch":
        return drafter.generate_batch(target, ids, attention_mask=mask, **kwargs)
    if path == "every-choice":
        return drafter.generate_batch(target, ids, attention_mask=mask, lookup=True,
                                      policy=EveryChoice(drafter.config.block_size), **kwargs)
    return target.generate(ids, attention_mask=mask, custom_generate=speculative_generate,
                           drafter=None if path == "alone" else drafter, asynchronous=path == "async", **kwargs)


@pytest.mark.parametrize("setting", ["min_new_tokens", "min_length", "forced_eos_token_id"])
@pytest.mark.parametrize("path", MIN_PATHS)
def test_a_rows_minimum_length_counts_from_its_own_prompt_in_a_left_padded_batch(setting, path):
    """generate prepares `min_length = min_new_tokens + padded width` before calling a custom_generate; a short row's
    minimum must not grow by its padding. EOS falls inside the window the padding would add (after the minimum,
    before minimum + padding), so a row held off EOS by its padding runs on: token identity with the target's own
    batched float32 generate."""
    target, drafter = pair(*PAIRS[2])
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, PAIRS[2][0], (n,), generator=generator) for n in (2, 13, 7)]
    ids, mask = left_pad(prompts)
    width, minimum = ids.shape[1], 2
    unstopped = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    short = unstopped[0, width:].tolist()
    eos = next(t for j, t in enumerate(short) if j >= minimum and t not in short[:j])  # first seen after the minimum
    length = {"min_new_tokens": dict(min_new_tokens=minimum), "min_length": dict(min_length=width + minimum),
              "forced_eos_token_id": dict(min_new_tokens=minimum, forced_eos_token_id=eos)}[setting]
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=eos, **length)
    reference = target.generate(ids, attention_mask=mask, **kwargs)
    ends = reference[0, width:].tolist().index(eos) + 1
    assert minimum < ends <= minimum + width - len(prompts[0])  # the short row ends inside the padding's window
    out = run_min_path(path, target, drafter, ids, mask, **kwargs)
    assert torch.equal(out, reference), (out[:, width:], reference[:, width:])


def test_a_lookup_longer_than_a_block_verifies_that_many_drafts_and_decodes_as_generate():
    """Without a drafter, `lookup=N` verifies up to N drafts a round in one N + 1 column pass (a repeating text keeps
    more per round than a block of 16 allows), and every row is still the target's own greedy output; with a
    drafter, a lookup longer than a tree's width less the anchor is refused."""
    target = always_predicts(tiny_target(5, vocab_size=40), 7)
    generator = torch.Generator().manual_seed(3)
    ids, mask = left_pad([torch.randint(0, 40, (n,), generator=generator) for n in (5, 11)])
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=70, do_sample=False)
    record = RoundRecord()
    out = target.generate(ids, attention_mask=mask, max_new_tokens=70, do_sample=False,
                          custom_generate=speculative_generate, drafter=None, lookup=24, policy=EveryChoice(25),
                          round_record=record)
    assert torch.equal(out, reference)
    assert max(record.accepted) == 25  # 24 lookup drafts and the target's token in one round
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(6, vocab_size=40), block_size=4)
    with pytest.raises(ValueError, match="1..6 drafts"):
        target.generate(ids, attention_mask=mask, max_new_tokens=8, custom_generate=speculative_generate,
                        drafter=drafter, lookup=24)


@pytest.mark.parametrize("compile", [False, True])
def test_a_hybrids_long_lookups_verify_past_the_drafters_block_and_decode_as_generate(compile):
    """Beside a drafter of block `B`, `lookup=True` proposes up to `tree_width(B) - 1` drafts: a long round verifies
    a lookup whole in a causal pass of the tree's width (the rest of its rows their block, or nothing), so a repeating
    text keeps more than `B` tokens a round, and the rows (ragged) are still the target's own greedy
    output; compiled, the long rounds reuse the tree's graph (nothing compiles after the warm-up)."""
    target = always_predicts(tiny_target(5, vocab_size=40), 7)
    generator = torch.Generator().manual_seed(4)
    ids, mask = left_pad([torch.randint(0, 40, (n,), generator=generator) for n in (6, 12)])
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(6, vocab_size=40), block_size=4)
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    for _ in range(2):  # the second call runs on compiled passes already warm
        record = RoundRecord()
        out = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                              custom_generate=speculative_generate, drafter=drafter, lookup=True,
                              policy=EveryChoice(4), round_record=record, compile=compile)
        assert torch.equal(out, reference)
        assert record.long_lookups > 0 and max(record.accepted) == 7  # 6 lookup drafts and the target's token
    assert record.compilations == 0
