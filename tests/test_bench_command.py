"""`d3d bench` on tiny saved models and a prompt file: the table, JSON and plot, every method lossless, the round
split and the ideal bounds consistent (no timing thresholds)."""

import json
import math
from collections import Counter

from conftest import tiny_target, word_tokenizer
from d3d.benchmark.bench import build_methods, ideal_bounds
from d3d.cli.main import main
from d3d.common.measure import MethodRun
from d3d.common.report import speed_title
from modeling_d3d import D3DForBlockDiffusion
from modeling_d3d.policy_d3d import BLOCK, BOTH, LOOKUP, NOTHING

ROUND_SPLIT = ("ms_per_round", "verify_ms_per_round", "exposed_draft_ms_per_round", "overhead_ms_per_round")


def test_bench_command_writes_table_json_and_plot(tmp_path, capsys):
    tiny_target(0, layers=2).save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    tiny_target(5, layers=1).save_pretrained(tmp_path / "assistant")
    D3DForBlockDiffusion.from_backbone(tiny_target(0, layers=2), block_size=4).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"w{i} w{i + 3} w{i + 7}"}) for i in range(3)))
    code = main(["bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                 "--assistant", str(tmp_path / "assistant"), "--prompts", str(prompts), "--max-new-tokens", "12",
                 "--sweep", "1x0,2x1", "--compile", "none", "--dtype", "float32", "--output", str(tmp_path / "bench")])
    assert code == 0
    table = capsys.readouterr().out
    for name in ("target generate", "target alone, engine", "HF assisted, AR assistant", "prompt lookup (10)",
                 "D3D sync", "D3D async C=4 F=2", "D3D sync, assistant_model=drafter"):
        assert f"| {name} |" in table
    assert "budget sweep" in table and "dtype: float32 (--dtype)" in table
    results = json.loads((tmp_path / "bench" / "bench.json").read_text())
    methods = {m["method"]: m for m in results["prompt_sets"]["prompts"]["methods"]}
    assert list(methods)[:2] == ["target generate", "target alone, engine"]
    assert all(m["lossless"] and m["identical_outputs"] == 3 for m in methods.values())
    assert methods["target generate"]["speedup_vs_generate"] == 1.0
    assert max(m["speedup"] for m in methods.values() if m["method"].startswith("target")) == 1.0
    assert results["hardware"] and results["dtype"] == "float32 (--dtype)" and results["modes"] == ["eager"]
    assert set(results["passes"]["eager"]) >= {"t_target_1", "t_target_b", "t_target_tree", "t_target_short",
                                               "t_drafter_b"}
    assert sum(methods["D3D sync"]["verified"].values()) == methods["D3D sync"]["rounds"]  # what each round verified
    for m in methods.values():
        assert all(key in m for key in (*ROUND_SPLIT, "ideal_sync_speedup", "ideal_async_speedup"))
        assert m["ms_per_round"] > 0 and m["tau"] >= 1
        if m["engine"]:
            verify, exposed, overhead = (m[key] for key in ROUND_SPLIT[1:])
            assert math.isclose(verify + exposed + overhead, m["ms_per_round"], rel_tol=1e-9, abs_tol=1e-9)
        else:
            assert m["verify_ms_per_round"] is None
        if m["method"].startswith("D3D"):  # eager methods: against the target alone through the eager engine
            over_engine = m["tokens_per_second"] / methods["target alone, engine"]["tokens_per_second"]
            for kind in ("sync", "async"):
                assert math.isclose(m[f"ideal_{kind}_fraction"], over_engine / m[f"ideal_{kind}_speedup"])
        else:
            assert m["ideal_sync_speedup"] is None and m["ideal_async_speedup"] is None
    assert methods["D3D sync"]["engine"] and methods["D3D sync"]["hit_rate"] is None
    # async: a hit rate unless the verify policy (the default) skipped this random drafter in every round
    assert methods["D3D async C=4 F=2"]["hit_rate"] is None or 0 <= methods["D3D async C=4 F=2"]["hit_rate"] <= 1
    assert methods["target alone, engine"]["exposed_draft_ms_per_round"] == 0.0
    assert methods["target alone, engine"]["tau"] == 1.0
    assert [(r["coverage"], r["fanout"]) for r in results["sweep"]] == [(1, 0), (2, 1)]
    assert (tmp_path / "bench" / "bench.png").stat().st_size > 0


