"""`D3DBatchServer`: concurrent submissions, streaming, cancellation, failures and bad input; every wait has a
timeout, so a hang fails the test instead of stalling the suite."""

import threading
from concurrent.futures import CancelledError

import pytest
import torch
from transformers import (LogitsProcessor, StoppingCriteria, StoppingCriteriaList, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from conftest import tiny_target, word_tokenizer
from cpu_pools import RELEASED, gone, needs_libgomp, parallel_kernel, pool_of_this_thread, task_ids
from modeling_d3d import D3DBatchServer, D3DForBlockDiffusion
from modeling_d3d.threads_d3d import CPUWorkerPools
from policies import EveryChoice

WAIT = 60


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models():
    target = tiny_target(1, vocab_size=8)
    # a drafter unlike the target: its blocks seldom begin as a lookup does, so trees of both are verified, not
    # untangled into one branch (`policy_d3d.untangled`)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(2, vocab_size=8), block_size=6).eval()
    return target, drafter


def alone(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 8, (1 + (7 * i) % 23,), generator=generator).tolist() for i in range(count)]


@pytest.mark.parametrize("asynchronous,chooser", [(False, False), (True, False), (False, True), (True, True)])
def test_concurrent_requests_stream_their_own_tokens(models, asynchronous, chooser):
    """With `chooser`, rows verify nothing, the drafter's block, a lookup or both by turns (`policies.EveryChoice`),
    every kind in every run however the requests' threads interleave (a tree in every odd round where a row has a
    lookup, and a drafter unlike the target: before, 5 of 40 runs with random delays before each submission verified
    no tree)."""
    target, drafter = models
    # without the chooser: the drafter's block every round (the default policy's choices follow measured times)
    settings = dict(lookup=True, policy=EveryChoice(drafter.config.block_size)) if chooser else dict(policy=False)
    requests = prompts(7)
    handles, chunks = [None] * len(requests), [[] for _ in requests]

    def client(index: int) -> None:
        handles[index] = server.submit(requests[index], max_new_tokens=16 + index)
        for chunk in handles[index].stream(timeout=WAIT):
            chunks[index].append(chunk)

    with drafter.batch_server(target, max_batch_size=3, asynchronous=asynchronous, **settings) as server:  # later ones join mid-run
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
        assert not any(thread.is_alive() for thread in threads)
        for index, handle in enumerate(handles):
            assert handle.result(timeout=WAIT) == alone(target, requests[index], 16 + index)
            assert sum(chunks[index], []) == handle.tokens and len(chunks[index]) == handle.rounds
        record = server.round_record
        assert record.rounds > 0 and record.new_tokens == sum(16 + i for i in range(len(requests)))
        assert (record.hit_rate is not None) == asynchronous
        # without the chooser, "nothing": the requests' first tokens, decided by their prefill
        assert set(record.verified) == ({"nothing", "block", "lookup", "both"} if chooser else {"nothing", "block"})


def test_every_scheduler_loop_advances_the_rows_it_holds_however_often_requests_join(models):
    """A join's first tokens come from its prefill, in a step of their own (no pass); the scheduler then runs a round
    for every row before it admits more, so rows in flight advance while short requests keep joining (before, a loop
    that admitted requests only reported their first tokens)."""
    target, drafter = models
    requests = prompts(9, seed=5)
    log = []
    with D3DBatchServer(target, drafter, max_batch_size=4) as server:
        engine = server.engine
        step, add_rows = engine.step, engine.add_rows

        def logged_step():
            first_tokens = bool(engine.pending)
            outcomes = step()
            log.append(("first tokens" if first_tokens else "round", len(engine)))
            return outcomes

        def logged_add_rows(rows):
            if rows:
                log.append(("join", len(rows)))
            return add_rows(rows)

        engine.step, engine.add_rows = logged_step, logged_add_rows
        with server._condition:  # all waiting before the scheduler's first loop: each loop admits some
            long = server.submit(requests[0], max_new_tokens=24)
            short = [server.submit(prompt, max_new_tokens=1) for prompt in requests[1:]]
        assert long.result(timeout=WAIT) == alone(target, requests[0], 24)
        for handle, prompt in zip(short, requests[1:]):
            assert handle.result(timeout=WAIT) == alone(target, prompt, 1)
    joins = [i for i, (kind, _) in enumerate(log) if kind == "join"]
    assert len(joins) >= 3  # the short requests joined over several loops
    for i, (kind, rows) in enumerate(log):
        if kind == "first tokens" and rows:
            assert log[i + 1][0] == "round", log


