"""The whole quickstart pipeline at micro size: every artifact, lossless methods, remote-code drafter, stage reuse."""

import json
import os
from dataclasses import asdict
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from conftest import demo_table, run_without_project
from d3d.cli.demo import RANDOM_NOTE, SPEEDUP_NOTE
from d3d.cli.main import main
from d3d.common.corpus import (function_prompts, humaneval_prompts, pydoc_prompts, quality_texts, split_topics,
                               training_texts)
from d3d.common.dtype import choose_dtype
from d3d.quickstart.pipeline import MICRO, benchmark_done, run_quickstart
from d3d.quickstart.pretrain import bits_per_byte


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quickstart")
    run_quickstart(folder, MICRO)
    return folder


def test_every_artifact_is_written(output):
    for name in ("target/config.json", "assistant/config.json", "drafter/config.json", "drafter/README.md",
                 "drafter/modeling_d3d.py", "drafter/custom_generate/generate.py", "drafter/tokenizer.json",
                 "bench.json", "bench.md", "bench.png", "pruning/pruning.md", "data/dataset"):
        assert (output / name).exists(), name


def test_the_drafter_starts_from_the_ar_assistant_and_is_pruned_with_recovery(output):
    drafter, assistant, target = (json.loads((output / name / "config.json").read_text())
                                  for name in ("drafter-trained", "assistant", "target"))
    assert drafter["hidden_size"] == assistant["hidden_size"] != target["hidden_size"]
    assert drafter["num_hidden_layers"] == assistant["num_hidden_layers"]
    provenance = json.loads((output / "drafter-trained" / "d3d_training.json").read_text())
    assert provenance["base_model"].endswith("assistant")
    stages = json.loads((output / "pruning" / "pruning.json").read_text())["stages"]
    assert [stage["depth"] for stage in stages] == [assistant["num_hidden_layers"], assistant["num_hidden_layers"] - 1]


def test_the_chosen_dtype_is_recorded_in_the_artifacts(output):
    chosen = choose_dtype().description
    assert json.loads((output / "sizes.json").read_text())["dtype"] == chosen
    assert json.loads((output / "bench.json").read_text())["dtype"] == f"training {chosen}; benchmark float32 (exact token identity)"
    assert json.loads((output / "drafter" / "d3d_training.json").read_text())["dtype"] == chosen
    assert f"- training dtype: {chosen}" in (output / "drafter" / "README.md").read_text()


def test_a_run_without_a_budget_keeps_the_sizes_as_given_and_records_each_stages_seconds(output):
    recorded = json.loads((output / "sizes.json").read_text())
    assert {key: recorded[key] for key in asdict(MICRO)} == asdict(MICRO) and recorded["scale"] == 1.0
    assert "unit_costs" not in recorded  # nothing was timed for a plan
    assert {"setup", "target", "assistant", "responses", "drafter", "pruning", "benchmark"} <= set(recorded["seconds"])


def test_every_benchmarked_method_was_lossless(output):
    results = json.loads((output / "bench.json").read_text())
    rows = [row for prompt_set in results["prompt_sets"].values() for row in prompt_set["methods"]]
    assert {"target generate", "target alone, engine", "D3D sync"} <= {row["method"] for row in rows}
    assert any(row["method"].startswith("D3D async") for row in rows)
    assert all(row["lossless"] for row in rows)
    assert results["sweep"] and set(results["prompt_sets"]) == {"humaneval", "pydoc"}


