"""Greedy speculative decoding through `target.generate(..., assistant_model=drafter)`: token-identical output,
exact statistics, edge cases and bad input."""

import itertools

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList

from conftest import RecordingStreamer, always_predicts, tiny_target, word_tokenizer
from modeling_d3d import D3DForBlockDiffusion


def pair(target_seed: int, drafter_seed: int, block_size: int, vocab_size: int = 96, **kwargs):
    target = tiny_target(target_seed, vocab_size=vocab_size, **kwargs)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(drafter_seed, vocab_size=vocab_size), block_size=block_size)
    return target, drafter.eval()


def added_per_round(record) -> list[int]:
    return [len(outcome.added) for outcomes, _ in record.history for outcome in outcomes]


def greedy_both(target, drafter, prompt, max_new_tokens, **kwargs):
    reference = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    speculative = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter, **kwargs)
    return reference, speculative


PAIRS = [
    dict(target_seed=0, drafter_seed=0, block_size=4, vocab_size=6),  # small vocabulary: frequent partial acceptance
    dict(target_seed=1, drafter_seed=2, block_size=16, vocab_size=8),
    dict(target_seed=3, drafter_seed=4, block_size=2, vocab_size=96),
    dict(target_seed=5, drafter_seed=5, block_size=7, vocab_size=12),
]


def test_greedy_output_is_token_identical_on_many_prompts():
    generator = torch.Generator().manual_seed(0)
    accepted = []
    compared = 0
    for spec in PAIRS:
        target, drafter = pair(**spec)
        block = spec["block_size"]
        for prompt_length, max_new in itertools.product([1, block - 1, block, block + 1, 3 * block + 2], [1, 3, 17, 40]):
            prompt = torch.randint(0, spec["vocab_size"], (1, max(prompt_length, 1)), generator=generator)
            reference, speculative = greedy_both(target, drafter, prompt, max_new)
            assert torch.equal(reference, speculative), (spec, prompt_length, max_new)
            compared += 1
            if max_new == 1:  # one token: the target alone produces it, the drafter is never asked
                continue
            stats = drafter.settle(speculative)
            assert stats.new_tokens == speculative.shape[1] - prompt.shape[1] == sum(added_per_round(stats))
            assert all(1 <= n <= block for n in added_per_round(stats))
            accepted += added_per_round(stats)
    assert compared >= 50
    assert max(accepted) >= 3 and min(accepted) == 1  # both full rejections and multi-token acceptances happened


def test_eos_inside_a_block_stops_exactly_where_the_target_stops():
    eos = 2
    stopped_early = 0
    for seed in range(6):
        target, drafter = pair(seed, seed, block_size=5, vocab_size=6)
        for prompt_seed in range(4):
            prompt = torch.randint(0, 6, (1, 3 + prompt_seed), generator=torch.Generator().manual_seed(prompt_seed))
            reference, speculative = greedy_both(target, drafter, prompt, 30, eos_token_id=eos, pad_token_id=eos)
            assert torch.equal(reference, speculative)
            stopped_early += int(reference.shape[1] < prompt.shape[1] + 30)
    assert stopped_early > 0


def test_drafts_end_at_the_first_eos_as_an_assistant_models_own_generate_ends_them():
    """transformers' assisted loop before 5.23 stops only when the candidates end at the EOS (it does not crop
    accepted tokens after one): the adapter proposes no draft after the first EOS."""
    _, drafter = pair(0, 1, block_size=6)
    always_predicts(drafter, 7)
    config = GenerationConfig(eos_token_id=[9, 7], do_sample=False)
    config.is_assistant = True
    prompt = torch.tensor([[1, 2, 3]])
    output = drafter.generate(prompt, generation_config=config, logits_processor=LogitsProcessorList())
    assert output.sequences.tolist() == [[1, 2, 3, 7]] and len(output.scores) == 1
    config.eos_token_id = None
    output = drafter.generate(prompt, generation_config=config, logits_processor=LogitsProcessorList())
    assert output.sequences.tolist() == [[1, 2, 3] + [7] * 5]


