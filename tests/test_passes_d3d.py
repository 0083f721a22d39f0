"""Compiled passes (`passes_d3d.CompiledPasses`) on a CPU: the CUDA path's fixed shapes run eagerly (token identity,
each pass kind's shapes, one thread per compiled function, caches reused across calls), and one real compilation
(inductor) showing that after the documented warm-up no prompt length or batch size compiles again and no drafting
worker outlives its call."""

import threading

import pytest
import torch

from conftest import left_pad, tiny_target
from modeling_d3d import D3DForBlockDiffusion, RoundRecord, passes_d3d
from modeling_d3d.acceptance_d3d import RowSampling
from modeling_d3d.caches_d3d import StaticKVCache
from modeling_d3d.engine_d3d import compiled_graphs
from modeling_d3d.generation_d3d import speculative_generate
from modeling_d3d.passes_d3d import (PASS_KINDS, CompiledPasses, PassLayout, compiled_passes, prefill, prefill_groups,
                                     release_compiled_passes, run_pass)
from modeling_d3d.policy_d3d import SHORT_DRAFTS
from modeling_d3d.shapes_d3d import COMPILE_LENGTH_BUCKET, DYNAMIC_LENGTH_BUCKET, attended_columns, engine_size
from modeling_d3d.sources_d3d import BlockSource, catch_up
from modeling_d3d.successor_d3d import SuccessorSource, successor_pass
from policies import EveryChoice

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, BLOCK = 8, 4
COVERAGE, FANOUT = BLOCK, 2  # C = B: a round whose drafts are fewer than C - 1 plans fewer blocks


def pair(seed: int = 0):
    target = tiny_target(seed, vocab_size=VOCAB)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(seed + 10, vocab_size=VOCAB), block_size=BLOCK).eval()
    return target, drafter


def prompts(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return left_pad([torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths])


def ragged_settings(target, ids, mask, max_new_tokens: int) -> dict:
    """Greedy settings whose EOS (a token row 0 makes early: its first new one from its third token on, so that the
    row runs rounds after its first token, else its third) ends the rows at different rounds."""
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    made = plain[0, ids.shape[1] :].tolist()
    eos = next((token for k, token in enumerate(made) if k >= 2 and token not in made[:k]), made[2])
    return dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)


def decode(target, drafter, ids, mask, settings: dict, asynchronous: bool, record: RoundRecord | None = None,
           policy=False):
    """Compiled D3D, the drafter alone (no lookup); policy: the drafter's block every round unless given (the default
    policy's choices follow measured times)."""
    return target.generate(ids, attention_mask=mask, custom_generate=speculative_generate, drafter=drafter,
                           asynchronous=asynchronous, coverage=COVERAGE, fanout=FANOUT, compile=True,
                           round_record=record, lookup=False, policy=policy, **settings)


def fixed_passes(*models) -> dict:
    """Each model's fixed-shape `CompiledPasses` (the CUDA-graph path), eager, kept on the model as the engine would
    keep its own."""
    held = {model: CompiledPasses(model, fixed=True, compile=False) for model in models}
    for model, passes in held.items():
        model.d3d_compiled_passes = passes
    return held