def test_the_drafter_folder_loads_with_remote_code_in_a_fresh_process(output):
    code = """
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    drafter = AutoModel.from_pretrained(sys.argv[1] + "/drafter", trust_remote_code=True)
    target = AutoModelForCausalLM.from_pretrained(sys.argv[1] + "/target")
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=drafter),
                       target.generate(ids, max_new_tokens=10, do_sample=False))
    print("ok")
    """
    result = run_without_project(code, str(output), cwd=output.parent)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_the_model_card_usage_snippet_runs_as_written(output):
    card = (output / "drafter" / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert "trust_remote_code=True" in snippet and "generate_batch" in snippet and "asynchronous=True" in snippet
    assert snippet.index("custom_generate=") < snippet.index("generate_batch")  # the Hub call comes first
    result = run_without_project(snippet, cwd=output.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith("def fibonacci(n):")


def test_demo_uses_the_quickstart_models_in_d3d_output(output, capsys, monkeypatch, tmp_path):
    (tmp_path / "d3d-output").symlink_to(output)
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--prompts", "2", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert RANDOM_NOTE not in out and SPEEDUP_NOTE in out.splitlines()
    assert out.splitlines()[:2] == ["models: target d3d-output/target, drafter d3d-output/drafter",
                                    "prompts: 1 HumanEval, 1 held-out pydoc topics"]
    block_size = json.loads((output / "drafter" / "config.json").read_text())["block_size"]
    rows = demo_table(out)
    assert list(rows) == ["target alone: generate (baseline)", f"D3D sync, B={block_size}",
                          f"D3D async, B={block_size} C={block_size} F=2"]
    assert all(row["identical"] == "True" for row in rows.values())
    assert humaneval_prompts()[0] in out  # the first prompt and its output


def test_the_readmes_hub_example_runs_on_the_quickstarts_folders_without_the_project(output, tmp_path):
    from test_docs import marked_block
    code = marked_block((Path(__file__).parents[1] / "README.md").read_text(), "hub-example")
    (tmp_path / "d3d-output").symlink_to(output)
    result = run_without_project(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    text, tau = result.stdout.rstrip().rsplit("\n", 1)
    assert text.startswith("def fibonacci(n):") and float(tau) >= 1.0


def test_each_causal_lm_records_its_bits_per_byte_on_text_it_never_saw(output):
    for name in ("target", "assistant"):
        quality = json.loads((output / name / "perplexity.json").read_text())["bits_per_byte"]
        assert set(quality) == set(quality_texts()) and all(0 < value < 32 for value in quality.values())
    texts = set(training_texts(MICRO.corpus_bytes))
    assert not any(held in text for held in quality_texts()["held-out pydoc"] for text in texts)


def test_bits_per_byte_is_the_models_loss_over_the_texts_bytes(output):
    """One piece: the model's mean next-token loss x scored tokens / ln 2 / UTF-8 bytes; cut into pieces, each piece's
    first token is context only, so the figure rises."""
    tokenizer = AutoTokenizer.from_pretrained(output / "tokenizer")
    model = Qwen3ForCausalLM.from_pretrained(output / "target", dtype=torch.float32).eval()
    text = quality_texts()["held-out pydoc"][0][:400] + " é"
    ids = torch.tensor([tokenizer(text).input_ids])
    loss = model(ids, labels=ids).loss.item()
    expected = loss * (ids.shape[1] - 1) / math.log(2) / len(text.encode())
    assert bits_per_byte(model, tokenizer, [text], window=ids.shape[1]) == pytest.approx(expected, rel=1e-5)
    assert bits_per_byte(model, tokenizer, [text], window=8) != pytest.approx(expected, rel=1e-3)


def test_a_second_run_reuses_finished_stages(output):
    stamps = {name: (output / name).stat().st_mtime_ns
              for name in ("target/model.safetensors", "assistant/model.safetensors", "drafter/model.safetensors",
                           "bench.json", "bench.png")}
    results = run_quickstart(output, MICRO)
    assert stamps == {name: (output / name).stat().st_mtime_ns for name in stamps}
    assert results == json.loads((output / "bench.json").read_text())
    assert benchmark_done(output, output / "drafter")
    weights = output / "drafter" / "model.safetensors"
    os.utime(weights, ns=(stamps["bench.json"] + 10**9,) * 2)  # a drafter newer than the benchmark is measured again
    try:
        assert not benchmark_done(output, output / "drafter")
    finally:
        os.utime(weights, ns=(stamps["drafter/model.safetensors"],) * 2)


def test_a_budget_that_fits_trains_the_same_models_to_the_bit(output, tmp_path, capsys):
    """The first run's probes (random models trained and decoded for timing) leave no trace in what it trains."""
    run_quickstart(tmp_path, MICRO, budget_minutes=10_000)
    assert "within it" in capsys.readouterr().out
    assert json.loads((tmp_path / "sizes.json").read_text())["unit_costs"]  # the probes ran
    for name in ("target", "assistant", "drafter-trained"):
        weights = f"{name}/model.safetensors"
        assert (tmp_path / weights).read_bytes() == (output / weights).read_bytes(), name


def test_evaluation_prompts_stay_out_of_training():
    assert len(humaneval_prompts()) == 164
    _, held_out = split_topics()
    texts = set(training_texts(MICRO.corpus_bytes))
    assert held_out and not any(prompt in text for prompt in pydoc_prompts() for text in texts)
    training_prompts = set(function_prompts(500))
    assert not training_prompts & set(humaneval_prompts())


def test_the_pruning_curve_starts_from_the_targets_first_layers_and_prunes_to_one_layer(output, tmp_path,
                                                                                       two_torch_threads):
    from d3d.quickstart.ablations import main as ablations, target_prefix_drafter
    target = Qwen3ForCausalLM.from_pretrained(output / "target")
    drafter = target_prefix_drafter(output, 1, MICRO.block_size, AutoTokenizer.from_pretrained(output / "tokenizer"))
    assert drafter.config.num_hidden_layers == 1 < target.config.num_hidden_layers
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.norm.weight"):
        torch.testing.assert_close(drafter.get_parameter(name), target.get_parameter(name), rtol=0, atol=0)
    curve = tmp_path / "curve"
    ablations(["--quickstart", str(output), "--output", str(curve), "--steps", "2", "--held-out", "4",
               "--pruning-curve", str(target.config.num_hidden_layers), "--dtype", "float32"])
    assert torch.get_num_threads() == 2  # the command's one thread is its own: the tests after it keep theirs
    stages = json.loads((curve / "pruning" / "pruning.json").read_text())["stages"]
    assert [stage["depth"] for stage in stages] == list(range(target.config.num_hidden_layers, 0, -1))
    assert all(math.isfinite(stage["tau"]) and math.isfinite(stage["speedup"]) for stage in stages)
    assert (curve / "pruning" / "pruning.png").exists()
    with pytest.raises(SystemExit) as refused:
        ablations(["--quickstart", str(output), "--output", str(tmp_path / "too-deep"),
                   "--pruning-curve", str(target.config.num_hidden_layers + 1)])
    assert refused.value.code == 2
    for wrong in (["--held-out", "1"], ["--variants", "1:pretrained:8"]):  # the curve needs two halves; one drafter
        with pytest.raises(SystemExit) as refused:
            ablations(["--quickstart", str(output), "--output", str(tmp_path / "wrong"), "--pruning-curve", "1", *wrong])
        assert refused.value.code == 2
