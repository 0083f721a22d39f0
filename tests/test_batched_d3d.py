"""Batched speculative decoding (`batched_d3d`): every row equals the target decoding it alone (greedy) or follows
the target's distribution (sampling), with mixed lengths, early EOS, rows joining mid-run, cancellation and failures."""

import itertools
import threading
from collections import Counter

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicCache

from conftest import always_predicts, run_without_project, tiny_target
from distribution import NEW_TOKENS, PROMPT, SAMPLES, VOCAB, chi_square_p_value, exact_distribution, processors
from modeling_d3d import D3DAsyncBatchDecoder, D3DBatchDecoder, D3DForBlockDiffusion, RowSettings
from modeling_d3d.batched_d3d import compact, join_rows, rejection_sample, successor_pass

DECODERS = {"sync": D3DBatchDecoder, "async": D3DAsyncBatchDecoder}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pair(seed: int, block_size: int, vocab_size: int, **kwargs):
    target = tiny_target(seed, vocab_size=vocab_size, **kwargs)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(seed, vocab_size=vocab_size), block_size=block_size)
    return target, drafter.eval()


def left_pad(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :], mask[i, width - len(prompt) :] = prompt, 1
    return ids, mask


def alone(target, prompt: list[int] | torch.Tensor, max_new_tokens: int, **kwargs) -> list[int]:
    prompt = torch.as_tensor(prompt).reshape(1, -1)
    out = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, prompt.shape[1] :].tolist()


def drive(decoder: D3DBatchDecoder, outputs: dict, rounds: int | None = None) -> dict:
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
                                     asynchronous=asynchronous)
        assert out.shape == (len(prompts), ids.shape[1] + 23)
        for row, prompt in enumerate(prompts):
            assert out[row, ids.shape[1] :].tolist() == alone(target, prompt, 23), (vocab, block, seed, row)
        stats = drafter.batch_stats
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
                                 temperature=0.5)
    for row, prompt in enumerate(prompts):
        assert out[row, ids.shape[1] :].tolist() == alone(target, prompt, 20)
    assert max(drafter.batch_stats.accepted) >= 2


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


def test_a_row_stopping_at_eos_leaves_the_batch_at_once():
    target, drafter = pair(0, 4, 96)
    always_predicts(target, 7)
    always_predicts(drafter, 7)
    decoder = D3DBatchDecoder(target, drafter)
    decoder.add("stops", [1, 2, 3], RowSettings(max_new_tokens=40, eos_token_ids=frozenset({7})))
    decoder.add("runs", [4, 5], RowSettings(max_new_tokens=9))
    first = {o.key: o for o in decoder.step()}
    assert first["stops"].added == [7] and first["stops"].finished
    assert first["runs"].added == [7, 7, 7, 7] and not first["runs"].finished
    assert [row.key for row in decoder.rows] == ["runs"]
    outputs = {"runs": first["runs"].added}
    drive(decoder, outputs)
    assert outputs["runs"] == [7] * 9 and decoder.stats.accepted == {1: 2, 4: 2}


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
    decoder = D3DBatchDecoder(target, drafter)
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
    prefills = [(1, len(p) - 1) for p in prompts.values() if len(p) > 1]
    rounds = [shape for shape in target_shapes.shapes if shape not in prefills]
    assert all(width == 16 for _, width in rounds)  # after its prefill a row costs one block per round, nothing more
    assert sum(rows for rows, _ in rounds) == decoder.stats.row_rounds
    drafts = [shape for shape in drafter_shapes.shapes if shape not in prefills]
    assert len(drafts) == decoder.stats.rounds and all(width <= 2 * 16 for _, width in drafts)


def test_removing_a_row_leaves_the_others_unchanged_greedy_and_sampled():
    target, drafter = pair(2, 6, 12)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 12, (n,), generator=generator).tolist() for n in (4, 17, 9, 2)]

    def run(cancel: bool) -> dict:
        decoder = D3DBatchDecoder(target, drafter)
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
                raise RuntimeError("injected drafting failure")
        return scores


@pytest.mark.parametrize("kind", DECODERS)
def test_a_failing_row_ends_with_its_error_and_the_others_finish(kind):
    target, drafter = pair(0, 4, 12)
    prompts = {0: [1, 2, 3], 1: [4, 5, 6, 7, 8], 2: [9]}
    decoder = DECODERS[kind](target, drafter)
    for key, prompt in prompts.items():
        failing = LogitsProcessorList([FailsAfter(3)]) if key == 1 else LogitsProcessorList()
        decoder.add(key, prompt, RowSettings(20, logits_processor=failing))
    outputs = {}
    errors = drive(decoder, outputs)
    assert list(errors) == [1] and "injected" in str(errors[1])
    for key in (0, 2):
        assert outputs[key] == alone(target, prompts[key], 20)