class ShapeLog:
    """Wraps each forward of `CompiledPasses` to record `(kind, ids shape, mask shape)` per call."""

    def __init__(self):
        self.calls: list[tuple[str, tuple, tuple]] = []

    def watch(self, passes: CompiledPasses, *kinds: str) -> "ShapeLog":
        for kind in kinds:
            forward = passes.forward(kind)
            forward.function = self.recording(kind, forward.function)
        return self

    def recording(self, kind, function):
        def call(**kwargs):
            mask = kwargs["attention_mask"]["full_attention"]
            self.calls.append((kind, tuple(kwargs["input_ids"].shape), tuple(mask.shape)))
            return function(**kwargs)
        return call

    def shapes(self, kind: str) -> set[tuple]:
        return {(ids, mask) for k, ids, mask in self.calls if k == kind}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_fixed_shape_path_eager_is_token_identical_and_its_shapes_change_only_by_bucket(asynchronous):
    """The CUDA-graph path (fixed shapes: rows padded to a power-of-two slot count >= 2, the cache to a 256-column
    bucket, drafting widths to their largest round, every cache column attended), forced on a CPU without
    compiling: token-identical to the target's own `generate` on ragged batches of 3 and 1 rows and rows ending at
    different rounds, each round verifying nothing or the drafter's block by turns (`policies.EveryChoice`); within
    a call every pass kind has exactly one shape, set by the buckets (the verify pass two: one column when no row
    verifies drafts, else B); each forward is called from one thread (the successor pass from the drafter's worker,
    the others from the caller); the second call of the same buckets reuses the same caches."""
    target, drafter = pair()
    held = fixed_passes(target, drafter)
    kinds = ["verify", "block"] + (["successor"] if asynchronous else [])
    try:
        log = ShapeLog().watch(held[target], "verify").watch(held[drafter], "block", "successor")
        buffers, narrow_calls = {}, 0
        for lengths, seed, max_new in (([5, 11, 3], 0, 14), ([9], 1, 10), ([4, 7, 12], 2, 14)):
            ids, mask = prompts(lengths, seed)
            settings = ragged_settings(target, ids, mask, max_new)
            record = RoundRecord()
            log.calls.clear()
            output = decode(target, drafter, ids, mask, settings, asynchronous, record, EveryChoice(BLOCK))
            assert torch.equal(output, target.generate(ids, attention_mask=mask, **settings)), lengths
            if len(lengths) > 1:
                finished = [i for i, (outcomes, _) in enumerate(record.history) for o in outcomes if o.finished]
                assert len(set(finished)) > 1  # rows left the batch at different rounds
            slots, length = engine_size(len(lengths), max(lengths) + max_new, True)
            assert (slots, length) == (4 if len(lengths) == 3 else 2, COMPILE_LENGTH_BUCKET)
            target_columns = length + BLOCK
            drafter_columns = length + 1 + (2 if not asynchronous else (COVERAGE - 1) * FANOUT + 4) * BLOCK
            narrow = {((slots, 1), (slots, 1, 1, target_columns))}  # rounds where every row verified nothing
            passes = list(record.history)[1:]  # after the round of the first tokens, decided by the prefill
            if not any(all(o.verified == "nothing" for o in outcomes) for outcomes, _ in passes):
                narrow = set()
            narrow_calls += bool(narrow)
            expected = {"verify": {((slots, BLOCK), (slots, 1, BLOCK, target_columns))} | narrow,
                        "block": {((slots, 2 * BLOCK), (slots, 1, 2 * BLOCK, drafter_columns))}}
            width = 2 * BLOCK + ((COVERAGE - 1) * FANOUT + 1) * BLOCK
            expected["successor"] = {((slots, width), (slots, 1, width, drafter_columns))}
            for kind in kinds:
                assert log.shapes(kind) == expected[kind], kind
            pooled = [c.keys[0].data_ptr() for caches in held[target].caches.free.values() for c in caches
                      if c.slots == slots]
            assert len(pooled) == 1
            assert buffers.setdefault(slots, pooled[0]) == pooled[0]  # the same buckets: the same cache buffers
        assert narrow_calls >= 1
        main = threading.current_thread()
        assert not held[drafter].forwards["successor"].threads or asynchronous
        for passes in held.values():
            for kind, forward in passes.forwards.items():
                if kind not in kinds:
                    continue
                assert len(forward.threads) == 1, kind
                assert (forward.threads == {main}) == (kind != "successor"), kind
    finally:
        for model in held:
            release_compiled_passes(model)


def test_a_fixed_shape_successor_pass_has_one_width_whatever_the_drafts():
    """Rounds with fewer drafts than `C - 1` plan fewer branch blocks; with fixed shapes the pass is padded to the
    most blocks a round plans, `(C - 1) F + 1`, so it keeps one width (and its logits one shape)."""
    _, drafter = pair()
    passes = CompiledPasses(drafter, fixed=True, compile=False)
    log = ShapeLog().watch(passes, "successor")
    forward = passes.forward("successor")
    most = (COVERAGE - 1) * FANOUT + 1
    context = [1, 2, 3, 4, 5]
    cache = StaticKVCache(drafter.config, 2, 128, "cpu", drafter.dtype)
    logits_shapes = set()
    for count in range(1, BLOCK):
        prefill(drafter, cache, 0, [context[:-1]])
        drafts = [6] * count
        anchors = [(7, j) for j in range(min(COVERAGE - 1, count)) for _ in range(FANOUT)] + [(drafts[-1], count - 1)]
        logits = successor_pass(drafter, cache, [context], [len(context) - 1], [drafts], [anchors], forward, most)
        logits_shapes.add(tuple(logits.shape))
    width = 2 * BLOCK + most * BLOCK
    assert log.shapes("successor") == {((2, width), (2, 1, width, 128))}
    assert logits_shapes == {(1, most, BLOCK - 1, VOCAB)}


