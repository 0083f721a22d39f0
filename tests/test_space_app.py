"""The Space's logic on tiny saved models (token kinds, live statistics, settings) and its streaming API endpoint."""

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from conftest import run_without_project
from cpu_pools import RELEASED, gone, needs_libgomp, pool_of_this_thread
from d3d.cli.main import build_parser
from d3d.space_app.decoding import (
    CACHE, DRAFT, LOOKUP, TARGET, Detokenizer, Settings, check_settings, compare_live, decode_live, default_settings,
    encode_prompt, engine_modules, prepare_request, token_kinds, warm_up,
)
from d3d.space_app.loading import DEFAULT_DRAFTER, DEFAULT_QUEUE_SIZE, DEFAULT_TARGET, model_sources
from d3d.space_app.prefill_view import MAX_CHUNKS, check_chunk_count, chunk_texts, kept_chunks_html, prefill_preview
from d3d.space_app.render import rounds_svg, stats_html, tokens_html
from modeling_d3d.prefill_d3d import PromptSelection, chunk_spans
from modeling_d3d.successor_d3d import DEFAULT_COVERAGE, DEFAULT_FANOUT
from space_helpers import BLOCK_SIZE, PROMPT, PageReader, greedy_text, load_tiny_models, save_tiny_models, served

pytest.importorskip("gradio", reason="the Space needs the `space` extra (gradio)")
from gradio_client import Client  # noqa: E402  (after the skip above)

from d3d.space_app.app import build_demo  # noqa: E402

# the drafter's block every round (the default verify policy's choices follow measured times)
GREEDY = Settings(block_size=BLOCK_SIZE, coverage=4, fanout=2, temperature=0.0, max_new_tokens=40, lookup=False,
                  policy=False)


@pytest.fixture(scope="module")
def space_models(tmp_path_factory):
    return load_tiny_models(tmp_path_factory.mktemp("space-models"))


def test_token_kinds_split_accepted_drafts_from_the_target_token(space_models):
    _, drafter, _ = space_models
    outcome = engine_modules(drafter)[0].RoundOutcome
    assert token_kinds(outcome(0, [5, 6, 9], False, accepted_drafts=2)) == [DRAFT, DRAFT, TARGET]
    served = outcome(0, [5, 6, 7, 8, 4], False, accepted_drafts=4, from_branch=True)
    assert token_kinds(served) == [CACHE] * 4 + [TARGET]
    assert token_kinds(outcome(0, [3], True, accepted_drafts=0, from_branch=True)) == [TARGET]
    assert token_kinds(outcome(0, [5, 6], True, accepted_drafts=2)) == [DRAFT, DRAFT]  # the length limit cut the drafts
    assert token_kinds(outcome(0, [5, 6, 1], False, accepted_drafts=2, verified="lookup")) == [LOOKUP] * 2 + [TARGET]
    tree = dict(accepted_drafts=1, verified="both", branches=(0, 1))  # a tree kept its lookup branch, or its block
    assert token_kinds(outcome(0, [5, 1], False, branch="lookup", **tree)) == [LOOKUP, TARGET]
    assert token_kinds(outcome(0, [5, 1], False, branch="block", **tree)) == [DRAFT, TARGET]


def matched_drafts(drafter, context: list[int], added: list[int], limit: int) -> int:
    """How many of `added` the drafter's own block draft for `context` (at most `limit` drafts) predicted."""
    drafts = drafter.draft_block(torch.tensor([context])).tokens[0, :limit].tolist()
    count = 0
    while count < min(len(drafts), len(added) - 1) and drafts[count] == added[count]:
        count += 1
    return count


