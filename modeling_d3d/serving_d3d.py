"""Request-level batched D3D decoding for serving code: submit a prompt with its settings, receive its tokens as they
are accepted, cancel it; many threads may submit at once.

`D3DBatchServer` owns one `engine_d3d.SpeculativeEngine` and a scheduler thread. Between rounds the scheduler drops
cancelled rows and admits waiting requests (each prefilled alone, up to `max_batch_size` rows: continuous batching);
then it runs one round for every row and hands each request its new tokens. A failure in one request's processing
fails that request only; a failure of a batched pass fails the requests of that batch and the server goes on with
the next ones. Nothing waits without a way out: `close()` ends every unfinished request.
"""

import queue
import threading
from concurrent.futures import CancelledError
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .network_d3d import check_compatibility
from .engine_d3d import RoundRecord, RowSettings
from .generation_d3d import build_engine, make_source
from .inputs_d3d import check_prompts
from .settings_d3d import row_settings
from .successor_d3d import DEFAULT_FANOUT
from .threads_d3d import CPUWorkerPools, in_callers_modes

DEFAULT_MAX_LENGTH = 4096

_END = object()


class RequestHandle:
    """One submitted request. Iterate it (or `stream(timeout)`) for token chunks `list[int]` as rounds accept them;
    `result(timeout)` waits for all its new tokens; `cancel()` stops it at the next round boundary. Raises the
    request's error if it failed, `concurrent.futures.CancelledError` from `result` if it was cancelled."""

    def __init__(self, request_id: int, prompt: list[int], settings: RowSettings, on_cancel):
        self.request_id = request_id
        self.prompt = prompt
        self.settings = settings
        self.tokens: list[int] = []
        self.rounds = 0
        self._chunks: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._cancelled = False
        self._on_cancel = on_cancel

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> bool:
        """Stop this request (no more tokens are delivered); False if it had already ended."""
        with self._lock:
            if self._done.is_set():
                return False
            self._cancelled = True
            self._done.set()
            self._chunks.put(_END)
        self._on_cancel()
        return True

    def result(self, timeout: float | None = None) -> list[int]:
        """The new tokens (EOS included when reached). Raises `TimeoutError`, the request's error, or
        `CancelledError`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        if self._cancelled:
            raise CancelledError(f"request {self.request_id} was cancelled")
        return list(self.tokens)

    def stream(self, timeout: float | None = None):
        """Yield token chunks as they are accepted; ends when the request finishes or is cancelled, raises its error
        if it failed, `TimeoutError` if no chunk comes within `timeout` seconds."""
        while True:
            try:
                chunk = self._chunks.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id}: no tokens for {timeout} s") from None
            if chunk is _END:
                self._chunks.put(_END)  # every later reader ends too
                if self._error is not None:
                    raise self._error
                return
            yield chunk

    def __iter__(self):
        return self.stream()

    # Called by the scheduler thread.
    def _deliver(self, tokens: list[int], finished: bool) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self.tokens += tokens
            self.rounds += 1
            if tokens:
                self._chunks.put(list(tokens))
            if finished:
                self._done.set()
                self._chunks.put(_END)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            self._chunks.put(_END)


def _as_request_error(error: BaseException) -> Exception:
    """The error a request fails with: `error` itself if it is an `Exception`; else (a `BaseException` that a
    request's own processors or criteria raised on the scheduler thread, which is never the main thread, so never a
    Ctrl-C) a `RuntimeError` naming it, so a client's `except Exception` sees it and does not take it for its own
    interrupt or exit."""
    if isinstance(error, Exception):
        return error
    wrapped = RuntimeError(f"a request's decoding raised {error!r}")
    wrapped.__cause__ = error
    return wrapped


@dataclass
class _Queues:
    waiting: list[RequestHandle]
    active: dict[int, RequestHandle]


class D3DBatchServer:
    """Continuous batched speculative decoding behind a thread-safe request API.

    target: the causal LM; drafter: a `D3DForBlockDiffusion` for it; max_batch_size: rows decoded together (further
    requests wait for a free row); asynchronous: prepare successor blocks on a worker thread while the target
    verifies (`sources_d3d.SuccessorSource`, with `coverage` and `fanout`); max_length: the longest prompt + new
    tokens a request may reach (the static caches are sized for `max_batch_size` rows of it; default the target's
    positions, at most 4096); tokenizer: for requests with `stop_strings`; lookup, policy: prompt lookup and the
    chooser of what each row verifies (`policy_d3d.make_chooser`). Use as a context manager or `close()`.
    `engine`: the `SpeculativeEngine`, driven by the scheduler thread only (read it, do not step it).
    On a CPU the threads that build the server or submit to it give back their OpenMP worker pool (the scheduler
    decodes; `threads_d3d`), and the idle scheduler and drafting worker hold none.
    """

    def __init__(
        self,
        target,
        drafter,
        max_batch_size: int = 8,
        asynchronous: bool = False,
        coverage: int | None = None,
        fanout: int = DEFAULT_FANOUT,
        max_length: int | None = None,
        tokenizer=None,
        lookup: bool | int | None = None,
        policy=None,
    ):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        if drafter is not None:
            check_compatibility(drafter, target)
        self.target, self.tokenizer = target, tokenizer
        self.max_batch_size = max_batch_size
        positions = getattr(target.config.get_text_config(), "max_position_embeddings", None) or DEFAULT_MAX_LENGTH
        max_length = min(positions, DEFAULT_MAX_LENGTH) if max_length is None else max_length
        self.engine = build_engine(target, make_source(drafter, asynchronous, coverage, fanout, None, None),
                                   max_batch_size, max_length, lookup=lookup, policy=policy, keep_rounds=1000)
        self._cpu_pools = CPUWorkerPools()
        self._cpu_pools.release_own()  # allocating the caches gave the caller's thread a pool; the scheduler computes
        self._queues = _Queues([], {})
        self._next_id = 0
        self._condition = threading.Condition()
        self._closed = False
        self._stopped: BaseException | None = None  # why the scheduler ended, once it has
        self._thread = threading.Thread(target=in_callers_modes(self._schedule), name="d3d-batch-server",
                                        daemon=True)  # in the modes the caches were made in
        self._thread.start()

    @property
    def round_record(self) -> RoundRecord:
        """The engine's round record: totals over every round so far (tau = tokens per row per round)."""
        return self.engine.round_record

    def submit(
        self,
        input_ids: torch.Tensor | list[int],
        max_new_tokens: int = 128,
        do_sample: bool | None = None,
        eos_token_id: int | list[int] | None = None,
        seed: int | None = None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        **generation_settings,
    ) -> RequestHandle:
        """Queue a prompt (`(1, L)`, `(L,)` or a list of ids). `generation_settings` (`temperature`, `top_k`,
        `top_p`, `repetition_penalty`, ...) go into a copy of the target's generation config, from which the target's
        own logits processors and stopping criteria are built, as `generate` builds them (`stop_strings` needs the
        server's `tokenizer`); `logits_processor` and `stopping_criteria` add your own.
        `do_sample` and `eos_token_id` default to the target's generation config; `seed` fixes this request's random
        draws. Raises `ValueError` for a request the server cannot decode."""
        check_prompts(input_ids, one_prompt=True)
        prompt = torch.as_tensor(input_ids).reshape(-1).tolist()
        config = GenerationConfig.from_dict(self.target.generation_config.to_dict())
        unused = config.update(max_new_tokens=max_new_tokens, **generation_settings)
        if unused:
            raise ValueError(f"Unknown generation settings: {', '.join(sorted(unused))}")
        if do_sample is not None:
            config.do_sample = do_sample
        if eos_token_id is not None:
            config.eos_token_id = eos_token_id
        config.validate()
        if config.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: D3DBatchServer(..., tokenizer=tokenizer)")
        seed = seed if seed is not None else int(torch.randint(2**62, (1,)))
        settings = row_settings(self.target, config, prompt, logits_processor, stopping_criteria, self.tokenizer, seed)
        self.engine.check_request(prompt, settings)
        self._cpu_pools.release_own()  # the scheduler decodes it: a pool kept by this thread would slow its kernels
        with self._condition:
            if self._stopped is not None and not isinstance(self._stopped, CancelledError):
                raise RuntimeError(f"This D3DBatchServer cannot take requests: {self._stopped}") from self._stopped
            if self._closed:
                raise RuntimeError("This D3DBatchServer is closed")
            handle = RequestHandle(self._next_id, prompt, settings, self._wake)
            self._next_id += 1
            self._queues.waiting.append(handle)
            self._condition.notify_all()
        return handle

    def _wake(self) -> None:
        with self._condition:
            self._condition.notify_all()

    def _schedule(self) -> None:
        """The scheduler thread: rounds until `close()`. An error of a round ends the requests it holds, not the
        thread; should the thread end any other way, every request ends with the reason and `submit` refuses new
        ones, so no request waits on a dead scheduler."""
        ended: BaseException = CancelledError("the D3DBatchServer was closed")
        try:
            while True:
                try:
                    if not self._schedule_round():
                        break
                except BaseException as error:  # a round failed (see _as_request_error)
                    self.engine.reset()
                    self._end_all(_as_request_error(error))
        except BaseException as error:
            ended = RuntimeError(f"the D3DBatchServer's scheduler stopped: {error!r}")
            ended.__cause__ = error
            raise
        finally:
            with self._condition:
                self._closed, self._stopped = True, ended
            self._end_all(ended)
            self.engine.close()

    def _schedule_round(self) -> bool:
        """Drop cancelled rows, admit waiting requests, run one round; False once closed. Idle, the scheduler
        waits without a CPU worker pool (`threads_d3d`: an idle pool slows every other thread's CPU kernels)."""
        with self._condition:
            idle = not (self._closed or self._queues.waiting or self._queues.active)
        if idle:
            self._cpu_pools.release_own()
            if self.engine.source is not None:
                self.engine.source.release_cpu_workers()
        with self._condition:
            self._condition.wait_for(lambda: self._closed or self._queues.waiting or self._queues.active)
            if self._closed:
                return False
            cancelled = {key for key, handle in self._queues.active.items() if handle.done}
            for key in cancelled:
                del self._queues.active[key]
            waiting = [handle for handle in self._queues.waiting if not handle.done]
            free = self.max_batch_size - len(self._queues.active)
            admitted, self._queues.waiting = waiting[:free], waiting[free:]
        self.engine.remove(cancelled)
        with self._condition:  # active before they join: should joining end the scheduler, they end with it
            self._queues.active.update((handle.request_id, handle) for handle in admitted)
        try:  # each checked by `submit`; one prefill pass per group of similar lengths
            self.engine.add_rows([(handle.request_id, handle.prompt, handle.settings, None) for handle in admitted])
        except Exception as error:  # a prefill that failed fails the requests it was for; the others go on
            with self._condition:
                for handle in admitted:
                    del self._queues.active[handle.request_id]
            for handle in admitted:
                handle._fail(error)
        self._round()
        return True

    def _round(self) -> None:
        """One engine round, delivered; after a step that only reported the first tokens of rows that joined (no
        pass), one more: every loop of the scheduler advances the rows it held, however often requests arrive."""
        joined = bool(self.engine.pending)
        self._step()
        if joined and len(self.engine):
            self._step()

    def _step(self) -> None:
        try:
            outcomes = self.engine.step()
        except BaseException as error:  # a batched pass failed: its rows cannot be trusted, they fail
            self.engine.reset()
            with self._condition:
                failed, self._queues.active = list(self._queues.active.values()), {}
            for handle in failed:
                handle._fail(_as_request_error(error))
            return
        for outcome in outcomes:
            handle = self._queues.active[outcome.key]
            if outcome.error is not None:
                handle._fail(_as_request_error(outcome.error))
            else:
                handle._deliver(outcome.added, outcome.finished)
            if outcome.finished:
                with self._condition:
                    del self._queues.active[outcome.key]

    def _end_all(self, error: BaseException) -> None:
        with self._condition:
            handles = self._queues.waiting + list(self._queues.active.values())
            self._queues.waiting, self._queues.active = [], {}
        for handle in handles:
            handle._fail(error)

    def close(self, timeout: float | None = None) -> None:
        """Stop the scheduler after the round in progress; unfinished requests end with `CancelledError`."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(timeout)

    def __enter__(self) -> "D3DBatchServer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["D3DBatchServer", "RequestHandle"]