def test_after_the_warm_up_no_prompt_length_or_batch_size_compiles_again():
    """`compile=True` (inductor on a CPU), asynchronous: after the documented warm-up (a call of one row and a call
    of several), calls with new prompt lengths and another batch size compile nothing (neither in their rounds, which
    the round record counts, nor in their prefill, which runs through compiled graphs of its own), stay
    token-identical to `generate`, call the verify and block passes from the caller's thread and the successor pass
    from workers that end with their call."""
    torch._dynamo.reset()
    target, drafter = pair(1)
    try:
        warm_up = [([6, 10], 0), ([8], 1)]
        later = [([13, 5, 21], 2), ([30], 3), ([11, 40], 4)]
        counts = []
        for lengths, seed in warm_up + later:
            ids, mask = prompts(lengths, seed)
            settings = ragged_settings(target, ids, mask, 12)
            record, before = RoundRecord(), compiled_graphs()
            output = decode(target, drafter, ids, mask, settings, True, record)
            counts.append((record.compilations, compiled_graphs() - before))
            assert torch.equal(output, target.generate(ids, attention_mask=mask, **settings)), lengths
        assert counts[0][0] > 0 and counts[len(warm_up):] == [(0, 0)] * len(later), counts
        main = threading.current_thread()
        forwards = {**compiled_passes(target).forwards, **compiled_passes(drafter).forwards}
        assert sorted(forwards) == sorted(PASS_KINDS)
        threads = {kind: forward.threads for kind, forward in forwards.items()}
        assert threads["verify"] == threads["block"] == {main}, threads
        assert threads["successor"] and main not in threads["successor"], threads
        # no drafting thread outlives its call (its idle OpenMP team would slow every later CPU operation)
        assert not any(thread.is_alive() for thread in threads["successor"]), threads
    finally:
        release_compiled_passes(target)
        release_compiled_passes(drafter)


def test_compiled_passes_with_dynamic_shapes_attend_over_the_columns_in_use_only():
    """Compiled by inductor (dynamic shapes, a CPU), a pass attends over the columns its rows use, not the whole
    cache (`shapes_d3d.attended_columns`): a cache sized for a wider engine costs a pass nothing more. Columns past
    those are NaN here: a pass reading them would give NaN logits (a masked column's weight is 0, and 0 x NaN is NaN);
    the compiled pass's logits are the eager pass's, at two lengths in one compiled function."""
    torch._dynamo.reset()
    target, _ = pair(6)
    context = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(6)).tolist()
    forward = CompiledPasses(target, fixed=False).forward("verify")
    for start in (30, 41):
        logits = []
        for pass_forward in (None, forward):
            cache = StaticKVCache(target.config, 2, 128, "cpu", target.dtype)
            prefill(target, cache, 0, [context[:start], context[: start - 3]])
            for buffer in cache.keys + cache.values:
                buffer[:, :, start + 4 :] = float("nan")
            step = PassLayout.causal(torch.tensor([context[start : start + 4], context[start - 3 : start + 1]]),
                                     torch.tensor([start, start - 3]))
            logits.append(run_pass(target, cache, step, 4, forward=pass_forward))
        assert logits[1].isfinite().all(), start
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_a_prefill_from_the_first_row_runs_through_the_compiled_pass_and_others_eagerly():
    """`prefill` with a compiled pass of dynamic shapes runs a group of rows from cache row 0 through it (its keys,
    values and last logits the eager prefill's), a group from another row eagerly (the rows a pass starts at are a
    constant of its graphs), and a pass with fixed shapes never (a CUDA graph would be recorded per prompt length)."""
    torch._dynamo.reset()
    target, _ = pair(6)
    generator = torch.Generator().manual_seed(6)
    contexts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (20, 23, 9)]
    forward = CompiledPasses(target, fixed=False).forward("prefill")
    fixed = passes_d3d.compiled_forward(target, "prefill", fixed=True, compile=False)

    def through(pass_forward, cache, first_slot, rows):
        """`prefill` of `rows` from `first_slot` with `pass_forward`: its last logits, the threads that called it."""
        if pass_forward is not None:
            pass_forward.threads.clear()
        output = prefill(target, cache, first_slot, rows, last_logits=True, forward=pass_forward)
        return output, set(pass_forward.threads) if pass_forward is not None else set()

    caches, logits, callers = [], [], []
    for pass_forward in (None, forward, fixed):
        cache = StaticKVCache(target.config, 3, 64, "cpu", target.dtype)
        first, in_first = through(pass_forward, cache, 0, contexts[:2])
        last, in_last = through(pass_forward, cache, 2, contexts[2:])
        caches.append(cache)
        logits.append(torch.cat([first, last]))
        callers.append((in_first, in_last))
    main = {threading.current_thread()}
    assert callers[1:] == [(main, set()), (set(), set())], callers  # rows 0-1 compiled, row 2 eager; fixed: never
    for cache, output in zip(caches[1:], logits[1:]):
        torch.testing.assert_close(output, logits[0], rtol=1e-4, atol=1e-4)
        assert cache.committed == caches[0].committed == (19, 22, 8)
        for buffer, reference in zip(cache.keys + cache.values, caches[0].keys + caches[0].values):
            for slot, length in enumerate(cache.committed):
                torch.testing.assert_close(buffer[slot, :, :length], reference[slot, :, :length], rtol=1e-4,
                                           atol=1e-4)


