"""The engine's device rules, proven on a CPU: a target split over devices is refused, a row's processors run where
they were built, rounds read the device once and upload each pass's inputs in one copy (counted by
`host_syncs.HostSyncs`), and background drafting is ordered by fences, never by a device-wide synchronize."""

import threading

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList, StopStringCriteria
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, SuppressTokensLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper)

from conftest import tiny_target, word_tokenizer
from host_syncs import HostSyncs
from modeling_d3d import (BlockSource, D3DAssistedGenerator, D3DForBlockDiffusion, RowSettings, SpeculativeEngine,
                          SuccessorSource)
from modeling_d3d import engine_d3d, sources_d3d, streams_d3d
from modeling_d3d.acceptance_d3d import RowSampling, drafts_from_logits
from modeling_d3d.assistant_d3d import block_assistant, processors_device
from modeling_d3d.generation_d3d import speculative_generate
from modeling_d3d.settings_d3d import row_settings
from modeling_d3d.streams_d3d import Fence

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pair(seed: int = 0, block_size: int = 4, vocab_size: int = 96):
    target = tiny_target(seed, vocab_size=vocab_size)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(seed + 1, vocab_size=vocab_size), block_size=block_size)
    return target, drafter.eval()


def alone(target, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


# 4. A target split over devices


def test_a_target_split_over_devices_is_refused_with_how_to_place_it():
    target, drafter = pair()
    target.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
                            "lm_head": 1}  # as device_map="auto" gives on a node with two GPUs
    with pytest.raises(ValueError, match=r"split over devices 0, 1 .*device_map=\"cuda:0\"") as error:
        SpeculativeEngine(target, BlockSource(drafter))
    assert "drafter_device" in str(error.value)
    with pytest.raises(ValueError, match="split over devices"):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, custom_generate=speculative_generate,
                        drafter=drafter)
    target.hf_device_map = {"": "cpu"}  # placed whole on one device: runs
    engine = SpeculativeEngine(target, BlockSource(drafter), max_length=16)
    engine.add(0, [1, 2, 3], RowSettings(4))
    while len(engine):
        engine.step()


# 5. A drafter on another device than the row's processors


def processors_on(device: str) -> LogitsProcessorList:
    """A row's processors as `generate` builds them on `device` (they hold their token ids there)."""
    return LogitsProcessorList([MinNewTokensLengthLogitsProcessor(3, 5, [7], device=device),
                                SuppressTokensLogitsProcessor([5, 9], device=device)])