def test_live_kinds_and_statistics_agree_with_the_engine_and_the_target(space_models):
    target, drafter, tokenizer = space_models
    prompt_ids = prepare_request(target, drafter, tokenizer, PROMPT, GREEDY)
    reference, reference_text = greedy_text(target, tokenizer, PROMPT, GREEDY.max_new_tokens)
    seen = []
    for live in decode_live(target, drafter, tokenizer, prompt_ids, GREEDY):
        seen.append((len(live.tokens), live.done))
    assert seen[-1] == (len(reference), True) and not any(done for _, done in seen[:-1])
    assert live.tokens == reference and live.text == reference_text
    record = live.round_record
    outcomes = [outcome for round_outcomes, _ in record.history for outcome in round_outcomes]
    assert live.accepted_lengths == [len(outcome.added) for outcome in outcomes] and record.rounds == len(live.rounds)
    assert live.hit_rate == pytest.approx(record.branch_hits / record.lookups)
    assert live.tau == pytest.approx(len(reference) / len(live.rounds))
    context = prompt_ids[0].tolist()
    first, *rounds = zip(live.rounds, outcomes)
    assert first[0].served == "no draft" and first[0].kinds == [TARGET]  # the first token, decided by the prefill
    context += first[0].tokens
    for round_, outcome in rounds:
        assert round_.kinds == [CACHE if outcome.from_branch else DRAFT] * outcome.accepted_drafts + [TARGET] * (
            len(round_.tokens) - outcome.accepted_drafts)
        assert round_.served == ("cache hit" if outcome.from_branch else "drafting pass")
        if not outcome.from_branch:  # a drafting pass: its accepted drafts are the drafter's block draft's own
            assert outcome.accepted_drafts == matched_drafts(drafter, context, round_.tokens, BLOCK_SIZE - 1)
        context += round_.tokens
    assert all(kinds[-1] == TARGET for kinds in (r.kinds for r in live.rounds[:-1]))
    assert {DRAFT, CACHE, TARGET} <= set(live.kinds), "these tiny models agree often enough to show every kind"


def test_compare_live_streams_the_target_alone_then_d3d_and_both_equal_greedy(space_models):
    target, drafter, tokenizer = space_models
    prompt_ids = prepare_request(target, drafter, tokenizer, PROMPT, GREEDY)
    reference, _ = greedy_text(target, tokenizer, PROMPT, GREEDY.max_new_tokens)
    updates = [(len(alone.tokens), None if d3d is None else len(d3d.tokens)) for alone, d3d in
               compare_live(target, drafter, tokenizer, prompt_ids, GREEDY)]
    alone, d3d = updates[-1]
    assert (alone, d3d) == (len(reference), len(reference))
    assert any(d is None and 0 < a < len(reference) for a, d in updates), "the target alone streams token by token"
    assert any(d is not None and 0 < d < len(reference) for _, d in updates), "D3D streams round by round"


@needs_libgomp
def test_the_thread_that_ran_a_comparison_keeps_no_cpu_worker_pool(space_models, two_torch_threads):
    """Gradio runs each request on one of its worker threads, which live on idle; the warm-up runs on the main
    thread. A pool left on any of them made the next request's target alone 2x slower on a 2-core CPU."""
    target, drafter, tokenizer = space_models
    prompt_ids = prepare_request(target, drafter, tokenizer, PROMPT, GREEDY)

    def request() -> set[int]:
        pool = pool_of_this_thread()
        for _ in compare_live(target, drafter, tokenizer, prompt_ids, GREEDY):
            pass
        return pool

    with ThreadPoolExecutor(1) as worker:  # its thread lives on, as Gradio's do
        pool = worker.submit(request).result(60)
        assert pool and gone(pool, timeout=RELEASED)


def test_the_warm_up_decodes_both_columns_at_the_page_defaults(space_models):
    """`serve` decodes the opening example both ways before the first visitor, at the settings the page opens with
    (the sliders' values), so that one-time costs do not fall on the target alone, decoded first."""
    target, drafter, tokenizer = space_models
    alone, d3d = warm_up(target, drafter, tokenizer, PROMPT)
    _, expected = greedy_text(target, tokenizer, PROMPT, 2 * BLOCK_SIZE)
    assert alone.done and d3d.done and alone.text == d3d.text == expected
    assert d3d.tau > 1, "D3D drafted during the warm-up"
    defaults = default_settings(drafter)
    assert (defaults.coverage, defaults.fanout) == (min(DEFAULT_COVERAGE, BLOCK_SIZE), DEFAULT_FANOUT)
    sliders = {c["props"].get("label"): c["props"]["value"] for c in build_demo(*space_models).config["components"]
               if c.get("type") == "slider"}
    assert (sliders["block size b"], sliders["coverage C"], sliders["fanout F"], sliders["temperature"]) == (
        defaults.block_size, defaults.coverage, defaults.fanout, defaults.temperature)


