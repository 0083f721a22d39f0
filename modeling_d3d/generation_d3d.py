"""The engine's `generate` front door: `target.generate(ids, custom_generate=speculative_generate, drafter=...)`.

transformers prepares everything a `generate` call implies (generation config, logits processors, stopping
criteria, streamer) and hands it here; this builds one engine row per sequence and runs `SpeculativeEngine.step`
until every row ends. Batches of left-padded prompts, greedy and sampling, streamers (one sequence), stop strings,
custom stopping criteria, EOS and `max_new_tokens` behave as in the target's own `generate`.
"""

from collections.abc import Hashable

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .engine_d3d import RoundRecord, SpeculativeEngine
from .inputs_d3d import check_prompts
from .passes_d3d import compiled_passes
from .settings_d3d import eos_ids, row_settings
from .policy_d3d import make_chooser
from .versions_d3d import check_compiled_async
from .shapes_d3d import engine_size
from .sources_d3d import BlockSource, check_device
from .successor_d3d import DEFAULT_FANOUT, SuccessorSource


def front_door_kwargs(generate_kwargs: dict) -> dict:
    """`generate` drops `tokenizer=` and `streamer=` before calling a `custom_generate` callable (so `stop_strings`
    would be refused and a streamer would get the prompt only); the front doors (`generate_batch`, `d3d_generate`)
    turn `stop_strings` + `tokenizer` into a `StopStringCriteria` in `stopping_criteria` (the criterion `generate`
    builds) and hand the streamer over as `d3d_streamer`."""
    kwargs = dict(generate_kwargs)
    if kwargs.get("streamer") is not None:
        kwargs["d3d_streamer"] = kwargs.pop("streamer")
    if kwargs.get("stop_strings") is None or kwargs.get("tokenizer") is None:
        return kwargs
    criterion = StopStringCriteria(kwargs.pop("tokenizer"), kwargs.pop("stop_strings"))
    kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), criterion])
    return kwargs


def make_source(drafter, asynchronous: bool, coverage, fanout, drafter_device, worker_threads, compile: bool = False):
    """The drafter source for these settings: None (the target alone), block drafting, or successor drafting;
    `compile`: its drafting passes compiled (the drafter's `passes_d3d.compiled_passes`, kept on it across calls).
    drafter_device: where the drafter must already be (`ValueError` otherwise; the user's model is never moved)."""
    if drafter is None:
        if asynchronous:
            raise ValueError("asynchronous=True needs drafter=<a D3DForBlockDiffusion>")
        return None
    check_device(drafter, drafter_device)
    if compile and asynchronous:
        check_compiled_async(drafter.get_input_embeddings().weight.device)
    passes = compiled_passes(drafter) if compile else None
    if asynchronous:
        return SuccessorSource(drafter, coverage, fanout, worker_threads=worker_threads, passes=passes)
    return BlockSource(drafter, passes=passes)


def drafting_of(source) -> Hashable:
    """How `source` drafts, for the verify policy's costs (`policy_d3d.policy_for`): `"sync"` (also without a
    source), or `("async", C, F)`, asynchronous drafting at its budget."""
    if isinstance(source, SuccessorSource):
        return ("async", source.coverage, source.fanout)
    return "sync"


def build_engine(model, source, rows: int, max_length: int, compile: bool = False, lookup=None,
                 policy=None, verification: str = "block", keep_rounds: int = 100_000) -> SpeculativeEngine:
    """The engine that decodes `rows` prompts of up to `max_length` tokens (compiled: sized by
    `shapes_d3d.engine_size`); lookup, policy: see `policy_d3d.make_chooser` (a policy kept on the drafter, else on
    `model`, per mode and `drafting_of(source)`); verification, keep_rounds: see the engine; `source` is closed if the
    engine cannot be built."""
    if compile:
        rows, max_length = engine_size(rows, max_length, compiled_passes(model).fixed_shapes)
    try:
        lookup, policy = make_chooser(lookup, policy, source.block_size if source is not None else None,
                                      source.drafter if source is not None else model, compile, drafting_of(source))
        return SpeculativeEngine(model, source, max_rows=rows, max_length=max_length, compile=compile, lookup=lookup,
                                 policy=policy, verification=verification, keep_rounds=keep_rounds)
    except BaseException:
        if source is not None:
            source.close()
        raise