def test_a_finished_stream_can_be_read_again_and_bad_requests_are_refused(models):
    target, drafter = models
    with D3DBatchServer(target, drafter, max_batch_size=2) as server:
        handle = server.submit(prompts(1, seed=3)[0], max_new_tokens=6)
        first = sum(handle.stream(timeout=WAIT), [])
        assert sum(handle.stream(timeout=WAIT), []) == [] and first == handle.result(timeout=WAIT)
        with pytest.raises(ValueError, match="Unknown generation settings: temprature"):
            server.submit(prompts(1, seed=3)[0], max_new_tokens=6, temprature=0.5)
        with pytest.raises(ValueError, match="one prompt"):
            server.submit(torch.ones(2, 3, dtype=torch.long), max_new_tokens=6)


def test_cancelling_one_request_leaves_the_others_unchanged(models):
    target, drafter = models
    requests = prompts(4, seed=1)

    def run(cancel: bool) -> dict:
        with D3DBatchServer(target, drafter, max_batch_size=4, policy=False) as server:  # seeded draws: see above
            handles = [server.submit(p, max_new_tokens=30, do_sample=i % 2 == 1, temperature=0.8, seed=i)
                       for i, p in enumerate(requests)]
            if cancel:
                stream = handles[2].stream(timeout=WAIT)
                first = next(stream)
                assert handles[2].cancel()
                assert first + sum(list(stream), []) == handles[2].tokens  # chunks queued before the cancel, then the end
                with pytest.raises(CancelledError):
                    handles[2].result(timeout=WAIT)
                assert len(handles[2].tokens) < 30 and not handles[2].cancel()
            return {i: h.result(timeout=WAIT) for i, h in enumerate(handles) if i != 2 or not cancel}

    full, cancelled = run(False), run(True)
    assert cancelled == {i: full[i] for i in (0, 1, 3)}
    assert full[0] == alone(target, requests[0], 30)


class Raises(LogitsProcessor):
    def __call__(self, input_ids, scores):
        raise RuntimeError("injected drafting failure")


def test_a_failing_request_raises_and_the_others_finish(models):
    target, drafter = models
    requests = prompts(3, seed=2)
    with D3DBatchServer(target, drafter, max_batch_size=3) as server:
        handles = [server.submit(p, max_new_tokens=12, logits_processor=[Raises()] if i == 1 else None)
                   for i, p in enumerate(requests)]
        with pytest.raises(RuntimeError, match="injected"):
            handles[1].result(timeout=WAIT)
        with pytest.raises(RuntimeError, match="injected"):
            list(handles[1].stream(timeout=WAIT))
        for i in (0, 2):
            assert handles[i].result(timeout=WAIT) == alone(target, requests[i], 12)


def test_a_failing_batched_pass_fails_its_requests_and_the_server_goes_on(models):
    target, drafter = models
    failures = [RuntimeError("the drafter broke")]

    def explode(module, args, kwargs):
        if failures and (kwargs["input_ids"] == drafter.config.mask_token_id).any():  # a drafting pass, not a prefill
            raise failures.pop()

    hook = drafter.register_forward_pre_hook(explode, with_kwargs=True)
    try:
        with D3DBatchServer(target, drafter, max_batch_size=2, policy=False) as server:  # drafts every round
            requests = prompts(2, seed=3)
            first = [server.submit(p, max_new_tokens=8) for p in requests]
            failed = 0
            for handle, prompt in zip(first, requests):  # the second may have joined after the failing round
                try:
                    assert handle.result(timeout=WAIT) == alone(target, prompt, 8)
                except RuntimeError as error:
                    assert "broke" in str(error)
                    failed += 1
            assert failed >= 1 and not failures
            later = server.submit([1, 2, 3], max_new_tokens=8)
            assert later.result(timeout=WAIT) == alone(target, [1, 2, 3], 8)
    finally:
        hook.remove()