def test_an_error_while_generating_reaches_the_consumer(space_models):
    target, drafter, tokenizer = space_models

    def explode(module, args, kwargs):
        if (kwargs["input_ids"] == drafter.config.mask_token_id).any():  # a drafting pass, not a prefill
            raise RuntimeError("the drafter failed")

    prompt_ids = prepare_request(target, drafter, tokenizer, PROMPT, GREEDY)
    hook = drafter.register_forward_pre_hook(explode, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="the drafter failed"):
            list(decode_live(target, drafter, tokenizer, prompt_ids, GREEDY))
    finally:
        hook.remove()


def test_a_smaller_block_drafts_fewer_tokens_and_stays_lossless(space_models):
    target, drafter, tokenizer = space_models
    settings = Settings(block_size=3, coverage=4, fanout=2, temperature=0.0, max_new_tokens=30, lookup=False,
                        policy=False)
    prompt_ids = prepare_request(target, drafter, tokenizer, PROMPT, settings)
    *_, (alone, d3d) = compare_live(target, drafter, tokenizer, prompt_ids, settings)
    assert d3d.tokens == alone.tokens == greedy_text(target, tokenizer, PROMPT, 30)[0]
    assert max(d3d.accepted_lengths) <= 3 and len(d3d.rounds) < len(alone.rounds)
    assert all(round_.served != "no draft" for round_ in d3d.rounds[1:])  # the block every round after the first
    # token's (the prefill's)


def test_prompt_lookup_beside_the_drafter_stays_lossless_and_colours_its_tokens(space_models):
    """The hybrid on a prompt the target's greedy output repeats: the D3D column equals the target alone, and the
    rounds that verified a lookup continuation (there are some) show their accepted tokens as `lookup`."""
    target, drafter, tokenizer = space_models
    settings = Settings(block_size=BLOCK_SIZE, coverage=4, fanout=2, temperature=0.0, max_new_tokens=60, lookup=True)
    prompt_ids = prepare_request(target, drafter, tokenizer, PROMPT, settings)
    *_, (alone, d3d) = compare_live(target, drafter, tokenizer, prompt_ids, settings)
    assert d3d.tokens == alone.tokens == greedy_text(target, tokenizer, PROMPT, 60)[0]
    looked_up = [round_ for round_ in d3d.rounds if round_.served == "prompt lookup"]
    assert looked_up and all(round_.kinds[:-1] == [LOOKUP] * (len(round_.kinds) - 1) for round_ in looked_up)
    assert LOOKUP in d3d.kinds and 'data-kind="lookup"' in tokens_html(d3d, "d3d")


def test_sampling_decodes_the_requested_number_of_tokens(space_models):
    target, drafter, tokenizer = space_models
    settings = Settings(block_size=BLOCK_SIZE, coverage=2, fanout=1, temperature=0.8, max_new_tokens=25)
    prompt_ids = prepare_request(target, drafter, tokenizer, PROMPT, settings)
    *_, (alone, d3d) = compare_live(target, drafter, tokenizer, prompt_ids, settings)
    assert len(alone.tokens) == len(d3d.tokens) == 25 and d3d.text == tokenizer.decode(d3d.tokens)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"block_size": 1}, "block size must be in 2..5"),
        ({"block_size": 6}, "block size must be in 2..5"),
        ({"coverage": 0}, "coverage C must be in 1..5"),
        ({"coverage": 6}, "coverage C must be in 1..5"),
        ({"fanout": -1}, "fanout F must be in 0..8"),
        ({"temperature": -0.1}, "temperature must be in 0..2.0"),
        ({"max_new_tokens": 0}, "max new tokens must be in 1..512"),
        ({"max_new_tokens": 513}, "max new tokens must be in 1..512"),
        ({"lookup": True, "policy": False}, "prompt lookup needs the verify policy"),
    ],
)
def test_out_of_range_settings_are_refused_with_a_message(changes, message):
    settings = Settings(**{**GREEDY.__dict__, **changes})
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_settings(settings, BLOCK_SIZE)