def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    drafter=None,
    asynchronous: bool = False,
    coverage: int | None = None,
    fanout: int = DEFAULT_FANOUT,
    drafter_device=None,
    worker_threads: int | None = None,
    drafter_input_ids: torch.LongTensor | None = None,
    compile: bool = False,
    round_record: RoundRecord | None = None,
    d3d_streamer=None,
    lookup: bool | int | None = None,
    policy=None,
    verification: str = "block",
    **model_kwargs,
):
    """`target.generate(input_ids, custom_generate=speculative_generate, drafter=drafter, ...)`.

    input_ids: `(batch, P)` prompts, left-padded with their `attention_mask`; each row is decoded as if alone.
    drafter: a `D3DForBlockDiffusion` (None: the target alone through the engine). asynchronous: successor drafting
    on a worker thread (`coverage`, `fanout`, `worker_threads`); drafter_device: where the drafter already is (checked,
    never moved to). drafter_input_ids: `(1, L)` the
    prompt the drafter reads when the target reads a reduced one (selective prefill; batch of one). compile:
    compiled verify and drafting passes (`passes_d3d.compiled_passes`, kept on the target and the drafter with their
    caches; the first calls compile, see docs/architecture.md "Compiled passes"). round_record: a `RoundRecord` to
    fill (also left in `drafter.round_record`). lookup: prompt lookup in the engine (None, the default: on beside a
    drafter unless `policy=False`, the hybrid; True, or the most drafts a lookup proposes, works without a drafter;
    False: the drafter alone); policy: what each row verifies each round is chosen for the most
    tokens per second (None or True, the default: the `policy_d3d.VerifyPolicy` kept on the drafter; a
    `VerifyPolicy`; False: the drafter's whole block every round, the paper's rule); see `policy_d3d.make_chooser`.
    verification: how sampled rows judge their drafts, "block" (block verification) or "token" (token by token, the
    paper's rule). streamer: as generate passes it (it has put the prompt already);
    d3d_streamer: the same from a front door (`front_door_kwargs`: generate drops `streamer=` before calling a
    callable), which gets the prompt here.
    Returns `(batch, P + longest)` sequences, rows that end early padded with `pad_token_id` (or a
    `GenerateDecoderOnlyOutput` with `return_dict_in_generate=True`).
    """
    check_prompts(input_ids, model_kwargs.get("attention_mask"))
    put_prompt = streamer is None and d3d_streamer is not None
    streamer = streamer if streamer is not None else d3d_streamer
    batch = input_ids.shape[0]
    if streamer is not None and batch > 1:
        raise ValueError("Streamers take one sequence; use serving_d3d.D3DBatchServer to stream many requests")
    if drafter_input_ids is not None and batch > 1:
        raise ValueError("drafter_input_ids (selective prefill) takes one prompt")
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    prompts = [input_ids[r][attention_mask[r].bool()] for r in range(batch)]
    drafter_prompt = drafter_input_ids[0].tolist() if drafter_input_ids is not None else None
    max_new_tokens = generation_config.max_length - input_ids.shape[1]
    longest_prompt = max([len(p) for p in prompts] + [len(drafter_prompt or [])])
    source = make_source(drafter, asynchronous, coverage, fanout, drafter_device, worker_threads, compile)
    engine = build_engine(model, source, batch, longest_prompt + max_new_tokens, compile, lookup, policy, verification)
    if round_record is not None:
        engine.round_record = round_record
    if drafter is not None:
        drafter.round_record = engine.round_record
    generated: dict[int, list[int]] = {r: [] for r in range(batch)}
    try:
        engine.add_rows([(r, prompt.tolist(), row_settings(model, generation_config, prompt.tolist(), logits_processor,
                                                           stopping_criteria, prepared_width=input_ids.shape[1],
                                                           synced_gpus=synced_gpus), drafter_prompt)
                         for r, prompt in enumerate(prompts)])
        if put_prompt:
            streamer.put(input_ids.cpu())
        for outcomes in engine.rounds():
            for outcome in outcomes:
                generated[outcome.key] += outcome.added
                if streamer is not None and outcome.added:
                    streamer.put(torch.tensor(outcome.added))
    finally:
        engine.close()
    if streamer is not None:
        streamer.end()
    sequences = pad_outputs(input_ids, generated, generation_config)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def pad_outputs(input_ids: torch.LongTensor, generated: dict[int, list[int]], generation_config) -> torch.LongTensor:
    """`(batch, P + longest)`: each row's prompt and new tokens, padded after them as `generate` pads."""
    pad = generation_config.pad_token_id
    if pad is None:
        pad = next(iter(sorted(eos_ids(generation_config))), 0)
    pad = int(torch.as_tensor(pad).reshape(-1)[0])
    longest = max(len(tokens) for tokens in generated.values())
    tail = torch.full((input_ids.shape[0], longest), pad, dtype=input_ids.dtype)
    for r, tokens in generated.items():
        tail[r, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, tail.to(input_ids.device)], dim=1)


__all__ = ["build_engine", "drafting_of", "front_door_kwargs", "make_source", "pad_outputs",
           "speculative_generate"]