def test_drafter_logits_are_processed_on_the_device_of_the_rows_processors():
    """A drafter on another device than the target ("meta" stands in for the target's GPU): the row's processors
    hold tensors on the target's device, so its drafter logits are processed there, and its drafts come out there;
    a row without processors next to it too (one tensor for the batch)."""
    raw = torch.randn(2, 3, 96)
    sampling = [RowSampling(processors_on("meta"), device=torch.device("meta")),
                RowSampling(device=torch.device("meta"))]
    drafts, processed = drafts_from_logits(raw, [[1, 2], [3, 4, 5]], sampling)
    assert drafts.device.type == processed.device.type == "meta"
    assert drafts.shape == (2, 3) and processed.shape == (2, 3, 96)
    # the same on the processors' real device gives the processed argmax
    drafts, processed = drafts_from_logits(raw, [[1, 2], [3, 4, 5]], [RowSampling(processors_on("cpu")), RowSampling()])
    assert (processed[0, :, [5, 9, 7]] == float("-inf")).all() and torch.equal(drafts, processed.argmax(-1))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_rows_draft_with_processors_on_the_targets_device_and_match_the_target_alone(kind):
    """The engine hands every row's drafting its processors' device (the target's) and a generator there; with
    min_new_tokens and suppress_tokens the rows equal the target alone."""
    target, drafter = pair(2)
    source = BlockSource(drafter) if kind == "sync" else SuccessorSource(drafter, 3, 2)
    engine = SpeculativeEngine(target, source, max_rows=2, max_length=64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    config = GenerationConfig(max_new_tokens=20, do_sample=False, min_new_tokens=6, eos_token_id=7,
                              suppress_tokens=[11, 12])
    for key, prompt in enumerate(prompts):
        engine.add(key, prompt, row_settings(target, config, prompt))
    assert all(row.sampling.device == engine.device == row.sampling.generator.device for row in engine.rows)
    outputs = {}
    while len(engine):
        for outcome in engine.step():
            assert outcome.error is None
            outputs.setdefault(outcome.key, []).extend(outcome.added)
    engine.close()
    for key, prompt in enumerate(prompts):
        assert outputs[key] == alone(target, prompt, 20, min_new_tokens=6, eos_token_id=7, pad_token_id=7,
                                     suppress_tokens=[11, 12])


def test_the_assistant_learns_the_targets_device_from_the_processors_transformers_hands_it():
    """transformers builds the target's processors on the target's input device and passes them to the assistant;
    that device reaches the assistant through them only (its input ids arrive on the assistant's own device)."""
    assert processors_device(processors_on("meta")) == torch.device("meta")
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    assert processors_device(warpers) is None and processors_device(LogitsProcessorList()) is None
    assert processors_device(warpers + processors_on("meta")) == torch.device("meta")


def test_the_assistants_row_drafts_where_transformers_built_its_processors():
    """`assistant_model=` with the drafter on another device than the target ("meta" stands in for the target's
    GPU): the row the assistant drafts has its drafter logits processed where its processors live, and its drafts
    come out there (transformers moves them to the target's device anyway)."""
    _, drafter = pair()
    assistant = block_assistant(drafter)
    session = assistant._start([1, 2, 3], processors_on("meta"), do_sample=False)
    proposal = assistant.source.propose([[1, 2, 3]], [session.sampling])
    assert not proposal.errors, proposal.errors  # processors applied on the drafter's device fail there
    assert proposal.drafts.device.type == "meta" and proposal.drafts.shape == (1, 3)
    assert session.sampling.device == torch.device("meta")
    assistant.close()


def proposing_sampling(source, monkeypatch) -> list[RowSampling]:
    """Every `RowSampling` the assistant hands `source.propose` (the real one runs)."""
    handed, propose = [], source.propose

    def noted(contexts, sampling):
        handed.extend(sampling)
        return propose(contexts, sampling)

    monkeypatch.setattr(source, "propose", noted)
    return handed


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_assistant_rows_draft_with_processors_on_the_targets_device_and_match_the_target_alone(kind, monkeypatch):
    """Through `target.generate(..., assistant_model=...)`, greedy with min_new_tokens and suppress_tokens: the row
    drafts on the device of the target's processors, and the output equals the target alone."""
    target, drafter = pair(2)
    assistant = block_assistant(drafter) if kind == "sync" else D3DAssistedGenerator(drafter, coverage=3, fanout=2)
    handed = proposing_sampling(assistant.source, monkeypatch)
    prompt = [4, 5, 6, 7, 8, 9]
    settings = dict(min_new_tokens=6, eos_token_id=7, pad_token_id=7, suppress_tokens=[11, 12])
    with assistant:
        out = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, assistant_model=assistant,
                              **settings)
    assert handed and all(s.device == target.device and s.generator is None for s in handed)
    assert out[0, len(prompt):].tolist() == alone(target, prompt, 20, **settings)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_assistant_rows_sample_with_a_generator_on_the_device_of_the_targets_processors(kind, monkeypatch):
    """Sampling through `assistant_model=` with processors that hold tensors: the row's draws use a generator on
    their device, and the target's constraints hold (no suppressed token, no EOS before min_new_tokens)."""
    target, drafter = pair(3)
    assistant = block_assistant(drafter) if kind == "sync" else D3DAssistedGenerator(drafter, coverage=3, fanout=2)
    handed = proposing_sampling(assistant.source, monkeypatch)
    prompt = [4, 5, 6]
    torch.manual_seed(0)
    with assistant:
        for _ in range(4):
            out = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=True, temperature=0.5,
                                  min_new_tokens=6, eos_token_id=7, pad_token_id=7, suppress_tokens=[11, 12],
                                  assistant_model=assistant)
            added = out[0, len(prompt):].tolist()
            assert not {11, 12} & set(added) and 7 not in added[:6]
    assert handed and all(s.do_sample and s.device == target.device == s.generator.device for s in handed)


# 7. Host syncs per round


def stop_criteria() -> StoppingCriteriaList:
    """Stop strings over a word tokenizer of the tiny vocabulary (its word "abcdef" serves the criterion's prefix)."""
    return StoppingCriteriaList([StopStringCriteria(word_tokenizer(94, words=("abcdef",)), ["w41"])])