def test_a_compiled_pass_takes_the_cache_as_two_tensors_whatever_the_models_depth():
    """A compiled call's host work grows with the tensors it takes (dynamo's guards, several Python checks per tensor
    of dynamic size, and the handling of each written input): a cache of one buffer per layer made it grow with the
    model's depth (docs/results.md 2026-12-07). The real verify pass, traced by dynamo for a backend that runs the
    captured graph eagerly: of its inputs, those holding the cache's keys and values are two, at 2 and at 4 layers,
    and its logits are the eager pass's."""
    for layers in (2, 4):
        torch._dynamo.reset()
        target = tiny_target(7, vocab_size=VOCAB, layers=layers)
        caches = [StaticKVCache(target.config, 2, 32, "cpu", target.dtype) for _ in range(2)]
        storages = {buffer.untyped_storage().data_ptr() for buffer in caches[1].keys + caches[1].values}
        taken = []

        def backend(graph, example_inputs):
            taken.append(sum(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages
                             for t in example_inputs))
            return graph.forward

        forward = passes_d3d.CompiledForward(torch.compile(passes_d3d.pass_function(target, "verify"),
                                                           backend=backend), fixed_shapes=False)
        context = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(7)).tolist()
        logits = []
        for cache, pass_forward in zip(caches, (None, forward)):
            prefill(target, cache, 0, [context[:8], context[:6]])
            step = PassLayout.causal(torch.tensor([context[8:11], context[6:9]]), torch.tensor([8, 6]))
            logits.append(run_pass(target, cache, step, 3, forward=pass_forward))
        assert taken == [2], (layers, taken)
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_compiled_passes_hold_no_guard_on_the_model_and_compile_again_when_it_changes():
    """Compiled passes skip dynamo's guards on the model (`guards_d3d`): the verify pass's graph holds none. In their
    place `CompiledPasses` compares the model with the one it compiled for when an engine is built: a second call
    reuses the compiled forward; after each change of the model (a forward hook added, every layer's activation
    swapped, a norm's epsilon changed) the next call compiles anew and stays token-identical to `generate` (each of
    them, without the check, runs the stale graph: other tokens)."""
    torch._dynamo.reset()
    target = tiny_target(8, vocab_size=64)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(8))
    settings = dict(max_new_tokens=6, do_sample=False)
    try:
        forwards = []
        for change in (None, None, "hook", "activation", "epsilon"):
            if change == "hook":
                target.model.norm.register_forward_hook(lambda module, args, output: -output)
            elif change == "activation":
                for layer in target.model.layers:
                    layer.mlp.act_fn = torch.nn.Tanh()
            elif change == "epsilon":
                target.model.layers[0].input_layernorm.variance_epsilon = 10.0
            output = target.generate(ids, custom_generate=speculative_generate, drafter=None, lookup=False,
                                     compile=True, **settings)
            assert torch.equal(output, target.generate(ids, **settings)), change
            forwards.append(compiled_passes(target).forwards["verify"])
        assert forwards[1] is forwards[0] and len({id(forward) for forward in forwards[1:]}) == 4
        code = forwards[0].one_column._torchdynamo_orig_callable.__code__
        guards = [str(entry.guard_manager) for entry in torch._dynamo.eval_frame._debug_get_cache_entry_list(code)]
        assert len(guards) == 1 and "past_key_values" in guards[0] and "L['model']" not in guards[0]
    finally:
        release_compiled_passes(target)


