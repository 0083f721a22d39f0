"""`d3d bench` on tiny saved models and a prompt file: the table, JSON and plot, every method lossless."""

import json

from cli.main import main
from conftest import tiny_target, word_tokenizer
from modeling_d3d import D3DForBlockDiffusion


def test_bench_command_writes_table_json_and_plot(tmp_path, capsys):
    tiny_target(0, layers=2).save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    tiny_target(5, layers=1).save_pretrained(tmp_path / "assistant")
    D3DForBlockDiffusion.from_backbone(tiny_target(0, layers=2), block_size=4).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"w{i} w{i + 3} w{i + 7}"}) for i in range(3)))
    code = main(["bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                 "--assistant", str(tmp_path / "assistant"), "--prompts", str(prompts), "--max-new-tokens", "12",
                 "--sweep", "1x0,2x1", "--dtype", "float32", "--output", str(tmp_path / "bench")])
    assert code == 0
    table = capsys.readouterr().out
    assert "| D3D sync |" in table and "| HF assisted, AR assistant |" in table and "budget sweep" in table
    results = json.loads((tmp_path / "bench" / "bench.json").read_text())
    methods = results["prompt_sets"]["prompts"]["methods"]
    assert [m["method"] for m in methods][:2] == ["target alone", "HF assisted, AR assistant"]
    assert all(m["lossless"] and m["identical_outputs"] == 3 for m in methods) and methods[0]["speedup"] == 1.0
    assert results["hardware"] and results["dtype"] == "float32 (--dtype)" and "dtype: float32 (--dtype)" in table
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
    assert "| D3D async C=2 F=1 tok/s |" in capsys.readouterr().out
    results = json.loads((tmp_path / "bench" / "concurrency.json").read_text())
    assert [row["concurrency"] for row in results["levels"]] == [1, 2, 4]
    for row in results["levels"]:
        assert row["requests"] == 5 and row["sync"]["lossless"] and row["async"]["lossless"]
        assert row["sync"]["tau"] >= 1 and row["sync"]["hit_rate"] is None and row["async"]["hit_rate"] is not None
    assert (tmp_path / "bench" / "concurrency.png").stat().st_size > 0