def test_tau_is_block_size_when_drafter_always_agrees():
    target, drafter = pair(0, 1, block_size=4)
    always_predicts(target, 7)
    always_predicts(drafter, 7)
    prompt = torch.tensor([[1, 2, 3]])
    reference, speculative = greedy_both(target, drafter, prompt, 4 * 5)
    assert torch.equal(reference, speculative)
    stats = drafter.settle(speculative)
    assert added_per_round(stats) == [4] * 5
    assert stats.tau == 4.0 == 1 + (stats.new_tokens - stats.rounds) / stats.rounds
    assert stats.histogram(4) == [0, 0, 0, 5]


def test_tau_is_one_when_drafter_is_always_wrong():
    target, drafter = pair(0, 1, block_size=6)
    always_predicts(target, 7)
    always_predicts(drafter, 8)
    prompt = torch.tensor([[5, 6]])
    reference, speculative = greedy_both(target, drafter, prompt, 9)
    assert torch.equal(reference, speculative)
    stats = drafter.settle(speculative)
    assert added_per_round(stats) == [1] * 9 and stats.tau == 1.0
    assert stats.histogram(6) == [9, 0, 0, 0, 0, 0]
    drafted = [timing for outcomes, timing in stats.history if timing.verify > 0]
    assert len(drafted) >= 8 and all(timing.exposed_draft > 0 for timing in drafted)
    assert stats.verify_seconds > 0 and stats.exposed_draft_seconds > 0


def test_statistics_before_settle_cover_the_rounds_already_decided():
    target, drafter = pair(0, 1, block_size=4)
    always_predicts(target, 7)
    always_predicts(drafter, 7)
    speculative = target.generate(torch.tensor([[1]]), max_new_tokens=12, do_sample=False, assistant_model=drafter)
    stats = drafter.round_record
    assert stats.rounds == 2 and added_per_round(stats) == [4, 4]
    assert drafter.settle(speculative) is stats and stats.rounds == 3 and stats.new_tokens == 12



def test_streamer_receives_each_round_as_it_completes():
    target, drafter = pair(0, 0, block_size=4, vocab_size=6)
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    streamer = RecordingStreamer()
    speculative = target.generate(prompt, max_new_tokens=25, do_sample=False, assistant_model=drafter, streamer=streamer)
    stats = drafter.settle(speculative)
    assert streamer.ended and streamer.chunks[0] == prompt[0].tolist()
    assert [len(chunk) for chunk in streamer.chunks[1:]] == added_per_round(stats)
    assert sum(streamer.chunks[1:], []) == speculative[0, prompt.shape[1] :].tolist()


def test_repeated_calls_on_one_drafter_leak_no_state():
    target, drafter = pair(1, 2, block_size=16, vocab_size=8)
    prompts = [torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 1, 2]]), torch.tensor([[3]]), torch.tensor([[4, 4]])]
    first = [target.generate(p, max_new_tokens=20, do_sample=False, assistant_model=drafter) for p in prompts]
    first_stats = drafter.settle(first[-1])
    again = [target.generate(p, max_new_tokens=20, do_sample=False, assistant_model=drafter) for p in reversed(prompts)]
    for prompt, out_first, out_again in zip(prompts, first, reversed(again)):
        assert torch.equal(out_first, out_again)
        assert torch.equal(out_first, target.generate(prompt, max_new_tokens=20, do_sample=False))
    assert drafter.round_record is not first_stats
    with pytest.raises(ValueError, match="another generate call"):
        drafter.settle(first[1])
    assert drafter.settle(again[-1]).new_tokens == again[-1].shape[1] - prompts[0].shape[1]