def test_sampling_settings_become_the_targets_processors(models):
    target, drafter = models
    with D3DBatchServer(target, drafter) as server:
        handle = server.submit([1, 2], max_new_tokens=5, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=3)
        assert [type(p) for p in handle.settings.logits_processor] == [TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper]
        assert handle.settings.do_sample and len(handle.result(timeout=WAIT)) == 5


def test_close_ends_waiting_requests_and_refuses_new_ones(models):
    target, drafter = models
    server = D3DBatchServer(target, drafter, max_batch_size=1)
    handles = [server.submit(p, max_new_tokens=60) for p in prompts(3, seed=4)]
    server.close(timeout=WAIT)
    for handle in handles:
        assert handle.done
    with pytest.raises(CancelledError):
        handles[-1].result(timeout=WAIT)
    with pytest.raises(RuntimeError, match="closed"):
        server.submit([1], max_new_tokens=2)


def test_bad_requests_are_refused_at_submission(models):
    target, drafter = models
    with pytest.raises(ValueError, match="max_batch_size"):
        D3DBatchServer(target, drafter, max_batch_size=0)
    with pytest.raises(ValueError, match="vocabulary size"):
        D3DBatchServer(tiny_target(0, vocab_size=12), drafter)
    with D3DBatchServer(target, drafter) as server:
        with pytest.raises(ValueError, match="at least one token"):
            server.submit([], max_new_tokens=3)
        with pytest.raises(ValueError, match="max_new_tokens"):
            server.submit([1], max_new_tokens=0)
        with pytest.raises(ValueError, match="token ids"):
            server.submit([1, 99], max_new_tokens=3)
        with pytest.raises(ValueError, match="exceeds this engine's max_length 512"):
            server.submit([1] * 400, max_new_tokens=200)
        assert server.submit([1], max_new_tokens=3).result(timeout=WAIT) == alone(target, [1], 3)


class StopAfterRepeat(StoppingCriteria):
    """Stops a row once its last two tokens are equal (a criterion reading the whole sequence)."""

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == input_ids[:, -2]


def submitted_together(server, requests: list[list[int]], **settings) -> list[list[int]]:
    """Submit every request before any decodes (the server is paused on its lock), then their results."""
    with server._condition:  # the scheduler waits here, so all requests join the same first batch
        handles = [server.submit(prompt, **settings) for prompt in requests]
    return [handle.result(timeout=WAIT) for handle in handles]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_stop_strings_and_custom_criteria_stop_where_the_target_alone_stops(models, asynchronous):
    target, drafter = models
    tokenizer = word_tokenizer(num_words=8, words=("abcdef",))  # StopStringCriteria tokenizes "abcdef"
    requests = prompts(4, seed=5)
    first, second = alone(target, requests[0], 25), alone(target, requests[1], 25)
    stop_strings = [tokenizer.decode(first[6:8]), tokenizer.decode(second[12:13])]  # strings these rows reach
    criteria = {"stop_strings": stop_strings}, {"stopping_criteria": StoppingCriteriaList([StopAfterRepeat()])}
    with D3DBatchServer(target, drafter, max_batch_size=4, asynchronous=asynchronous, tokenizer=tokenizer) as server:
        for stop in criteria:
            results = submitted_together(server, requests, max_new_tokens=25, **stop)
            for prompt, result in zip(requests, results):
                out = target.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False, tokenizer=tokenizer, **stop)
                assert result == out[0, len(prompt):].tolist()
            assert any(len(result) < 25 for result in results), "some row stopped early"
        rounds = server.round_record.history
        assert max(len(outcomes) for outcomes, _ in rounds) == len(requests), "rows decoded together"