def test_an_empty_or_too_long_prompt_is_refused(space_models):
    target, drafter, tokenizer = space_models
    for prompt in ("", "  \n "):
        with pytest.raises(ValueError, match="Enter a prompt"):
            prepare_request(target, drafter, tokenizer, prompt, GREEDY)
    too_long = " ".join(["w1"] * (target.config.max_position_embeddings - 10))
    with pytest.raises(ValueError, match="exceeds the target's 512 positions"):
        prepare_request(target, drafter, tokenizer, too_long, GREEDY)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer that splits multi-byte characters over several tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["plain"], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_detokenizer_pieces_join_to_the_decoded_text_across_split_characters():
    tokenizer = byte_tokenizer()
    ids = tokenizer("héllo € wörld ✓")["input_ids"]
    assert len(ids) > len("héllo € wörld ✓"), "multi-byte characters are split over several tokens"
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.add(token) for token in ids]
    pieces[-1] += detokenizer.finish()
    assert "".join(pieces) == tokenizer.decode(ids) == "héllo € wörld ✓"
    assert not any("\ufffd" in piece for piece in pieces)


def test_rendered_tokens_and_statistics(space_models):
    target, drafter, tokenizer = space_models
    prompt_ids = prepare_request(target, drafter, tokenizer, PROMPT, GREEDY)
    *_, (alone, d3d) = compare_live(target, drafter, tokenizer, prompt_ids, GREEDY)
    page = PageReader(tokens_html(d3d, "d3d"))
    assert [kind for kind, _ in page.spans] == d3d.kinds and page.text == d3d.text
    assert {kind for kind, _ in PageReader(tokens_html(alone, "target")).spans} == {TARGET}
    stats = PageReader(stats_html(alone, d3d)).stats
    assert stats["d3d-tokens"] == stats["target-tokens"] == str(GREEDY.max_new_tokens)
    assert stats["d3d-tau"] == f"{d3d.tau:.2f}" and stats["target-tau"] == "1.00"
    assert stats["d3d-hit-rate"] == f"{d3d.hit_rate * 100:.1f}%" and stats["target-hit-rate"] == "–"
    assert stats["d3d-speedup"] == f"{d3d.tokens_per_second / alone.tokens_per_second:.2f}x"
    assert set(PageReader(stats_html(alone, None)).stats.values()) > {"–"}
    bars = PageReader(rounds_svg(d3d, BLOCK_SIZE)).bars
    assert bars == [(len(round_.tokens), round_.served) for round_ in d3d.rounds]
    assert [added for added, _ in bars] == d3d.accepted_lengths and PageReader(rounds_svg(None, BLOCK_SIZE)).bars == []


def test_the_api_streams_updates_and_serves_concurrent_users_correctly(space_models):
    target, drafter, tokenizer = space_models
    prompts = [PROMPT, "w5 w6 w1"]
    references = [greedy_text(target, tokenizer, prompt, GREEDY.max_new_tokens)[1] for prompt in prompts]
    arguments = (GREEDY.block_size, GREEDY.coverage, GREEDY.fanout, GREEDY.temperature, GREEDY.max_new_tokens)
    with served(build_demo(target, drafter, tokenizer, concurrency_limit=2)) as url:
        client = Client(url, verbose=False)
        jobs = [client.submit(prompt, *arguments, api_name="/generate") for prompt in prompts]
        finals = [job.result(timeout=120) for job in jobs]
        for job, final, reference in zip(jobs, finals, references):
            assert PageReader(final[0]).text == PageReader(final[1]).text == reference
            stats, bars = PageReader(final[2]).stats, PageReader(final[3]).bars
            assert stats["d3d-tokens"] == str(sum(added for added, _ in bars)) and stats["d3d-rounds"] == str(len(bars))
            updates = job.outputs()
            assert len(updates) > 1
            assert any(PageReader(update[1]).text != reference for update in updates[:-1]), "an intermediate state"
        with pytest.raises(Exception, match="Enter a prompt"):
            client.predict("   ", *arguments, api_name="/generate")
        with pytest.raises(Exception, match="greater than maximum value 5"):  # the slider refuses it
            client.predict(PROMPT, 99, *arguments[1:], api_name="/generate")