def test_bench_concurrency_writes_table_json_and_plot(tmp_path, capsys):
    tiny_target(0, layers=2).save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    D3DForBlockDiffusion.from_backbone(tiny_target(0, layers=2), block_size=4).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"w{i + j}" for j in range(1 + 3 * i))}) for i in range(5)))
    code = main(["bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                 "--prompts", str(prompts), "--max-new-tokens", "10", "--concurrency", "1,2,4", "--async-budget", "2x1",
                 "--output", str(tmp_path / "bench")])
    assert code == 0
    assert "| D3D async C=2 F=1 tok/s | speedup | D3D server tok/s |" in capsys.readouterr().out
    results = json.loads((tmp_path / "bench" / "concurrency.json").read_text())
    assert [row["concurrency"] for row in results["levels"]] == [1, 2, 4]
    for row in results["levels"]:
        assert row["requests"] == 5
        assert all(row[name]["lossless"] for name in ("sync", "fixed", "async", "server"))
        assert row["sync"]["tau"] >= 1 and row["sync"]["hit_rate"] is None and row["fixed"]["hit_rate"] is None
        assert row["server"]["tau"] >= 1 and row["server"]["batched_rounds"] >= 1 and row["server"]["hit_rate"] is None
    assert (tmp_path / "bench" / "concurrency.png").stat().st_size > 0


def save_word_models(folder) -> None:
    """A 2-layer target with a 21-word tokenizer in `folder/target`, a block-4 drafter in `folder/drafter`."""
    tiny_target(0, layers=2, vocab_size=24).save_pretrained(folder / "target")
    word_tokenizer(num_words=21).save_pretrained(folder / "target")
    D3DForBlockDiffusion.from_backbone(tiny_target(0, layers=2, vocab_size=24), block_size=4).save_pretrained(
        folder / "drafter")


def test_bench_command_sampled_checks_the_distribution_and_reports_the_ceiling(tmp_path, capsys):
    save_word_models(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"w{i} w{i + 3} w{i} w{i + 3} w{i}"}) for i in range(3)))
    code = main(["bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                 "--prompts", str(prompts), "--max-new-tokens", "16", "--sweep", "2x1", "--compile", "none",
                 "--dtype", "float32", "--do-sample", "--temperature", "0.7", "--top-k", "8",
                 "--output", str(tmp_path / "bench")])
    table = capsys.readouterr().out
    assert code == 0, table
    assert "sampled (temperature 0.7, top_k 8)" in table and "Ceiling τ" in table
    results = json.loads((tmp_path / "bench" / "bench.json").read_text())
    prompt_set = results["prompt_sets"]["prompts"]
    methods = {m["method"]: m for m in prompt_set["methods"]}
    assert {"lookup, engine", "D3D sync, fixed block", "D3D + lookup (hybrid)"} <= set(methods)
    assert all(m["consistent"] and m["outside_support"] == 0 for m in methods.values())
    assert methods["target generate"]["z"] == 0.0
    assert 1.0 <= prompt_set["ceiling_tau"] <= 4.0
    # the plot's title says how it decoded (it said "greedy" for every run before)
    assert speed_title(results) == "Decoding speed, sampled (temperature 0.7, top_k 8), one process"
    assert (tmp_path / "bench" / "bench.png").stat().st_size > 0