def test_stop_strings_need_the_tokenizer_and_beam_search_is_refused_at_submission(models):
    target, drafter = models
    with D3DBatchServer(target, drafter) as server:
        with pytest.raises(ValueError, match="tokenizer"):
            server.submit([1, 2], max_new_tokens=4, stop_strings=["w1"])
        with pytest.raises(ValueError, match="beam"):
            server.submit([1, 2], max_new_tokens=4, num_beams=3)
        assert server.round_record.rounds == 0 and not server._queues.waiting


def test_a_requests_own_eos_reaches_the_processors_that_need_it(models):
    """`min_new_tokens` with a request's `eos_token_id`: the EOS is suppressed for those tokens, as `generate`
    suppresses it (the processors are built after the request's EOS is set)."""
    target, drafter = models
    requests = prompts(6, seed=9)
    eos = alone(target, requests[0], 1)[0]  # the first row would end at once without min_new_tokens
    settings = dict(max_new_tokens=10, eos_token_id=eos, min_new_tokens=4)
    with D3DBatchServer(target, drafter, max_batch_size=3) as server:
        results = submitted_together(server, requests, **settings)
    for prompt, result in zip(requests, results):
        out = target.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=eos, **settings)
        assert result == out[0, len(prompt):].tolist()[: len(result)] and len(result) >= 4


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_seeded_request_samples_the_same_tokens_alone_and_batched(models, asynchronous):
    """A request's random draws come from its own generators only: the tokens of a seeded request do not depend on
    which others share its batch (async rounds where its branches hit and a companion's miss included), with the
    drafter's block every round (the default policy decides per round for the batch, from measured times)."""
    target, drafter = models
    requests = prompts(4, seed=11)
    settings = dict(max_new_tokens=40, do_sample=True, temperature=1.5)
    with D3DBatchServer(target, drafter, max_batch_size=4, asynchronous=asynchronous, policy=False) as server:
        solo = server.submit(requests[0], seed=7, **settings).result(timeout=WAIT)
        with server._condition:  # all four join the same first batch
            handles = [server.submit(p, seed=7 if i == 0 else 100 + i, **settings) for i, p in enumerate(requests)]
        batched = [handle.result(timeout=WAIT) for handle in handles]
        if asynchronous:
            assert 0 < server.round_record.hit_rate < 1, "rounds where some rows hit and others missed"
    assert batched[0] == solo


class Interrupt(BaseException):
    """Not an `Exception`: what a request's own code may raise (an `asyncio.CancelledError`, a `SystemExit`...)."""


class InterruptsAfter(LogitsProcessor):
    """Lets `calls` passes through, then raises `Interrupt` (a drafting or verifying step of its request)."""

    def __init__(self, calls: int):
        self.calls = calls

    def __call__(self, input_ids, scores):
        self.calls -= 1
        if self.calls < 0:
            raise Interrupt("from a processor")
        return scores


class CtrlC(LogitsProcessor):
    """Raises `KeyboardInterrupt`, which ends the whole round, not the row (`acceptance_d3d.ends_row_only`)."""

    def __call__(self, input_ids, scores):
        raise KeyboardInterrupt


