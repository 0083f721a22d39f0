"""The quickstart fitted to a time budget: the projection, the scaled recipe, and a budgeted run end to end."""

import json
import time
from dataclasses import asdict, fields, replace

import pytest

from conftest import tiny_target
from d3d.quickstart.budget import (MIN_BENCH_PROMPTS, MIN_STEPS, UnitCosts, _decoding_seconds, fit, projected_seconds,
                                   scaled)
from d3d.quickstart.pipeline import MICRO, run_quickstart
from d3d.quickstart.recipe import Recipe, recorded_recipe
from d3d.quickstart.sizes import QuickstartSizes

# Seconds per unit on the slowest CPU measured so far (a Zen 1 EPYC, AVX2 only, float32; docs/results.md): a target
# training step 3.8 s, the assistant's 0.76 s, the target's batched decoding of 64 rows 8.2 s for 128 tokens (the
# drafter's step and one row's decoding step, not measured there, of the same order as the assistant's and ~1.5x the
# Intel Xeon's).
ZEN_1 = UnitCosts(target_step=3.82, assistant_step=0.76, drafter_step=0.3, batch_prefill=0.5, batch_token=7.7 / 128,
                  row_token=0.012)
FAST = UnitCosts(target_step=0.3, assistant_step=0.05, drafter_step=0.05, batch_prefill=0.1, batch_token=0.01,
                 row_token=0.003)


def counts(sizes: QuickstartSizes) -> dict[str, int]:
    """Every count the scale applies to."""
    return {"target": sizes.target.steps, "assistant": sizes.assistant.steps, "responses": sizes.drafter_prompts,
            "drafter": sizes.drafter_steps, "recovery": sizes.recovery_steps, "humaneval": sizes.bench_prompts,
            "pydoc": sizes.bench_pydoc_prompts}


def total(sizes: QuickstartSizes, costs: UnitCosts) -> float:
    return sum(projected_seconds(sizes, costs).values())


def test_a_recipe_projected_within_the_budget_is_the_default_unchanged():
    sizes = QuickstartSizes()
    assert total(sizes, FAST) < 25 * 60
    assert fit(sizes, FAST, 25 * 60) == (sizes, 1.0)


def test_a_slow_machine_gets_the_largest_scale_whose_projection_fits():
    sizes = QuickstartSizes()
    assert total(sizes, ZEN_1) > 60 * 60  # the default recipe there: well over an hour
    fitted, factor = fit(sizes, ZEN_1, 25 * 60)
    assert 0 < factor < 1 and fitted == scaled(sizes, factor)
    assert total(fitted, ZEN_1) <= 25 * 60 < total(scaled(sizes, factor + 0.01), ZEN_1)
    # Only counts change: the shapes, the dtype's training and the benchmark's length are the default's.
    changed = {f.name for f in fields(QuickstartSizes) if getattr(fitted, f.name) != getattr(sizes, f.name)}
    assert changed <= {"target", "assistant", "drafter_prompts", "drafter_steps", "recovery_steps", "bench_prompts",
                       "bench_pydoc_prompts"}
    assert replace(fitted.target, steps=sizes.target.steps) == sizes.target


def test_scaling_keeps_every_count_between_its_floor_and_the_default():
    sizes = QuickstartSizes()
    default = counts(sizes)
    for factor in (1.0, 0.5, 0.1, 0.01):
        scaled_counts = counts(scaled(sizes, factor))
        assert all(scaled_counts[name] <= default[name] for name in default), factor
        assert min(scaled_counts[name] for name in ("target", "assistant", "drafter", "recovery")) >= min(
            MIN_STEPS, default["recovery"])
        assert min(scaled_counts["humaneval"], scaled_counts["pydoc"]) >= MIN_BENCH_PROMPTS
        assert scaled_counts["responses"] > 2 * sizes.dev_prompts  # training data is left after the dev prompts
    assert scaled(sizes, 1.0) == sizes
    assert counts(scaled(sizes, 0.5))["target"] == sizes.target.steps // 2


def test_a_budgeted_first_run_scales_its_recipe_and_a_rerun_keeps_it(tmp_path, capsys):
    sizes = replace(MICRO, bench_prompts=2 * MIN_BENCH_PROMPTS, target=replace(MICRO.target, steps=2 * MIN_STEPS))
    results = run_quickstart(tmp_path, sizes, budget_minutes=1e-4)  # no recipe fits: every count at its floor
    recorded = json.loads((tmp_path / "sizes.json").read_text())
    assert recorded["scale"] == 0.01 and "every step and prompt count scaled to 0.01" in capsys.readouterr().out
    assert recorded["bench_prompts"] == MIN_BENCH_PROMPTS and recorded["target"]["steps"] == MIN_STEPS
    assert results["prompt_sets"]["humaneval"]["prompts"] == MIN_BENCH_PROMPTS  # the benchmark ran the scaled recipe
    assert set(recorded["projected_seconds"]) == {"target", "assistant", "responses", "drafter", "pruning", "benchmark"}
    assert all(value > 0 for value in recorded["unit_costs"].values())
    assert {"target", "assistant", "responses", "drafter", "pruning", "benchmark"} <= set(recorded["seconds"])

    run_quickstart(tmp_path, sizes, budget_minutes=None)  # a rerun: the first run's recipe, every stage kept
    assert "kept from the first run" in capsys.readouterr().out
    again = json.loads((tmp_path / "sizes.json").read_text())
    assert {key: again[key] for key in asdict(sizes)} == {key: recorded[key] for key in asdict(sizes)}
    assert again["seconds"]["target"] == recorded["seconds"]["target"]


def test_a_folder_keeps_the_recipe_it_records_and_refuses_other_sizes(tmp_path):
    assert recorded_recipe(tmp_path, MICRO) is None
    Recipe(scaled(MICRO, 0.5), {"scale": 0.5}, {"target": 3.0}).write(tmp_path, "float32")
    kept = recorded_recipe(tmp_path, MICRO)
    assert kept.sizes == scaled(MICRO, 0.5) and kept.plan == {"scale": 0.5} and kept.seconds == {"target": 3.0}
    with pytest.raises(ValueError, match="holds a quickstart of other sizes"):
        recorded_recipe(tmp_path, QuickstartSizes())  # the default recipe into a --micro folder
    # A folder from before the time plan: its sizes as they are, at scale 1.
    (tmp_path / "sizes.json").write_text(json.dumps({"dtype": "float32", **asdict(MICRO)}))
    assert recorded_recipe(tmp_path, MICRO) == Recipe(MICRO)
    (tmp_path / "sizes.json").write_text('{"dtype": "float32", "vocab')  # torn: one clear line, nothing guessed
    with pytest.raises(ValueError, match="is not a quickstart recipe"):
        recorded_recipe(tmp_path, MICRO)


def test_a_pause_in_the_decoding_probe_does_not_make_later_tokens_free():
    """A process paused in every timed one-token call (a busy machine: CI beside a quickstart) made the 17-token call
    look no longer, and later tokens cost 0 s: every projection of decoding stages was then 0."""
    target = tiny_target(3).eval()
    calls = []

    def generate(*args, max_new_tokens, **kwargs):
        calls.append(max_new_tokens)
        if max_new_tokens == 1 and len(calls) > 1:  # the timed one-token calls, not the untimed first
            time.sleep(0.05)
        return type(target).generate(target, *args, max_new_tokens=max_new_tokens, **kwargs)

    target.generate = generate
    first, later = _decoding_seconds(target, [[1, 2, 3], [4, 5]], pad_token_id=0)
    assert first >= 0.05 and later > 0