def test_a_new_cache_size_after_plain_steps_and_blocks_compiles_nothing():
    """`compile=True` (inductor on a CPU), synchronous, every kind of round by turns (`policies.EveryChoice` with a
    lookup: the verify pass one column wide, then `B`, then a tree): after a warm-up of one row and of two, a call whose
    cache is of the next size (its prompt past the warm-up's length bucket, `shapes_d3d.DYNAMIC_LENGTH_BUCKET`) compiles
    nothing and stays token-identical to `generate`. The verify pass first compiles for one column (PyTorch specialises
    a size of 1), then for every width: a mask passed as a view of a larger tensor had that tensor's cache size
    specialised in the second graph, and the first new cache size compiled once more (4 s a verify pass on the
    quickstart's target)."""
    torch._dynamo.reset()
    target, drafter = pair(3)
    try:
        counts = []
        calls = (([12], 0), ([14, 20], 1), ([DYNAMIC_LENGTH_BUCKET + 5], 2), ([13, DYNAMIC_LENGTH_BUCKET], 3))
        for lengths, seed in calls:
            ids, mask = prompts(lengths, seed)
            ids[:, -6:] = ids[:, -12:-6]  # a repeat, so that lookups find continuations
            settings = dict(max_new_tokens=12, do_sample=False)
            record = RoundRecord()
            output = target.generate(ids, attention_mask=mask, custom_generate=speculative_generate, drafter=drafter,
                                     compile=True, lookup=True, policy=EveryChoice(BLOCK), round_record=record,
                                     **settings)
            assert torch.equal(output, target.generate(ids, attention_mask=mask, **settings)), lengths
            assert {o.verified for outcomes, _ in record.history for o in outcomes} >= {"nothing", "block", "lookup"}
            counts.append(record.compilations)
        assert counts[0] > 0 and counts[2:] == [0, 0], counts
    finally:
        release_compiled_passes(target)
        release_compiled_passes(drafter)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_fixed_shape_path_verifies_long_lookups_in_the_trees_shape(asynchronous):
    """The hybrid (`lookup=True`: lookups up to `2B - 2` drafts) on the fixed-shape path, forced eagerly, every kind of
    round by turns (`policies.EveryChoice`, long lookups among them: `RoundPlan.long`, a causal pass of the tree's
    width that may keep up to `2B - 1` tokens, and short rounds): token-identical to `generate` on a ragged batch; the
    verify pass takes the policy's four widths only (1, a short round's, B, 2B - 1), and the block pass one shape
    (rows more than `B` behind after a long round are brought up first, `sources_d3d.catch_up`)."""
    target, drafter = pair(5)
    held = fixed_passes(target, drafter)
    try:
        log = ShapeLog().watch(held[target], "verify").watch(held[drafter], "block")
        ids, mask = prompts([10, 6], 7)
        settings = dict(max_new_tokens=48, do_sample=False)
        record = RoundRecord()
        output = target.generate(ids, attention_mask=mask, custom_generate=speculative_generate, drafter=drafter,
                                 asynchronous=asynchronous, coverage=COVERAGE, fanout=FANOUT, compile=True,
                                 lookup=True, policy=EveryChoice(BLOCK, short_every=6), round_record=record,
                                 **settings)
        assert torch.equal(output, target.generate(ids, attention_mask=mask, **settings))
        assert record.long_lookups > 0 and max(record.accepted) > BLOCK  # a long lookup kept more than a block
        widths = {ids[1] for ids, _ in log.shapes("verify")}
        assert {SHORT_DRAFTS + 1, 2 * BLOCK - 1} <= widths <= {1, SHORT_DRAFTS + 1, BLOCK, 2 * BLOCK - 1}
        assert len(log.shapes("block")) == 1
    finally:
        for model in held:
            release_compiled_passes(model)


def test_the_bounds_compiled_passes_are_the_graphs_the_engine_runs():
    """`d3d bench` times the compiled verify and block passes for its ideal bound (`engine_pass_seconds(compile=True)`)
    on caches of a compiled engine's size: the engine's calls of one prompt afterwards (the target alone, one token
    a pass; D3D sync, a block a pass) add no compiled graph to either, so the bound times the graphs the engine runs
    and the measurement compiles nothing the engine does not use. The verify pass's one-column calls have a compiled
    function of their own (`CompiledForward.one_column`), so neither verify function holds more than one graph here
    (in one, a wider call's graph, checked first after a wider round, rejected a plain step only at its last guard)."""
    from d3d.benchmark.forward_cost import engine_pass_seconds

    torch._dynamo.reset()
    target, drafter = pair(2)
    try:
        engine_pass_seconds(target, drafter, prefix_length=9, repeats=1, compile=True)
        verify = compiled_passes(target).forward("verify")
        functions = verify.function, verify.one_column, compiled_passes(drafter).forward("block").function
        codes = [function._torchdynamo_orig_callable.__code__ for function in functions]
        measured = [len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) for code in codes]
        assert measured[:2] == [1, 1] and measured[2], measured
        ids, mask = prompts([7], 5)
        for source in ({}, {"drafter": drafter, "policy": False}):  # D3D sync: the block every round
            output = target.generate(ids, attention_mask=mask, custom_generate=speculative_generate, compile=True,
                                     max_new_tokens=10, do_sample=False, **source)
            assert torch.equal(output, target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False))
        assert [len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) for code in codes] == measured
    finally:
        release_compiled_passes(target)
        release_compiled_passes(drafter)