@pytest.mark.parametrize("criteria", [False, True], ids=["plain", "stop strings"])
def test_a_greedy_sync_round_reads_the_device_once_and_uploads_each_pass_in_one_copy(criteria):
    """Greedy rows through block drafting: a row's `add` reads its first token (decided by its prefill) once; the
    step that reports those tokens runs nothing; then per `step()`, one device-to-host read (the accepted tokens)
    and two uploads (the block pass's layout and the verify pass's, its anchors folded in; the drafts stay on the
    device), and one more in the first round, whose drafter prefill of the rows that joined is a pass of its own (a
    prompt of 6 tokens is more than B = 4 behind); with stop strings too (they read host ids, not device ones); and
    the rows still equal the target alone."""
    target, drafter = pair(3)
    engine = SpeculativeEngine(target, BlockSource(drafter), max_rows=2, max_length=64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    for key, prompt in enumerate(prompts):
        stops = stop_criteria() if criteria else StoppingCriteriaList()
        with HostSyncs([target, drafter], [engine.cache, engine.source.cache], [engine.device]) as syncs:
            engine.add(key, prompt, RowSettings(12, stopping_criteria=stops))
        assert syncs.reads == 1
    counts, outputs = [], {}
    while len(engine):
        with HostSyncs([target, drafter], [engine.cache, engine.source.cache], [engine.device]) as syncs:
            outcomes = engine.step()
        counts.append((syncs.reads, syncs.uploads))
        for outcome in outcomes:
            outputs.setdefault(outcome.key, []).extend(outcome.added)
    assert len(counts) >= 4 and counts[:2] == [(0, 0), (1, 3)] and set(counts[2:]) == {(1, 2)}, counts
    for key, prompt in enumerate(prompts):
        assert outputs[key] == alone(target, prompt, 12, stopping_criteria=stop_criteria() if criteria else None)


def test_the_host_sync_counter_sees_reads_and_uploads_of_device_tensors_only():
    """The counter itself: host tensors are free; device ones (a model's, created on its device, moved there) count."""
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with HostSyncs(models=[model]) as syncs:
        host = torch.tensor([1.0, 2.0])
        host.tolist(), int(host[0]), bool(host.sum() > 0), host.to("cpu"), torch.zeros(2, device=host.device)
        assert (syncs.reads, syncs.uploads) == (0, 0)
        device = model.weight.device
        out = model(host.to(device))
        assert syncs.uploads == 1
        out.tolist()
        assert syncs.reads == 1
        float(out.sum()), out.cpu(), out[out > 0], out.to("cpu")
        assert syncs.reads == 5
        made = torch.zeros(2, device=device)
        made.to(torch.float64).argmax().tolist()  # a dtype change stays on the device
        assert syncs.reads == 6
        made[0] = host[0]
        torch.tensor([1, 2], device=device)
        assert syncs.uploads == 3


# 6. Streams: fences, not device-wide synchronization


def test_a_fence_waited_on_before_it_was_recorded_raises():
    fence = Fence(torch.device("cpu"), "the drafts")
    with pytest.raises(RuntimeError, match="the drafts that was never submitted"):
        fence.wait()
    with pytest.raises(RuntimeError, match="never submitted"):
        fence.synchronize()
    fence.record()
    fence.wait()
    fence.synchronize()


def test_background_drafting_is_ordered_by_fences_recorded_before_they_are_waited_on(monkeypatch):
    """Per round: the main thread records the drafts' fence before queuing the worker, the worker's stream waits on
    it, records its branches' fence, and the main thread waits on that before the next round reads the branches;
    no device-wide synchronize runs in a round."""
    log = []
    record, wait = Fence.record, Fence.wait

    def logged_record(self, *args):
        log.append(("record", self.name, threading.current_thread().name.startswith("d3d-drafter")))
        return record(self, *args)

    def logged_wait(self, *args):
        log.append(("wait", self.name, threading.current_thread().name.startswith("d3d-drafter")))
        return wait(self, *args)

    monkeypatch.setattr(Fence, "record", logged_record)
    monkeypatch.setattr(Fence, "wait", logged_wait)
    synchronized = []  # every device-wide synchronize the engine or the sources could call
    for module in (engine_d3d, sources_d3d, streams_d3d):
        monkeypatch.setattr(module, "synchronize", lambda device: synchronized.append(device), raising=False)
    target, drafter = pair(4)
    engine = SpeculativeEngine(target, SuccessorSource(drafter, 3, 2), max_rows=2, max_length=64)
    for key, prompt in enumerate([[1, 2, 3], [4, 5, 6, 7]]):
        engine.add(key, prompt, RowSettings(16))
    assert [len(outcome.added) for outcome in engine.step()] == [1, 1] and not log  # from the prefill: no pass
    synchronized.clear()
    rounds = 0
    while len(engine):
        engine.step()
        rounds += 1
    engine.close()
    assert not synchronized and rounds >= 3
    one_round = [("record", "the drafts", False), ("wait", "the drafts", True),
                 ("record", "the successor branches", True), ("wait", "the successor branches", False)]
    assert log == one_round * rounds


def test_a_copy_to_the_host_blocks_and_a_copy_to_a_gpu_is_queued():
    """The drafts, counts and ranked tokens a CPU drafter's worker reads with `.tolist()` come from the target's GPU:
    a non-blocking device-to-host copy returns before its bytes land (the old `non_blocking=True` everywhere)."""
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")
    assert not streams_d3d.ordered_without_blocking(gpu0, cpu)
    assert streams_d3d.ordered_without_blocking(cpu, gpu0) and streams_d3d.ordered_without_blocking(gpu0, gpu1)
    assert not streams_d3d.ordered_without_blocking(cpu, cpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_large_device_to_host_move_is_read_whole_at_once():
    values = torch.arange(1 << 24, device="cuda") * 3
    torch.cuda._sleep(10_000_000)  # the copy queues behind this on the stream
    host = streams_d3d.move(values, torch.device("cpu"))
    assert host[-1].item() == 3 * ((1 << 24) - 1)


def test_a_drafter_on_the_cpu_is_where_cpu_0_says():
    """A CPU tensor's device has no index; "cpu:0" names the same device (refused before: index 0 != None)."""
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(0, vocab_size=16), block_size=4).eval()
    sources_d3d.check_device(drafter, "cpu:0")
    sources_d3d.check_device(drafter, torch.device("cpu"))
    with pytest.raises(ValueError, match="not cuda"):
        sources_d3d.check_device(drafter, "cuda:1")
