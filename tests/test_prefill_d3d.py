"""Selective prefill: the one-MASK probe, chunk selection, and decoding on the kept chunks with a full-prompt drafter."""

import html
import re
import threading

import pytest
import torch

from transformers.cache_utils import DynamicCache

from d3d.space_app.prefill_view import kept_chunks_html
from modeling_d3d import BlockSource, RowSettings, SpeculativeEngine, d3d_generate, select_prompt_chunks, speculative_generate
from modeling_d3d.masking_d3d import block_layout
from modeling_d3d.prefill_d3d import chunk_spans, probe_token_importance

from conftest import tiny_drafter, tiny_target, word_tokenizer

NEW_TOKENS = 24


def prompt(length: int, seed: int = 0, vocab: int = 90) -> torch.LongTensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models():
    """A target and a drafter initialised from the same weights, so that drafts are often accepted."""
    return tiny_target(seed=3), tiny_drafter(seed=3, block_size=4)


def test_full_retention_is_plain_d3d_and_target_greedy(models):
    target, drafter = models
    ids = prompt(60)
    greedy = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter)
    result = d3d_generate(target, drafter, ids, selective_prefill=1.0, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(result.sequences, greedy)
    assert torch.equal(result.sequences, plain)
    assert result.selection is None and torch.equal(result.prompt_ids, ids)
    assert result.round_record.new_tokens == NEW_TOKENS


@pytest.mark.parametrize("retention", [0.1, 0.3, 0.6])
def test_reduced_output_is_the_targets_greedy_output_on_the_kept_chunks(models, retention):
    target, drafter = models
    ids = prompt(150, seed=1)
    result = d3d_generate(
        target, drafter, ids, selective_prefill=retention, chunk_size=16, max_new_tokens=NEW_TOKENS, do_sample=False
    )
    selection = result.selection
    reduced = ids[:, selection.kept_positions()]
    assert torch.equal(result.prompt_ids, reduced)
    assert reduced.shape[1] < ids.shape[1]
    assert torch.equal(result.sequences, target.generate(reduced, max_new_tokens=NEW_TOKENS, do_sample=False))
    assert result.round_record.new_tokens == NEW_TOKENS


@torch.no_grad()
def test_the_drafter_cache_holds_the_full_prompt_and_the_accepted_tokens(models):
    """Under selective prefill the engine's row reads the reduced prompt in the target and the FULL prompt in the
    drafter: the drafter's cache row equals a causal prefill of the full prompt followed by the generated tokens."""
    target, drafter = models
    ids = prompt(150, seed=1)
    reduced = select_prompt_chunks(drafter, ids, 0.3, 16).reduce(ids)
    source = BlockSource(drafter)
    engine = SpeculativeEngine(target, source, max_length=ids.shape[1] + NEW_TOKENS)
    engine.add(0, reduced[0].tolist(), RowSettings(NEW_TOKENS), drafter_prompt=ids[0].tolist())
    for _ in range(3):
        engine.step()
    row = engine.rows[0]
    committed = source.committed[0]
    assert row.drafter_context[: ids.shape[1]] == ids[0].tolist() and committed > ids.shape[1]
    expected = DynamicCache(config=drafter.config)
    drafter(input_ids=torch.tensor([row.drafter_context[:committed]]), past_key_values=expected, use_cache=True)
    for layer in range(len(drafter.model.layers)):
        torch.testing.assert_close(source.cache.keys[layer][0, :, :committed], expected.layers[layer].keys[0],
                                   atol=1e-5, rtol=1e-4)
    engine.close()


@pytest.mark.parametrize("length, chunk_size, retention", [(150, 16, 0.1), (150, 16, 0.2), (97, 10, 0.3), (40, 7, 0.5), (33, 64, 0.2)])
def test_kept_chunks_are_ordered_and_about_retention_times_length(models, length, chunk_size, retention):
    _, drafter = models
    ids = prompt(length, seed=2)
    selection = select_prompt_chunks(drafter, ids, retention, chunk_size)
    spans = selection.spans
    assert spans == chunk_spans(length, chunk_size)
    assert spans[0][0] == 0 and spans[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(end - start == chunk_size for start, end in spans[1:])
    assert selection.kept == sorted(set(selection.kept))
    assert selection.kept[-1] == len(spans) - 1  # the last chunk (the question) is always kept
    assert abs(selection.kept_length - retention * length) <= chunk_size
    assert selection.scores.shape == (len(spans),)
    assert torch.equal(selection.reduce(ids), ids[:, selection.kept_positions()])
    assert selection.kept_positions().tolist() == sorted(selection.kept_positions().tolist())


def test_probe_matches_one_uncached_eager_pass(models):
    """The cached probe (sdpa passes, MASK row from queries recomputed from the layer inputs) equals the MASK row of
    one eager pass over prompt + block; it leaves the drafter as it found it (attention backend; no hooks but the
    output-capturing ones transformers installs once for `output_hidden_states`)."""
    _, drafter = models
    ids = prompt(40, seed=4)
    backend = drafter.config._attn_implementation
    scores, cache = probe_token_importance(drafter, ids)
    assert drafter.config._attn_implementation == backend == "sdpa"
    hooks = [h for m in drafter.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
    assert all(hook.__module__ == "transformers.utils.output_capturing" for hook in hooks)
    assert cache.get_seq_length() == ids.shape[1] - 1
    length = ids.shape[1]
    block_ids, visible_prefix, position_ids = block_layout(length - 1, torch.tensor([[length - 1]]), 2)
    sequence = torch.cat([ids[:, :-1], drafter.mask_blocks(ids[:, -1:])[:, :2]], dim=1)
    previous = drafter.config._attn_implementation
    drafter.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            attentions = drafter(
                input_ids=sequence, position_ids=position_ids, block_ids=block_ids, visible_prefix=visible_prefix,
                output_attentions=True,
            ).attentions
    finally:
        drafter.config._attn_implementation = previous
    expected = torch.stack([layer[0, :, -1, :length] for layer in attentions]).mean(dim=(0, 1))
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    assert drafter.config._attn_implementation == previous


def test_the_probe_is_unaffected_by_another_thread_drafting_with_the_same_drafter(models, one_torch_thread):
    """50 selections made while another thread keeps drafting (other input) with the same drafter all equal the one
    made alone: the probe reads only its own pass."""
    _, drafter = models
    ids, other = prompt(64, seed=10), prompt(48, seed=11)
    alone = select_prompt_chunks(drafter, ids, 0.3, 8)
    stop, drafted = threading.Event(), []

    def draft_until_stopped() -> None:
        while not stop.is_set():
            drafted.append(drafter.draft_block(other).tokens)

    worker = threading.Thread(target=draft_until_stopped)
    worker.start()
    try:
        while not drafted:
            stop.wait(0.001)
        selections = [select_prompt_chunks(drafter, ids, 0.3, 8) for _ in range(50)]
    finally:
        stop.set()
        worker.join()
    assert len(drafted) > 25  # the other thread really drafted throughout (about 90 drafts here)
    assert sum(s.kept == alone.kept and torch.equal(s.scores, alone.scores) for s in selections) == 50


def needle_drafter(needle: int, layers: int = 2) -> "torch.nn.Module":
    """A drafter whose every attention head makes the MASK query look at keys of the token `needle` only.

    Weights set by hand: the residual stream stays the embedding (attention and MLP outputs zeroed); hidden feature 0
    is nonzero for `needle` only and feature 1 for the mask token; k reads feature 0 and q feature 1 into the
    slowest rotary pair of every head, so q·k is large for the needle's keys and zero for every other key.
    """
    drafter = tiny_drafter(seed=5, layers=layers)
    mask = drafter.config.mask_token_id
    head_dim = drafter.config.head_dim
    slow = head_dim // 2 - 1  # lowest rotary frequency: the needle's distance barely rotates q·k
    with torch.no_grad():
        embed = drafter.model.embed_tokens.weight
        embed[:, :2] = 0.0
        embed[needle, 0] = 5.0
        embed[mask, 1] = 5.0
        for layer in drafter.model.layers:
            attention = layer.self_attn
            attention.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            attention.q_proj.weight.zero_()
            attention.k_proj.weight.zero_()
            attention.q_proj.weight.view(-1, head_dim, embed.shape[1])[:, slow, 1] = 1.0
            attention.k_proj.weight.view(-1, head_dim, embed.shape[1])[:, slow, 0] = 1.0
            attention.q_norm.weight.fill_(10.0)
            attention.k_norm.weight.fill_(10.0)
    return drafter


@pytest.mark.parametrize("needle_position", [5, 70, 131])
def test_probe_keeps_the_chunk_holding_the_planted_answer(needle_position):
    needle, chunk_size, length = 88, 16, 160
    drafter = needle_drafter(needle)
    ids = prompt(length, seed=needle_position, vocab=80)  # ids < 80: the needle occurs only where planted
    ids[0, needle_position] = needle
    selection = select_prompt_chunks(drafter, ids, retention=0.2, chunk_size=chunk_size)
    holding = next(i for i, (start, end) in enumerate(selection.spans) if start <= needle_position < end)
    assert int(selection.scores.argmax()) == holding
    assert holding in selection.kept
    assert len(selection.kept) == 2  # the planted chunk and the last one: 32 tokens for rho L = 32

    target = tiny_target(seed=5)
    result = d3d_generate(target, drafter, ids, selective_prefill=0.2, chunk_size=chunk_size, max_new_tokens=8)
    assert needle in result.prompt_ids[0].tolist()


@pytest.mark.parametrize(
    "ids, retention, chunk_size, message",
    [
        (prompt(20), 0.0, 4, "retention"),
        (prompt(20), 1.5, 4, "retention"),
        (prompt(20), -0.2, 4, "retention"),
        (prompt(20), 0.5, 0, "chunk_size"),
        (prompt(20), 0.5, 2.5, "chunk_size"),
        (torch.cat([prompt(20), prompt(20, seed=1)]), 0.5, 4, "one prompt"),
        (torch.zeros((1, 0), dtype=torch.long), 0.5, 4, "one prompt"),
    ],
)
def test_bad_arguments_raise_a_clear_value_error(models, ids, retention, chunk_size, message):
    target, drafter = models
    with pytest.raises(ValueError, match=message):
        select_prompt_chunks(drafter, ids, retention, chunk_size)
    with pytest.raises(ValueError, match=message):
        d3d_generate(target, drafter, ids, selective_prefill=retention, chunk_size=chunk_size, max_new_tokens=4)


def test_a_drafter_prompt_that_does_not_end_with_the_targets_anchor_is_refused(models):
    target, drafter = models
    ids = prompt(64, seed=6)
    result = d3d_generate(target, drafter, ids, selective_prefill=0.25, chunk_size=8, max_new_tokens=4)
    other = result.prompt_ids.clone()
    other[0, -1] = (other[0, -1] + 1) % 90
    with pytest.raises(ValueError, match="must end with the target's last prompt token"):
        target.generate(other, custom_generate=speculative_generate, drafter=drafter, drafter_input_ids=ids,
                        max_new_tokens=4, do_sample=False)


def test_the_drafter_methods_are_the_functions(models):
    target, drafter = models
    ids = prompt(50, seed=7)
    method = drafter.select_prompt_chunks(ids, 0.3, 8)
    function = select_prompt_chunks(drafter, ids, 0.3, 8)
    assert method.kept == function.kept
    torch.testing.assert_close(method.scores, function.scores)
    generated = drafter.selective_prefill_generate(target, ids, selective_prefill=0.3, chunk_size=8, max_new_tokens=8)
    assert generated.selection.kept == function.kept
    assert torch.equal(generated.sequences, d3d_generate(target, drafter, ids, 0.3, 8, max_new_tokens=8).sequences)


def test_the_space_view_marks_exactly_the_kept_chunks(models):
    _, drafter = models
    ids = prompt(60, seed=8)
    selection = select_prompt_chunks(drafter, ids, 0.3, 8)
    page = kept_chunks_html(word_tokenizer(), ids, selection)
    assert page.count('class="d3d-chunk"') == len(selection.spans)
    assert page.count('data-kept="true"') == len(selection.kept)
    assert f"{selection.kept_length} of 60 tokens" in page
    chunk_texts = [html.unescape(text) for text in re.findall(r'class="d3d-chunk"[^>]*>(.*?)</span>', page, re.S)]
    assert "".join(chunk_texts) == word_tokenizer().decode(ids[0].tolist())  # no word run together at a boundary


def test_sampling_on_the_reduced_prompt_runs_and_records_its_rounds(models):
    target, drafter = models
    ids = prompt(120, seed=9)
    torch.manual_seed(0)
    result = d3d_generate(
        target, drafter, ids, selective_prefill=0.2, chunk_size=16, max_new_tokens=10, do_sample=True, top_k=20
    )
    assert result.new_tokens.shape == (1, 10)
    record = result.round_record
    assert record.new_tokens == 10 and sum(len(o.added) for outcomes, _ in record.history for o in outcomes) == 10
    assert result.prompt_ids.shape[1] == result.selection.kept_length < ids.shape[1]