def test_drafter_in_another_dtype_gives_identical_output():
    target, drafter = pair(0, 0, block_size=4, vocab_size=6)
    drafter = drafter.to(torch.bfloat16)
    for length in (2, 9):
        prompt = torch.randint(0, 6, (1, length), generator=torch.Generator().manual_seed(length))
        reference, speculative = greedy_both(target, drafter, prompt, 30)
        assert torch.equal(reference, speculative)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU for a second device")
def test_drafter_on_another_device_gives_identical_output():
    target, drafter = pair(0, 0, block_size=4, vocab_size=6)
    drafter = drafter.to("cuda")
    prompt = torch.randint(0, 6, (1, 7), generator=torch.Generator().manual_seed(0))
    reference, speculative = greedy_both(target, drafter, prompt, 30)
    assert torch.equal(reference, speculative)


def test_batch_larger_than_one_is_refused():
    target, drafter = pair(0, 0, block_size=4)
    with pytest.raises(ValueError, match="batch_size = 1"):
        target.generate(torch.ones(2, 3, dtype=torch.long), max_new_tokens=5, assistant_model=drafter)


def test_vocabulary_size_mismatch_is_refused():
    target = tiny_target(0, vocab_size=96)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(0, vocab_size=120), block_size=4)
    with pytest.raises(ValueError, match="Drafter vocabulary size 120 differs from the target's 96"):
        drafter.check_compatibility(target)
    with pytest.raises(ValueError, match="different tokenizers"):
        target.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=5, assistant_model=drafter)


def test_tokenizer_mismatch_is_refused():
    target, drafter = pair(0, 0, block_size=4)
    drafter.check_compatibility(target, word_tokenizer(), word_tokenizer())
    with pytest.raises(ValueError, match="tokenizer differs"):
        drafter.check_compatibility(target, word_tokenizer(), word_tokenizer(words=("other",)))


def test_mask_token_that_is_special_for_the_target_tokenizer_is_refused():
    target, drafter = pair(0, 0, block_size=4)
    drafter.config.mask_token_id = 90
    with pytest.raises(ValueError, match="mask_token_id 90 .* special"):
        drafter.check_compatibility(target, word_tokenizer())


def test_drafter_without_mask_token_is_refused():
    target, drafter = pair(0, 0, block_size=4)
    drafter.config.mask_token_id = None
    with pytest.raises(ValueError, match="no mask_token_id"):
        drafter.check_compatibility(target)
    with pytest.raises(ValueError, match="no mask_token_id"):
        target.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=5, assistant_model=drafter)


def test_trained_drafter_generation_config_is_set_for_assisted_generation():
    _, drafter = pair(0, 0, block_size=9)
    assert drafter.generation_config.num_assistant_tokens == 8
    assert drafter.generation_config.num_assistant_tokens_schedule == "constant"
    assert drafter.generation_config.assistant_confidence_threshold == 0.0


def test_stop_strings_through_transformers_assisted_loop_are_refused_not_overshot():
    """transformers' assisted loop checks stop strings once per round, after accepting a whole block: rather than
    return tokens the target alone would not, both `assistant_model=` adapters refuse them and name the engine,
    which stops where the target alone stops."""
    tokenizer = word_tokenizer(num_words=10, words=("abcdef",))
    target = tiny_target(0, vocab_size=12)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(0, vocab_size=12), block_size=4).eval()
    always_predicts(target, 7)
    always_predicts(drafter, 7)
    ids = torch.tensor([[1, 2, 3]])
    stop = dict(max_new_tokens=8, do_sample=False, stop_strings=["w7"], tokenizer=tokenizer)
    with pytest.raises(ValueError, match="generate_batch"):
        target.generate(ids, assistant_model=drafter, **stop)
    with drafter.async_generator(coverage=2, fanout=1) as generator, pytest.raises(ValueError, match="generate_batch"):
        target.generate(ids, assistant_model=generator, **stop)
    reference = target.generate(ids, **stop)
    assert reference.shape[1] == 4  # the target alone stops after its first token
    assert torch.equal(drafter.generate_batch(target, ids, **stop), reference)
