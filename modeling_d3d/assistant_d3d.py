"""The `assistant_model=` adapter: transformers' own assisted loop drives a drafter source (one sequence).

`target.generate(ids, assistant_model=drafter)` and `target.generate(ids, assistant_model=D3DAssistedGenerator(...))`
keep working, lossless, through transformers' loop: each round it calls `assistant.generate(verified_prefix)`, and
the adapter tells the source what the previous round accepted (read off the new prefix: transformers reports
nothing else), then proposes. That loop cannot use static caches for the target, calls a nested `generate` per
round and verifies one sequence; `custom_generate=speculative_generate` (the engine) is the fast path.
"""

import time

import torch
from transformers import LogitsProcessorList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .engine_d3d import RoundOutcome, RoundRecord, RoundTiming
from .acceptance_d3d import RowSampling
from .sources_d3d import BlockSource
from .successor_d3d import DEFAULT_FANOUT, SuccessorSource

INITIAL_CAPACITY = 1024


def processors_device(logits_processor: LogitsProcessorList) -> torch.device | None:
    """Where `logits_processor` was built: the device of the first tensor its processors hold (transformers builds
    the target's processors on the target's input device: MinNewTokens' EOS ids, SuppressTokens' ids, ...; that
    device reaches an assistant through them only); None when none holds one (they run wherever the logits are)."""
    for processor in logits_processor:
        for value in getattr(processor, "__dict__", {}).values():
            if isinstance(value, torch.Tensor):
                return value.device
    return None


def drafts_through_eos(drafts: list[int], eos_token_id) -> int:
    """How many of `drafts` to propose: up to and including the first EOS (`eos_token_id`: an id, ids or None).
    transformers' assisted loop stops only when the candidates end at an EOS, as an assistant model's own `generate`
    ends them (before 5.23 it does not crop accepted tokens after an EOS inside the candidates)."""
    stops = set() if eos_token_id is None else set(torch.as_tensor(eos_token_id).reshape(-1).tolist())
    return next((i + 1 for i, token in enumerate(drafts) if token in stops), len(drafts))


class AssistantSession:
    """What transformers' assisted loop holds in the assistant's `past_key_values` slot for one `generate` call. It
    reports no cached tokens, so transformers never crops it; the source keeps the drafter cache itself."""

    def __init__(self, prompt: list[int], sampling: RowSampling):
        self.prompt, self.sampling = prompt, sampling
        self.context: list[int] | None = None  # the prefix of the last proposal
        self.drafts: list[int] = []
        self.hit = False
        self.looked_up = False
        self.returned_at = 0.0
        self.exposed = 0.0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def crop(self, max_length: int) -> None:
        return None