def test_models_come_from_arguments_else_the_environment_else_the_quickstart_folder(monkeypatch):
    parse = build_parser().parse_args
    monkeypatch.delenv("D3D_TARGET", raising=False)
    monkeypatch.delenv("D3D_DRAFTER", raising=False)
    assert model_sources(parse(["space"])) == (DEFAULT_TARGET, DEFAULT_DRAFTER)
    monkeypatch.setenv("D3D_TARGET", "env/target")
    monkeypatch.setenv("D3D_DRAFTER", "env/drafter")
    assert model_sources(parse(["space"])) == ("env/target", "env/drafter")
    assert model_sources(parse(["space", "--target", "t", "--drafter", "d"])) == ("t", "d")


def test_the_space_runs_without_this_project_installed(tmp_path):
    """As a Space: `app.py` beside its modules, the drafter through its remote code, the project not importable."""
    target_folder, drafter_folder = save_tiny_models(tmp_path)
    space_folder = str(Path(__file__).parents[1] / "space_app")
    result = run_without_project(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        import app
        from decoding import Settings, compare_live, prepare_request
        target, drafter, tokenizer = app.load_models(sys.argv[2], sys.argv[3])
        demo = app.build_demo(target, drafter, tokenizer)
        settings = Settings(5, 4, 2, 0.0, 12)
        ids = prepare_request(target, drafter, tokenizer, "w1 w2", settings)
        *_, (alone, d3d) = compare_live(target, drafter, tokenizer, ids, settings)
        assert alone.tokens == d3d.tokens and len(d3d.tokens) == 12, (alone.tokens, d3d.tokens)
        print("space ran", type(drafter).__module__)
        """,
        space_folder, str(target_folder), str(drafter_folder), cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "space ran transformers_modules." in result.stdout



def test_the_space_runs_a_drafter_saved_with_the_names_before_the_rename(tmp_path):
    """A drafter folder saved before 2026-12-03 carries remote code that calls a prepared branch's hit `from_cache`
    and the engine's record `engine.record`, and has no `engine.rounds`: the Space still decodes with it, lossless,
    and colours its branch hits."""
    target_folder, drafter_folder = save_tiny_models(tmp_path)
    renames = [("from_branch", "from_cache"), ("branch_hits", "cache_hits"), ("engine.round_record", "engine.record"),
               ("self.round_record", "self.record"), ("def rounds(self)", "def rounds_not_yet_written(self)")]
    for path in drafter_folder.glob("*_d3d.py"):
        text = path.read_text()
        for new_name, old_name in renames:
            text = text.replace(new_name, old_name)
        path.write_text(text)
    assert "from_branch" not in (drafter_folder / "engine_d3d.py").read_text()
    space_folder = str(Path(__file__).parents[1] / "space_app")
    result = run_without_project(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        import app
        from decoding import CACHE, Settings, compare_live, prepare_request
        target, drafter, tokenizer = app.load_models(sys.argv[2], sys.argv[3])
        settings = Settings(5, 4, 2, 0.0, 24, lookup=False, policy=False)
        ids = prepare_request(target, drafter, tokenizer, "w1 w2", settings)
        *_, (alone, d3d) = compare_live(target, drafter, tokenizer, ids, settings)
        assert alone.tokens == d3d.tokens and len(d3d.tokens) == 24, (alone.tokens, d3d.tokens)
        assert d3d.hit_rate is not None and (CACHE not in d3d.kinds or d3d.hit_rate > 0), (d3d.hit_rate, d3d.kinds)
        print("old names ran", d3d.hit_rate)
        """,
        space_folder, str(target_folder), str(drafter_folder), cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "old names ran" in result.stdout

def test_the_space_shows_the_chunks_selective_prefill_keeps(space_models):
    target, drafter, tokenizer = space_models
    prompt = " ".join(f"w{i % 80}" for i in range(3, 60))
    ids = encode_prompt(tokenizer, prompt)
    selection = drafter.select_prompt_chunks(ids, 0.3, 8)
    with served(build_demo(target, drafter, tokenizer)) as url:
        client = Client(url, verbose=False)
        page = client.predict(prompt, 0.3, 8, 40, api_name="/prefill_chunks")
        with pytest.raises(Exception, match="Enter a prompt"):
            client.predict(" ", 0.3, 8, 40, api_name="/prefill_chunks")
        too_long = " ".join(["w1"] * 500)  # 500 tokens + 40 new ones: more than the target's 512 positions
        with pytest.raises(Exception, match="The prompt has 500 tokens; with 40 new tokens it exceeds"):
            client.predict(too_long, 0.3, 8, 40, api_name="/prefill_chunks")
    kept = [int(index) for index in re.findall(r'data-kept="true"[^>]*title="chunk (\d+),', page)]
    assert kept == sorted(selection.kept) and page.count('class="d3d-chunk"') == len(selection.spans)
    assert f"{selection.kept_length} of {ids.shape[1]} tokens" in page


class CountingTokenizer:
    """A real tokenizer whose `decode` counts the tokens it is given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids)


def selection_of(length: int, chunk_size: int) -> PromptSelection:
    spans = chunk_spans(length, chunk_size)
    scores = torch.linspace(0.1, 1.0, len(spans))
    return PromptSelection(spans, scores, list(range(0, len(spans), 2)) + [len(spans) - 1], 0.5, chunk_size)


@pytest.mark.parametrize("chunk_size", [1, 4])
def test_the_chunk_html_decodes_a_number_of_tokens_linear_in_the_prompt_length(chunk_size):
    tokenizer = byte_tokenizer()
    decoded = []
    for length in (300, 1200):
        ids = torch.tensor([tokenizer("é€ abc ✓ " * length)["input_ids"][:length]])
        counting = CountingTokenizer(tokenizer)
        page = kept_chunks_html(counting, ids, selection_of(length, chunk_size))
        assert page.count('class="d3d-chunk"') == len(chunk_spans(length, chunk_size))
        decoded.append(counting.decoded)
    assert decoded[0] <= 20 * 300 and decoded[1] <= 20 * 1200  # the whole prompt per chunk would be ~L^2 / chunk_size
    assert decoded[1] <= 4.5 * decoded[0]


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5])
def test_chunk_texts_join_to_the_prompt_and_keep_split_characters_whole(chunk_size):
    tokenizer = byte_tokenizer()
    ids = tokenizer("héllo € wörld ✓ ünïcode 😀 end")["input_ids"]
    texts = chunk_texts(tokenizer, ids, chunk_spans(len(ids), chunk_size))
    assert "".join(texts) == tokenizer.decode(ids) == "héllo € wörld ✓ ünïcode 😀 end"
    assert not any("\ufffd" in text for text in texts)


def test_too_many_chunks_are_refused_with_the_smallest_chunk_size_that_fits():
    check_chunk_count(MAX_CHUNKS, 1)
    check_chunk_count(4 * MAX_CHUNKS, 4)
    message = f"into {MAX_CHUNKS + 10} chunks; the preview shows at most {MAX_CHUNKS}: use a chunk size of at least 2"
    with pytest.raises(ValueError, match=message):
        check_chunk_count(MAX_CHUNKS + 10, 1)
    with pytest.raises(ValueError, match="at least 5"):
        check_chunk_count(4 * MAX_CHUNKS + 1, 4)


def test_a_preview_prompt_that_generation_would_refuse_is_refused(space_models):
    target, drafter, tokenizer = space_models
    prompt = " ".join(["w1"] * 480)
    assert 'class="d3d-chunk"' in prefill_preview(target, drafter, tokenizer, prompt, 0.3, 32, 32)
    with pytest.raises(ValueError, match="The prompt has 480 tokens; with 33 new tokens it exceeds the target's 512"):
        prefill_preview(target, drafter, tokenizer, prompt, 0.3, 32, 33)


def test_the_queue_has_a_size_limit(space_models):
    target, drafter, tokenizer = space_models
    assert build_demo(target, drafter, tokenizer)._queue.max_size == DEFAULT_QUEUE_SIZE
    assert build_demo(target, drafter, tokenizer, queue_size=3)._queue.max_size == 3