def test_the_bounds_fixed_shape_passes_have_the_engines_shapes():
    """The CUDA-graph path (fixed shapes, forced eagerly on a CPU): the passes `engine_pass_seconds` times for the
    ideal bound (verify over 1 and B tokens, the drafter's block pass) have exactly the shapes of the engine's for
    one prompt (the target alone and D3D sync), rows and cache columns padded alike, and reuse the engine's pooled
    cache buffers, so a graph recorded for the bound is the one the engine replays. (Its tree pass, 2B - 1 columns,
    runs on D3D sync's cache, which has room for them.)"""
    from d3d.benchmark.forward_cost import engine_pass_seconds

    target, drafter = pair(3)
    held = fixed_passes(target, drafter)
    try:
        log = ShapeLog().watch(held[target], "verify").watch(held[drafter], "block")
        # a prefix near the end of a 256-column bucket: every pass is sized from one engine, not by its own width
        engine_pass_seconds(target, drafter, prefix_length=250, repeats=8, compile=True)
        measured = {kind: log.shapes(kind) for kind in ("verify", "block")}

        def pooled() -> dict:
            return {key: [c.keys[0].data_ptr() for c in caches] for passes in held.values()
                    for key, caches in passes.caches.free.items()}

        before = pooled()
        log.calls.clear()
        ids, mask = prompts([7], 5)
        for source in ({}, {"drafter": drafter, "policy": False}):  # D3D sync: the block every round
            output = target.generate(ids, attention_mask=mask, custom_generate=speculative_generate, compile=True,
                                     max_new_tokens=10, do_sample=False, **source)
            assert torch.equal(output, target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False))
        engine = {kind: log.shapes(kind) for kind in ("verify", "block")}
        tree = {shape for shape in measured["verify"] if shape[0][1] == 2 * drafter.config.block_size - 1}
        assert len(tree) == 1 and len(measured["verify"]) == 3 and len(measured["block"]) == 1, measured
        assert {"verify": measured["verify"] - tree, "block": measured["block"]} == engine, (measured, engine)
        assert pooled() == before  # the engine took the bound's caches and gave them back: no new buffers
    finally:
        for model in held:
            release_compiled_passes(model)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_calls_in_and_out_of_inference_mode_stay_lossless_with_pooled_caches(asynchronous):
    """Users decode under `torch.inference_mode()`: the drafting worker runs in the caller's modes (caches made under
    it can be updated in place only under it), and a pooled cache made under it is not handed to a later call
    outside it (nor the other way round). The fixed-shape path, forced eagerly, pools every cache."""
    target, drafter = pair(4)
    held = fixed_passes(target, drafter)
    try:
        ids, mask = prompts([6, 3], 9)
        expected = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        for inference in (True, False, True):
            with torch.inference_mode(inference):
                output = target.generate(ids, attention_mask=mask, custom_generate=speculative_generate,
                                         drafter=drafter, compile=True, asynchronous=asynchronous,
                                         max_new_tokens=10, do_sample=False)
            assert torch.equal(output, expected), inference
    finally:
        for model in held:
            release_compiled_passes(model)