class D3DAssistant:
    """Stands in for an assistant model in `target.generate(..., assistant_model=assistant)`, drafting with `source`
    (a `BlockSource` or `SuccessorSource`). `round_record`: the `RoundRecord` of the latest call; `settle(output)`
    closes its last round. One `generate` call at a time."""

    def __init__(self, source):
        self.source = source
        self.drafter = source.drafter
        self.round_record: RoundRecord | None = None
        self._session: AssistantSession | None = None
        self._capacity = 0

    @property
    def config(self):
        return self.drafter.config

    @property
    def generation_config(self):
        return self.drafter.generation_config

    @property
    def device(self) -> torch.device:
        return self.source.device

    def _supports_logits_to_keep(self) -> bool:
        return False

    @torch.no_grad()
    def generate(self, input_ids: torch.LongTensor, generation_config=None, logits_processor=None, **kwargs):
        """One round of transformers' assisted loop: drafts for the verified prefix `(1, L)`."""
        if generation_config is None or not getattr(generation_config, "is_assistant", False):
            raise ValueError("This D3D assistant drafts for target.generate(..., assistant_model=...) only")
        if getattr(generation_config, "stop_strings", None):
            raise ValueError("stop_strings with assistant_model=: transformers' assisted loop checks them once per round "
                             "and can stop up to B - 1 tokens after the target alone; decode through the engine "
                             "instead (drafter.generate_batch(target, ids, stop_strings=..., tokenizer=...)), which "
                             "stops exactly")
        context = input_ids[0].tolist()
        session = kwargs.get("past_key_values")
        if session is None or session is not self._session:
            session = self._start(context, logits_processor, generation_config.do_sample)
        else:
            self._observe(session, context)
        if len(context) + 2 > self._capacity:
            self._start(context, logits_processor, generation_config.do_sample, self._capacity * 2)
            session = self._session
        proposal = self.source.propose([context], [session.sampling])
        if proposal.errors:
            raise proposal.errors[0]
        keep = min(int(proposal.num_drafts[0]), kwargs.get("max_new_tokens") or proposal.drafts.shape[1])
        keep = drafts_through_eos(proposal.drafts[0, :keep].tolist(), generation_config.eos_token_id)
        session.context, session.exposed = context, proposal.exposed_seconds
        session.hit, session.looked_up = proposal.hits[0], proposal.looked_up[0]
        session.drafts = proposal.drafts[0, :keep].tolist()
        scores = proposal.logits[0, :keep] if proposal.logits is not None else torch.zeros(
            keep, self.drafter.config.vocab_size, device=proposal.drafts.device)
        session.returned_at = time.perf_counter()
        return GenerateDecoderOnlyOutput(
            sequences=torch.cat([input_ids.to(proposal.drafts.device), proposal.drafts[:, :keep]], dim=1),
            scores=tuple(scores[j][None] for j in range(keep)),
            past_key_values=session,
        )

    def _start(self, context: list[int], logits_processor, do_sample: bool, capacity: int | None = None):
        """A new session (a new `generate` call, or a longer one than the cache holds): allocate and prefill."""
        self._capacity = max(capacity or 0, len(context) + INITIAL_CAPACITY)
        self.source.allocate(1, self._capacity + 1)
        self.source.add(0, [context])
        processors = LogitsProcessorList(logits_processor or [])
        device = processors_device(processors)
        generator = torch.Generator(device=device or self.source.device).manual_seed(
            int(torch.randint(2**62, (1,)))) if do_sample else None
        sampling = RowSampling(processors, bool(do_sample), generator, device)
        if capacity is None or self._session is None:
            self._session = AssistantSession(context, sampling)
            self.round_record = RoundRecord()
        else:
            self._session.context = None
        return self._session

    def _observe(self, session: AssistantSession, context: list[int]) -> None:
        """Read the previous round's outcome off the new prefix, tell the source, and record the round."""
        if session.context is None:
            return
        added = context[len(session.context):]
        accepted = 0
        while accepted < min(len(session.drafts), len(added) - 1) and session.drafts[accepted] == added[accepted]:
            accepted += 1
        verify = time.perf_counter() - session.returned_at
        waited, hidden = self.source.observe([session.context], [added[: accepted + 1]])
        outcome = RoundOutcome(0, added[: accepted + 1], False, accepted_drafts=accepted, from_branch=session.hit)
        timing = RoundTiming(verify, session.exposed + waited, hidden, 0.0)
        self.round_record.add([outcome], int(session.looked_up), timing)
        for token in added[accepted + 1 :]:  # rounds transformers ran without asking for drafts (one token left)
            self.round_record.add([RoundOutcome(0, [token], False)], 0, RoundTiming(0.0, 0.0, 0.0, 0.0))
        session.context = None

    def settle(self, sequences: torch.Tensor) -> RoundRecord:
        """Close the last round from the output `(1, length)` of the `generate` call; returns the record."""
        session = self._session
        if session is not None and session.context is not None:
            output = sequences.reshape(-1).tolist()
            if output[: len(session.context)] != session.context:
                raise ValueError("This output belongs to another generate call than the assistant's last one")
            self._observe(session, output)
        return self.round_record

    def close(self) -> None:
        self.source.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class D3DAssistedGenerator(D3DAssistant):
    """Asynchronous D3D drafting for `target.generate(..., assistant_model=generator)`: a `SuccessorSource` with
    coverage `C`, fanout `F` on `device`, `worker_threads` torch threads for its worker (see `sources_d3d`)."""

    def __init__(self, drafter, device=None, coverage: int | None = None, fanout: int = DEFAULT_FANOUT,
                 worker_threads: int | None = None):
        super().__init__(SuccessorSource(drafter, coverage, fanout, device=device, worker_threads=worker_threads))
        self.coverage, self.fanout = self.source.coverage, self.source.fanout
        self.budget_tokens = self.source.budget_tokens


def block_assistant(drafter) -> D3DAssistant:
    """The synchronous adapter, for `assistant_model=drafter`."""
    return D3DAssistant(BlockSource(drafter))


__all__ = ["AssistantSession", "D3DAssistant", "D3DAssistedGenerator", "block_assistant", "drafts_through_eos",
           "processors_device"]
