"""The long-context selective-prefill evaluation: its examples and `d3d bench-prefill` on tiny saved models."""

import json

import pytest

from conftest import tiny_target, word_tokenizer
from d3d.benchmark.long_context import CUE_TOKENS, pydoc_continuation_examples
from d3d.cli.main import main
from modeling_d3d import D3DForBlockDiffusion


def test_examples_hold_the_answer_in_context_and_end_with_its_cue():
    tokenizer = word_tokenizer()
    examples = pydoc_continuation_examples(tokenizer, num_examples=3, prompt_tokens=400, answer_tokens=12, seed=1)
    assert len({example.needle for example in examples}) == 3
    for example in examples:
        ids = example.prompt_ids[0].tolist()
        start, end = example.answer_span
        assert 300 < len(ids) <= 400 and end - start == 12
        assert ids[start - CUE_TOKENS : start] == ids[-CUE_TOKENS:]  # the cue is the text just before the answer
        assert tokenizer.decode(ids[start:end]) == example.reference
        assert end <= len(ids) - CUE_TOKENS  # the answer is in the context, before the final cue
    with pytest.raises(ValueError, match="answer_tokens"):
        pydoc_continuation_examples(tokenizer, 1, answer_tokens=500)


def test_bench_prefill_command_writes_table_json_and_plot(tmp_path, capsys):
    tiny_target(0, layers=2).save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    D3DForBlockDiffusion.from_backbone(tiny_target(0, layers=2), block_size=4).save_pretrained(tmp_path / "drafter")
    code = main(["bench-prefill", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                 "--num-examples", "2", "--prompt-tokens", "300", "--max-new-tokens", "8", "--retentions", "0.3,0.1",
                 "--chunk-size", "16", "--output", str(tmp_path / "prefill")])
    assert code == 0
    assert "| 10% + D3D |" in capsys.readouterr().out
    results = json.loads((tmp_path / "prefill" / "prefill.json").read_text())
    rows = results["settings"]
    assert [row["setting"] for row in rows] == ["Full, target alone", "Full + D3D", "30% + D3D", "10% + D3D"]
    assert rows[0]["e2e_speedup"] == 1.0 and all(row["matches_target"] for row in rows)
    assert rows[1]["kept_fraction"] == 1.0 and abs(rows[3]["kept_fraction"] - 0.1) <= 16 / 280
    assert (tmp_path / "prefill" / "prefill.png").stat().st_size > 0
    assert (tmp_path / "prefill" / "prefill.md").read_text().startswith("### pydoc passage continuation")