class InterruptingCriterion(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise Interrupt("from a criterion")


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("failing", ["processor", "criterion"])
def test_a_base_exception_in_a_request_fails_it_and_the_server_goes_on(models, asynchronous, failing):
    """A `BaseException` that is not an `Exception` fails its request only (with a `RuntimeError` naming it, never a
    wait without end): the request sharing its round finishes as decoded alone, and the scheduler goes on with the
    requests waiting behind it and new ones."""
    target, drafter = models
    requests = prompts(4, seed=12)
    bad = {"logits_processor": [InterruptsAfter(3)]} if failing == "processor" else {
        "stopping_criteria": StoppingCriteriaList([InterruptingCriterion()])}
    with D3DBatchServer(target, drafter, max_batch_size=2, asynchronous=asynchronous) as server:
        with server._condition:
            failed = server.submit(requests[0], max_new_tokens=20, **bad)
            companion = server.submit(requests[3], max_new_tokens=24)
            waiting = server.submit(requests[1], max_new_tokens=12)
        with pytest.raises(RuntimeError, match="Interrupt") as raised:
            failed.result(timeout=WAIT)
        assert isinstance(raised.value.__cause__, Interrupt)
        with pytest.raises(RuntimeError, match="Interrupt"):
            list(failed.stream(timeout=WAIT))
        assert companion.result(timeout=WAIT) == alone(target, requests[3], 24)
        assert waiting.result(timeout=WAIT) == alone(target, requests[1], 12)
        assert server.submit(requests[2], max_new_tokens=12).result(timeout=WAIT) == alone(target, requests[2], 12)
        assert server._thread.is_alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_scheduler_that_stops_ends_every_request_and_refuses_new_ones(models, monkeypatch):
    """Should the scheduler thread itself end (here: its recovery from a failed round fails too), no request waits
    on it: those it held and those waiting end with the reason, and `submit` refuses new ones saying why."""
    target, drafter = models
    server = D3DBatchServer(target, drafter, max_batch_size=1)
    try:
        def broken_reset():
            raise Interrupt("recovery failed")

        monkeypatch.setattr(server.engine, "reset", broken_reset)
        with server._condition:
            failing = server.submit([1, 2, 3], max_new_tokens=20, logits_processor=[CtrlC()])
            waiting = server.submit([4, 5], max_new_tokens=20)
        for handle in (failing, waiting):
            with pytest.raises(RuntimeError, match="scheduler stopped: Interrupt"):
                handle.result(timeout=WAIT)
        server._thread.join(WAIT)
        assert not server._thread.is_alive()
        with pytest.raises(RuntimeError, match="cannot take requests.*scheduler stopped"):
            server.submit([1], max_new_tokens=2)
    finally:
        server.close(timeout=WAIT)


class ParallelKernel(LogitsProcessor):
    """Runs a parallel CPU kernel wherever the server processes logits (its scheduler), noting the threads after."""

    def __init__(self):
        self.threads: set[int] = set()

    def __call__(self, input_ids, scores):
        parallel_kernel()
        self.threads |= task_ids()
        return scores


@needs_libgomp
@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_threads_that_build_and_feed_a_server_and_its_idle_scheduler_keep_no_cpu_worker_pool(
        models, two_torch_threads, asynchronous):
    """A pool left on any of them made the scheduler's kernels 2.2x slower on a 2-core CPU (threads_d3d).
    Asynchronous, the request's processors run on the drafting worker too, which starts a pool of its own."""
    target, drafter = models
    CPUWorkerPools().release_own()
    builder = pool_of_this_thread()
    with D3DBatchServer(target, drafter, asynchronous=asynchronous, policy=False) as server:  # the worker drafts
        assert builder and gone(builder, timeout=RELEASED), "the building thread's pool is released"
        submitter = pool_of_this_thread()
        before, kernel = task_ids(), ParallelKernel()
        handle = server.submit(prompts(1)[0], max_new_tokens=6, logits_processor=[kernel])
        assert submitter and gone(submitter, timeout=RELEASED), "the submitting thread's pool is released"
        handle.result(WAIT)
        python_threads = {thread.native_id for thread in threading.enumerate()}  # the drafting worker, started since
        pools = kernel.threads - before - python_threads
        assert len(pools) >= 1 + asynchronous, "the request's kernels started a pool on each computing thread"
        assert gone(pools, timeout=WAIT), "the idle scheduler (and drafting worker) released their pools"


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_server_built_under_inference_mode_decodes_losslessly(models, asynchronous):
    """Its caches are inference tensors, which only a thread in inference mode may update: the scheduler and the
    drafting worker run in the modes of the thread that built the server."""
    target, drafter = models
    requests = prompts(3, seed=5)
    with torch.inference_mode(), D3DBatchServer(target, drafter, asynchronous=asynchronous) as server:
        assert submitted_together(server, requests, max_new_tokens=12) == [alone(target, p, 12) for p in requests]