def test_the_cache_pool_stays_bounded_over_many_prompt_lengths_and_reuses_nearby_ones():
    """300 calls with ever new prompt lengths and batch sizes through the dynamic-shape (CPU) compiled path, eager:
    the caches the pools keep stay within their ceiling (twice the largest cache handed out), where a pool keyed by
    each exact length would keep one more cache per call; calls whose lengths fall in one bucket share one cache."""
    target, drafter = pair(4)
    held = {model: CompiledPasses(model, compile=False) for model in (target, drafter)}
    for model, passes in held.items():
        model.d3d_compiled_passes = passes
    try:
        lengths = torch.randperm(300, generator=torch.Generator().manual_seed(0)) + 1
        for call, length in enumerate(lengths.tolist()):
            ids, mask = prompts([length] + [1 + length // 2] * (call % 3), call)
            output = target.generate(ids, attention_mask=mask, custom_generate=speculative_generate, drafter=drafter,
                                     compile=True, max_new_tokens=2, do_sample=False)
            if call % 50 == 0:
                assert torch.equal(output, target.generate(ids, attention_mask=mask, max_new_tokens=2,
                                                           do_sample=False))
            for passes in held.values():
                assert 0 < passes.caches.free_bytes() <= 2 * passes.caches.largest, call
        assert all(sum(map(len, passes.caches.free.values())) < 20 for passes in held.values())

        def first_buffer() -> int:
            (cache,) = held[target].caches.free[next(reversed(held[target].caches.free))][-1:]
            return cache.keys[0].data_ptr()

        ids, mask = prompts([3], 0)
        target.generate(ids, attention_mask=mask, custom_generate=speculative_generate, compile=True, max_new_tokens=2)
        buffer = first_buffer()
        ids, mask = prompts([9], 1)  # 9 + 2 and 3 + 2 fall in one bucket
        target.generate(ids, attention_mask=mask, custom_generate=speculative_generate, compile=True, max_new_tokens=2)
        assert first_buffer() == buffer
    finally:
        for model in held:
            release_compiled_passes(model)


def test_only_a_plain_decoding_step_attends_without_a_mask():
    """`run_pass` drops the mask (as `generate`'s steps have none) only when each row is one query that sees every
    attended column: rows of one length stepping one token; never for ragged rows, several columns or a block."""
    def step(starts: list[int], width: int = 1) -> tuple[PassLayout, int]:
        layout = PassLayout.causal(torch.zeros(len(starts), width, dtype=torch.long), torch.tensor(starts))
        return layout, layout.kv_length()

    assert step([7])[0].sees_every_column(step([7])[1])
    assert step([7, 7])[0].sees_every_column(step([7, 7])[1])
    assert not step([7, 5])[0].sees_every_column(step([7, 5])[1])  # the shorter row must not see the longer's columns
    assert not step([7], width=2)[0].sees_every_column(step([7], width=2)[1])  # causal inside the pass
    layout, kv_length = step([7])
    assert not layout.sees_every_column(kv_length + 1)  # a column beyond the row's prefix
    blocked = PassLayout(*layout.fields()[:4], torch.tensor([[10]]), torch.tensor([[12]]))  # sees its own block too
    assert not blocked.sees_every_column(kv_length)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_eager_passes_under_the_cuda_rule_attend_over_whole_buckets_and_stay_exact(asynchronous, monkeypatch):
    """On CUDA an eager pass attends over a multiple of `EAGER_CUDA_KV_BUCKET` cache columns (`attended_columns`;
    cuDNN's attention builds a plan per shape), the mask hiding the columns beyond each row's prefix. Run here with the
    CUDA rule on a CPU: ragged rows ending at different rounds, nothing or the drafter's block verified by turns,
    token for token the target's own `generate`, with passes whose needed length is not a whole bucket."""
    assert [attended_columns(n, 1000, "cuda") for n in (1, 128, 129, 300)] == [128, 128, 256, 384]
    assert attended_columns(129, 200, "cuda") == 200 and attended_columns(129, 1000, "cpu") == 129
    widened = []

    def cuda_rule(needed: int, capacity: int, device, compiled: bool = False) -> int:
        columns = attended_columns(needed, capacity, "cuda", compiled)
        widened.append(columns > needed)
        return columns

    target, drafter = pair()
    context = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(4)).tolist()

    def step_logits(starts: list[int]) -> torch.Tensor:  # one decoding step of rows with `starts` tokens cached
        cache = StaticKVCache(target.config, len(starts), 300, "cpu", target.dtype)
        prefill(target, cache, 0, [context[:start] for start in starts])
        step = PassLayout.causal(torch.tensor([[context[start]] for start in starts]), torch.tensor(starts))
        return run_pass(target, cache, step, 1)

    exact = [step_logits(starts) for starts in ([140], [140, 140], [140, 100])]
    monkeypatch.setattr(passes_d3d, "attended_columns", cuda_rule)
    for starts, logits in zip(([140], [140, 140], [140, 100]), exact):
        torch.testing.assert_close(step_logits(starts), logits, rtol=1e-5, atol=1e-5)
    ids, mask = prompts([120, 131, 97], 3)
    settings = ragged_settings(target, ids, mask, 20)
    output = target.generate(ids, attention_mask=mask, custom_generate=speculative_generate, drafter=drafter,
                             asynchronous=asynchronous, policy=EveryChoice(BLOCK), **settings)
    monkeypatch.undo()
    assert torch.equal(output, target.generate(ids, attention_mask=mask, **settings))
    assert sum(widened) > len(widened) // 2


def test_prefill_groups_rows_while_padding_stays_small():
    assert prefill_groups([5, 5, 6, 20, 21, 0]) == [(0, 3), (3, 2), (5, 1)]
    assert prefill_groups([4] * 8) == [(0, 8)] and prefill_groups([]) == [] and prefill_groups([0, 0]) == [(0, 2)]
    assert prefill_groups([4096] * 5) == [(0, 2), (2, 2), (4, 1)]  # long prompts: a few rows a pass (mask memory)


def test_rows_far_behind_catch_up_to_what_a_prefill_holds_and_rows_between_keep_their_cache():
    """With fixed shapes, before a block pass, rows whose drafter cache is more than `B` tokens behind (rounds that
    verified lookups or nothing) are brought up to their anchors in `prefill` passes (fewer than a pass per row where
    their tails are alike), each then holding what a prefill of its whole context holds; a row between them that is
    not behind, and a row after the last, keep their caches. Without fixed shapes the block pass reads the lags."""
    _, drafter = pair(6)
    generator = torch.Generator().manual_seed(1)
    vocab = drafter.config.vocab_size
    contexts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (30, 26, 33, 31, 20)]
    held = [10, 22, 12, 11, 19]  # rows 0, 2 and 3 are more than B = 4 tokens behind their anchors, 1 and 4 are not
    cache = StaticKVCache(drafter.config, len(contexts), 64, "cpu", drafter.dtype)
    for slot, (context, length) in enumerate(zip(contexts, held)):
        prefill(drafter, cache, slot, [context[:length]])
    before = [layer.clone() for layer in cache.keys]
    passes = []
    drafter.register_forward_hook(lambda module, args, kwargs, output: passes.append(kwargs["input_ids"].shape),
                                  with_kwargs=True)
    assert catch_up(drafter, cache, contexts, fixed=False) == 0.0 and passes == []  # the block pass reads lags
    catch_up(drafter, cache, contexts, fixed=True)
    assert len(passes) == 2, passes  # row 0 alone, rows 2 and 3 (tails of 20 and 19 tokens) together
    assert cache.committed == (29, 22, 32, 30, 19)
    assert catch_up(drafter, cache, contexts, fixed=True) == 0.0 and len(passes) == 2  # nothing behind: no pass
    fresh = StaticKVCache(drafter.config, len(contexts), 64, "cpu", drafter.dtype)
    for slot, context in enumerate(contexts):
        prefill(drafter, fresh, slot, [context[:-1]])
    for buffers, expected in ((cache.keys, fresh.keys), (cache.values, fresh.values)):
        for layer, reference in zip(buffers, expected):
            for slot, length in enumerate(cache.committed):
                torch.testing.assert_close(layer[slot, :, :length], reference[slot, :, :length])
    for layer, old in zip(cache.keys, before):
        assert torch.equal(layer[1, :, :22], old[1, :, :22]) and torch.equal(layer[4], old[4])