def test_bench_measures_only_the_methods_named_beside_the_target_alone(tmp_path, capsys):
    save_word_models(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w4 w1 w4 w1"}))
    try:
        code = main(["bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                     "--prompts", str(prompts), "--do-sample", "--methods", "D3D sync,"])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2 and "--methods '' is part of no method's name" in capsys.readouterr().err
    code = main(["bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                 "--prompts", str(prompts), "--max-new-tokens", "8", "--compile", "none", "--dtype", "float32",
                 "--do-sample", "--methods", "token-wise,hybrid", "--output", str(tmp_path / "bench")])
    assert code == 0, capsys.readouterr().out
    results = json.loads((tmp_path / "bench" / "bench.json").read_text())
    methods = [m["method"] for m in results["prompt_sets"]["prompts"]["methods"]]
    assert methods == ["target generate", "target alone, engine", "D3D sync, token-wise verification",
                       "D3D + lookup (hybrid)"]
    assert results["sweep"] == []


def test_bench_sampling_flags_are_checked_before_any_model_loads(tmp_path, capsys):
    tiny_target(0, layers=1).save_pretrained(tmp_path / "target")
    common = ["bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "target")]
    capsys.readouterr()  # the save's progress bars
    for flags, message in ((["--do-sample", "--temperature", "-1"], "must be a number > 0"),
                           (["--do-sample", "--top-p", "0"], "must be a number in (0, 1]"),
                           (["--top-k", "5"], "without --do-sample"),
                           (["--sampling", "generation-config", "--do-sample"], "drop --do-sample")):
        try:
            code = main(common + flags)
        except SystemExit as exit_:
            code = exit_.code
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) <= 2, (flags, err)


def test_ideal_bounds_charge_each_round_the_passes_it_ran():
    """A round that verified the drafter's block pays t_T(B) + t_D(B) (sync) or t_T(B) (async), a lookup t_T(B) (a long
    one, verified whole past a block's drafts, t_T(2B-1); a short one, its first drafts, a short round's pass), a tree
    t_T(2B-1) + t_D(B) or t_T(2B-1), a round that verified nothing t_T(1); with the block every round these are the
    paper's τ·t_T(1)/(t_T(B) + t_D(B)) and τ·t_T(1)/t_T(B)."""
    passes = {"t_target_1": 1.0, "t_target_b": 2.0, "t_target_tree": 3.0, "t_target_short": 1.5, "t_drafter_b": 1.0}
    every_round = MethodRun("fixed", new_tokens=40, rounds=10)  # transformers' loop: no record, the block each round
    assert ideal_bounds(every_round, passes) == (4.0 * 1 / 3, 4.0 * 1 / 2)
    mixed = MethodRun("policy", new_tokens=40, rounds=22,
                      verified=Counter({NOTHING: 10, BLOCK: 8, LOOKUP: 2, BOTH: 2}))
    assert ideal_bounds(mixed, passes) == (40 / (10 + 2 * 2 + 8 * 3 + 2 * 4), 40 / (10 + 10 * 2 + 2 * 3))
    mixed.long_lookups = 1  # one of the two lookups was long
    assert ideal_bounds(mixed, passes) == (40 / (10 + 2 + 3 + 8 * 3 + 2 * 4), 40 / (10 + 9 * 2 + 3 * 3))
    mixed.short_lookups = 1  # the other short: its first drafts only
    assert ideal_bounds(mixed, passes) == (40 / (10 + 1.5 + 3 + 8 * 3 + 2 * 4), 40 / (10 + 1.5 + 8 * 2 + 3 * 3))


def test_the_sweeps_best_async_budget_runs_once_eager_when_it_is_the_default():
    """The eager async row at the sweep's best (C, F) is the default's row when the two are the same (one run, not
    two of one method); the compiled best row stays."""
    def async_rows(best):
        return [m.name for m in build_methods(None, None, (12, 2), best, [False, True]) if "async" in m.name]
    assert async_rows((12, 2)) == ["D3D async C=12 F=2 (default, best)", "D3D async C=12 F=2 (best), compiled"]
    assert async_rows((8, 1)) == ["D3D async C=12 F=2", "D3D async C=8 F=1 (best)", "D3D async C=8 F=1 (best), compiled"]