def test_a_failing_batched_pass_raises_and_reset_recovers():
    target, drafter = pair(0, 4, 12)
    decoder = D3DBatchDecoder(target, drafter)
    decoder.add(0, [1, 2, 3], RowSettings(10))
    def explode(*_):
        raise RuntimeError("boom")

    handle = drafter.model.layers[1].register_forward_pre_hook(explode)
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
    batching), each with its own seed: per prompt, a chi-square test against the exact distribution."""
    target, drafter = sampling_models
    prompts = {"short": PROMPT[0].tolist(), "long": [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 7]}
    prompts = {name: prompts[name] for name in names}
    counts = {name: Counter() for name in prompts}
    queue = [(name, index) for index in range(SAMPLES) for name in prompts]
    decoder, outputs = DECODERS[kind](target, drafter), {}
    while queue or len(decoder):
        while queue and len(decoder) < 64:
            name, index = queue.pop()
            decoder.add((name, index), prompts[name], RowSettings(NEW_TOKENS, True, logits_processor=processors(),
                                                                   seed=index * 2 + (name == "long")))
        for outcome in decoder.step():
            assert outcome.error is None
            outputs.setdefault(outcome.key, []).extend(outcome.added)
            if outcome.finished:
                counts[outcome.key[0]][tuple(outputs.pop(outcome.key))] += 1
    assert 1 in decoder.stats.accepted and max(decoder.stats.accepted) >= 2
    assert kind == "sync" or 0 < decoder.stats.cache_hits < decoder.stats.lookups  # async rows used prepared branches
    for name, prompt in prompts.items():
        expected = exact_distribution(target, torch.tensor([prompt]))
        assert chi_square_p_value(counts[name], expected, SAMPLES) > 1e-3, name


def test_rejection_sample_draws_from_p_and_fails_when_the_drafts_do_not_come_from_q():
    """The acceptance rule alone: the first token is distributed as p whatever q is, provided the drafts were drawn
    from q; drafts drawn from another distribution break it (so the per-row test above can fail)."""
    rng = torch.Generator().manual_seed(0)
    p_logits, q_logits, other = (torch.randn(n, VOCAB, generator=rng) for n in (3, 2, 2))
    honest, broken = Counter(), Counter()
    for _ in range(SAMPLES):
        drafts = torch.multinomial(q_logits.softmax(-1), 1, generator=rng)[:, 0]
        honest[tuple(rejection_sample(drafts, q_logits, p_logits, rng)[:1])] += 1
        drafts = torch.multinomial(other.softmax(-1), 1, generator=rng)[:, 0]
        broken[tuple(rejection_sample(drafts, q_logits, p_logits, rng)[:1])] += 1
    expected = {(token,): probability for token, probability in enumerate(p_logits[0].softmax(-1).tolist())}
    assert chi_square_p_value(honest, expected, SAMPLES) > 1e-3
    assert chi_square_p_value(broken, expected, SAMPLES) < 1e-6


@pytest.mark.parametrize("coverage,fanout", [(4, 2), (1, 2), (3, 0), (2, 3)])
def test_each_successor_branch_of_each_row_equals_block_drafting_from_its_own_prefix(coverage, fanout):
    """The packed, ragged successor pass: rows of different lengths, different cached prefixes and draft counts."""
    _, drafter = pair(3, 5, 96)
    generator = torch.Generator().manual_seed(coverage * 10 + fanout)
    contexts = [torch.randint(0, 96, (n,), generator=generator).tolist() for n in (6, 13, 2)]
    cached = [5, 9, 0]
    cache, valid = DynamicCache(config=drafter.config), torch.zeros(0, 0, dtype=torch.bool)
    for context, start in zip(contexts, cached):
        row_cache = DynamicCache(config=drafter.config)
        if start:
            drafter(input_ids=torch.tensor([context[:start]]), past_key_values=row_cache, use_cache=True)
        valid = join_rows(cache, valid, row_cache, torch.ones(1, start, dtype=torch.bool))
    blocks = [drafter.draft_block(torch.tensor([context])) for context in contexts]
    drafts = [blocks[0].tokens[0], blocks[1].tokens[0, :2], blocks[2].tokens[0]]  # ragged: as after a branch hit
    logits = [blocks[0].logits[0], blocks[1].logits[0, :2], blocks[2].logits[0]]
    valid, branches = successor_pass(drafter, cache, valid, contexts, cached, drafts, logits, coverage, fanout,
                                     [(LogitsProcessorList(), False, None)] * 3)
    assert valid.sum(1).tolist() == [len(c) + len(d) for c, d in zip(contexts, drafts)]
    for context, row_drafts, prepared in zip(contexts, drafts, branches):
        listed = row_drafts.tolist()
        assert len(prepared) == min(coverage - 1, len(listed)) * fanout + 1
        for key, (tokens, branch_logits) in prepared.items():
            full = len(key) == len(listed) + 1 and list(key[:-1]) == listed
            alone = drafter.draft_block(torch.tensor([context + (listed if full else list(key))]))
            expected_tokens, expected_logits = (alone.tokens[0, 1:], alone.logits[0, 1:]) if full else (alone.tokens[0], alone.logits[0])
            if full:
                assert key[-1] == alone.tokens[0, 0].item()
            assert torch.equal(tokens, expected_tokens), key
            torch.testing.assert_close(branch_logits, expected_logits, atol=1e-4, rtol=0)


def test_asynchronous_rows_joining_and_stopping_match_the_target_alone_and_hit_branches():
    compared, hits, lookups = 0, 0, 0
    for (vocab, block, coverage, fanout), eos in itertools.product([(6, 4, 4, 2), (8, 16, 12, 2), (12, 5, 2, 3)], [None, 2]):
        target, drafter = pair(1, block, vocab)
        generator = torch.Generator().manual_seed(vocab + block)
        prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (1, 3, 9, 17, 5)]
        eos_ids = frozenset() if eos is None else frozenset({eos})
        decoder = D3DAsyncBatchDecoder(target, drafter, coverage, fanout)
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
        hits, lookups = hits + decoder.stats.cache_hits, lookups + decoder.stats.lookups
    assert compared == 30 and 0 < hits < lookups  # both hits and misses happened


def test_compact_and_join_keep_each_rows_valid_columns_in_order():
    cache = DynamicCache(ddp_cache_data=[(torch.arange(12.0).reshape(2, 1, 6, 1), -torch.arange(12.0).reshape(2, 1, 6, 1))])
    valid = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    valid = compact(cache, valid)
    assert valid.tolist() == [[False, True, True, True], [True, True, True, True]]
    assert cache.layers[0].keys[:, 0, :, 0].tolist()[0][1:] == [1.0, 2.0, 4.0]
    assert cache.layers[0].keys[:, 0, :, 0].tolist()[1] == [6.0, 7.0, 8.0, 9.0]
    other = DynamicCache(ddp_cache_data=[(torch.full((1, 1, 5, 1), 50.0), torch.full((1, 1, 5, 1), -50.0))])
    valid = join_rows(cache, valid, other, torch.ones(1, 5, dtype=torch.bool))
    assert valid.shape == (3, 5) and valid.sum(1).tolist() == [3, 4, 5]
    assert cache.layers[0].keys[2, 0, :, 0].tolist() == [50.0] * 5 and cache.layers[0].values.shape == (3, 1, 5, 1)


def test_bad_input_is_refused_with_a_clear_error():
    target, drafter = pair(0, 4, 12)
    with pytest.raises(ValueError, match="vocabulary size"):
        D3DBatchDecoder(tiny_target(0, vocab_size=16), drafter)
    with pytest.raises(ValueError, match="full attention"):
        D3DBatchDecoder(tiny_target(0, vocab_size=12, layer_types=["sliding_attention", "full_attention"],
                                    sliding_window=8, use_sliding_window=True), drafter)
    decoder = D3DBatchDecoder(target, drafter)
    with pytest.raises(ValueError, match="at least one token"):
        decoder.add(0, [], RowSettings(5))
    with pytest.raises(ValueError, match="max_new_tokens"):
        RowSettings(0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        decoder.add(0, [1] * 500, RowSettings(20))
    decoder.add(0, [1, 2], RowSettings(5))
    with pytest.raises(ValueError, match="already"):
        decoder.add(0, [3], RowSettings(5))
    with pytest.raises(ValueError, match="drafter="):
        target.generate(torch.tensor([[1, 2]]), max_new_tokens=2,
                        custom_generate=__import__("modeling_d3d").batched_speculative_generate)


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
    assert {"batched_d3d.py", "serving_d3d.py"} <= {path.name for path in (tmp_path / "drafter").iterdir()}
    result = run_without_project(REMOTE_BATCH, str(tmp_path / "drafter"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "batched remote code ok" in result.stdout


@pytest.mark.parametrize("settings", [{"min_new_tokens": 3}, {"forced_eos_token_id": 1}, {"repetition_penalty": 1.3}])
def test_settings_a_padded_batch_would_get_wrong_are_refused(settings):
    target, drafter = pair(0, block_size=4, vocab_size=12)
    ids = torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="D3DBatchServer"):
        drafter.generate_batch(target, ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **settings)