@pytest.mark.parametrize("successor", [False, True])
def test_a_row_padded_for_another_far_behind_writes_nothing_past_its_caches_end(successor):
    """A batch whose rows skipped the drafter for different rounds (lookups, long ones up to `2B - 1` tokens a round):
    on an eager or inductor engine the drafting pass reads each row's missed tokens in its causal part, as wide as the
    row furthest behind, and pads the others; a row near the end of its cache padded for a row `8B` behind wrote past
    the cache's last column (`plan` refused the pass on a CPU; on CUDA the write indexes out of the buffer). Padding
    now writes its room of scratch columns in turn, and the pass drafts what it drafts for rows already caught up."""
    _, drafter = pair(8)
    max_length, generator = 40, torch.Generator().manual_seed(3)
    contexts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (max_length - 1, 36)]
    sampling = [RowSampling() for _ in contexts]

    def drafts(lags):
        source = SuccessorSource(drafter, 2, 1) if successor else BlockSource(drafter)
        try:
            source.allocate(2, max_length + 1)
            for slot, (context, lag) in enumerate(zip(contexts, lags)):
                prefill(drafter, source.cache, slot, [context[: len(context) - 1 - lag]])
            return source.propose(contexts, sampling).drafts
        finally:
            source.close()

    torch.testing.assert_close(drafts([0, 8 * BLOCK]), drafts([0, 0]))


def test_a_catch_up_beside_a_row_near_its_caches_end_writes_nothing_past_it():
    """Two rows caught up in one pass, one far behind, one a little behind at the end of its cache: the shorter part
    re-reads tokens before its start rather than pad past its row's end (which would lie past the cache's last column:
    `plan` refuses such a pass on a CPU, and on CUDA the write would index out of the buffer). Found by a review."""
    _, drafter = pair(7)
    generator = torch.Generator().manual_seed(2)
    contexts = [torch.randint(0, drafter.config.vocab_size, (n,), generator=generator).tolist() for n in (200, 255)]
    cache = StaticKVCache(drafter.config, 2, 256 + 1 + 2 * BLOCK, "cpu", drafter.dtype)
    for slot, (context, behind) in enumerate(zip(contexts, (20, 5))):
        prefill(drafter, cache, slot, [context[: len(context) - 1 - behind]])
    catch_up(drafter, cache, contexts, fixed=True)
    assert cache.committed == (199, 254)
    fresh = StaticKVCache(drafter.config, 2, cache.capacity, "cpu", drafter.dtype)
    for slot, context in enumerate(contexts):
        prefill(drafter, fresh, slot, [context[:-1]])
    for layer, reference in zip(cache.keys + cache.values, fresh.keys + fresh.values):
        for slot, length in enumerate(cache.committed):
            torch.testing.assert_close(layer[slot, :, :length], reference[slot, :, :length])
    with pytest.raises(RuntimeError, match="past a row's tokens"):
        prefill(drafter, cache, 0, [contexts[0][:10]], starts=[11])


def test_rows_prefilled_together_hold_what_each_prefilled_alone_holds():
    """Right-padded rows of one prefill pass: each row's committed keys and values are the ones a pass over that row
    alone writes (its padding columns lie past its end, which no real column sees)."""
    target, _ = pair(5)
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    rows = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (9, 10, 10, 12, 3, 0)]
    together = StaticKVCache(target.config, len(rows), 64, "cpu", target.dtype)
    prefill(target, together, 0, rows)
    alone = StaticKVCache(target.config, len(rows), 64, "cpu", target.dtype)
    for slot, tokens in enumerate(rows):
        prefill(target, alone, slot, [tokens])
    assert together.committed == alone.committed == tuple(len(tokens) for tokens in rows)
    for buffers, expected in ((together.keys, alone.keys), (together.values, alone.values)):
        for layer, reference in zip(buffers, expected):
            for slot, tokens in enumerate(rows):
                torch.testing.assert_close(layer[slot, :, : len(tokens)], reference[slot, :, : len(tokens)])
