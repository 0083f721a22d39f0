"""Asynchronous D3D: the drafter prepares the next blocks on its own device, in a background thread, while the
target verifies the current one.

`D3DAssistedGenerator` stands in for the assistant model in `target.generate(..., assistant_model=generator)`.
Each round it hands out a block, then immediately queues one packed pass (`draft_successors`) that drafts the
successor block for every likely verification outcome. When the next round starts it looks the verified prefix up
among those branches: a hit reuses that branch's draft (and its q) with no drafting pass; a miss drafts
synchronously from the verified prefix. All drafter passes run on one worker thread, one at a time.
"""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from transformers import LogitsProcessorList
from transformers.cache_utils import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .speculative_d3d import AssistantFacade, AssistantSession, crop_to_common_prefix, synchronize

DEFAULT_COVERAGE = 12
DEFAULT_FANOUT = 2


def check_budget(block_size: int, coverage: int, fanout: int) -> None:
    """Raise `ValueError` unless coverage and fanout are ints (not bools), `1 <= coverage <= block_size`, `fanout >= 0`."""
    for name, value in (("coverage", coverage), ("fanout", fanout)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not 1 <= coverage <= block_size or fanout < 0:
        raise ValueError(f"coverage must be in 1..{block_size} and fanout >= 0, got coverage={coverage}, fanout={fanout}")


class _Session(AssistantSession):
    """The state of one `generate` call: the drafter cache (on the worker), the prepared branches, statistics."""

    def __init__(self, generator: "D3DAssistedGenerator", prompt: torch.Tensor, logits_processor, do_sample: bool):
        super().__init__(prompt, budget_tokens=generator.budget_tokens)
        self.cache = DynamicCache(config=generator.config)
        self.cached_ids: list[int] = []
        self.logits_processor = LogitsProcessorList(logits_processor or [])
        self.do_sample = do_sample
        # The worker samples drafts from its own generator, seeded from the global one: reproducible under a seed.
        self.rng = torch.Generator(device=generator.device).manual_seed(int(torch.randint(2**62, (1,))))
        self.prefix_length = 0
        self.pending: Future | None = None

    def sync_cache(self, prefix: list[int]) -> None:
        """Crop the drafter cache to the longest common prefix of what it holds and `prefix` (worker thread)."""
        crop_to_common_prefix(self.cache, self.cached_ids, prefix)


class D3DAssistedGenerator(AssistantFacade):
    """Asynchronous D3D drafting for `target.generate(..., assistant_model=generator)`.

    drafter: a `D3DForBlockDiffusion`; device: where it drafts (e.g. `"cuda:1"` with the target on `cuda:0`);
    `None` keeps it where it is. coverage `C` and fanout `F`: successor branches for the first `C - 1` rejection
    positions times `F` alternative anchors, plus the full-acceptance branch (budget `B((C - 1)F + 2)` tokens);
    defaults C = min(12, B), F = 2 (the paper's). worker_threads: torch intra-op threads of the worker thread (on a
    CPU-only machine, so that drafting and verification share the cores instead of oversubscribing them).
    Use it as a context manager, or call `close()`, to stop the worker thread. One `generate` call at a time.
    """

    def __init__(
        self,
        drafter,
        device: torch.device | str | None = None,
        coverage: int | None = None,
        fanout: int = DEFAULT_FANOUT,
        worker_threads: int | None = None,
    ):
        block_size = drafter.config.block_size
        coverage = min(DEFAULT_COVERAGE, block_size) if coverage is None else coverage
        check_budget(block_size, coverage, fanout)
        self.drafter = drafter.to(device) if device is not None else drafter
        self.coverage = coverage
        self.fanout = fanout
        self.budget_tokens = block_size * ((coverage - 1) * fanout + 2)
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="d3d-drafter",
            initializer=torch.set_num_threads if worker_threads else None,
            initargs=(worker_threads,) if worker_threads else (),
        )
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._closed = False

    def generate(self, input_ids: torch.LongTensor, generation_config=None, logits_processor=None, **kwargs):
        """One round of transformers' assisted loop: hand out a block for the verified prefix `(1, L)`."""
        if generation_config is None or not getattr(generation_config, "is_assistant", False):
            raise ValueError("D3DAssistedGenerator drafts for target.generate(..., assistant_model=generator) only")
        if self._closed:
            raise RuntimeError("This D3DAssistedGenerator is closed")
        with self._lock:
            session = kwargs.get("past_key_values")
            if session is not self._session or session is None:
                session = self._start_session(input_ids, logits_processor, generation_config.do_sample)
            return self._round(session, input_ids.to(self.device), kwargs.get("max_new_tokens"))

    def _start_session(self, prompt: torch.Tensor, logits_processor, do_sample: bool) -> _Session:
        if self._session is not None and self._session.pending is not None:
            self._session.pending.cancel()
            self._session.pending = None
        self._session = _Session(self, prompt, logits_processor, do_sample)
        return self._session

    def _round(self, session: _Session, input_ids: torch.LongTensor, max_new_tokens: int | None):
        session.stats.start_round(input_ids)
        prefix = input_ids[0].tolist()
        start = time.perf_counter()
        looked_up, branch, job_seconds = session.pending is not None, None, 0.0
        if looked_up:
            pending, session.pending = session.pending, None
            branches, job_seconds = pending.result()
            branch = branches.get(tuple(prefix[session.prefix_length :]))
        if branch is not None and branch.tokens.shape[1] > 0:
            tokens, logits = branch.tokens, branch.logits
        else:
            branch = None
            tokens, logits = self._executor.submit(self._draft, session, input_ids).result()
        exposed = time.perf_counter() - start
        keep = min(tokens.shape[1], max_new_tokens or tokens.shape[1])
        session.prefix_length = len(prefix)
        if keep == tokens.shape[1]:
            session.pending = self._executor.submit(self._prepare_successors, session, input_ids, tokens, logits)
        session.stats.record_draft(
            len(prefix), tokens[:, :keep], exposed, looked_up=looked_up, from_cache=branch is not None,
            hidden_seconds=max(job_seconds - exposed, 0.0) if looked_up else 0.0,
        )
        return GenerateDecoderOnlyOutput(
            sequences=torch.cat([input_ids, tokens[:, :keep]], dim=1),
            scores=tuple(logits[:, j] for j in range(keep)),
            past_key_values=session,
        )

    def _draft(self, session: _Session, input_ids: torch.LongTensor):
        """Worker: draft one block from the verified prefix (a cache miss)."""
        session.sync_cache(input_ids[0, :-1].tolist())
        draft = self.drafter.draft_block(
            input_ids, session.cache, session.logits_processor, session.do_sample, session.rng
        )
        session.cached_ids = input_ids[0, :-1].tolist()
        return draft.tokens, draft.logits

    def _prepare_successors(self, session: _Session, input_ids, tokens, logits):
        """Worker: the packed successor pass for the block under verification; returns ({key: branch}, seconds)."""
        start = time.perf_counter()
        session.sync_cache(input_ids[0, :-1].tolist())
        branches = self.drafter.draft_successors(
            input_ids, tokens, logits, session.cache, self.coverage, self.fanout,
            session.logits_processor, session.do_sample, session.rng,
        )
        session.cached_ids = input_ids[0].tolist() + tokens[0].tolist()
        synchronize(self.device)
        return {branch.key: branch for branch in branches}, time.perf_counter() - start

    def wait(self) -> None:
        """Block until the worker has finished the pass queued by the last round (its result stays usable)."""
        session = self._session
        if session is not None and session.pending is not None:
            session.pending.result()

    def close(self) -> None:
        """Stop the worker thread (waiting for a running pass); the generator cannot be used afterwards."""
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "D3DAssistedGenerator":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["DEFAULT_COVERAGE", "DEFAULT_FANOUT", "D3DAssistedGenerator", "check_budget"]
