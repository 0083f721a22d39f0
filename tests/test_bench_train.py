"""`d3d bench-train` at a tiny size (the CI smoke test) and the training options it measures."""

import json
from dataclasses import replace

import pytest
import torch

from d3d.benchmark.train_cost import (SHAPES, full_logits_loss_terms, layer_activation_bytes, random_batch,
                                      random_drafter_of)
from d3d.cli.main import main
from d3d.trainer.d3d_trainer import d3d_loss_terms, training_attention


def test_bench_train_measures_both_loss_paths_and_projects(tmp_path, capsys):
    assert main(["bench-train", "--shapes", "tiny", "--layers", "1,2", "--gradient-checkpointing", "both",
                 "--repeats", "2", "--project", "tiny", "--dtype", "float32", "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench-train.json").read_text())
    steps = result["steps"]
    assert len(steps) == 6 and all(step["seconds"] > 0 and step["peak_bytes"] >= 0 for step in steps)
    for layers in (1, 2):  # the same model and batch: every loss path and checkpointing gives the same loss
        losses = [step["loss"] for step in steps if step["layers"] == layers]
        assert max(losses) - min(losses) < 1e-5
    assert result["projection"]["parameters"] > 8e9
    counted = layer_activation_bytes(SHAPES["tiny"], "cpu", torch.float32)
    assert result["projection"]["per_position"]["layer_activation_bytes"] == counted > 0
    printed = capsys.readouterr().out
    assert "PROJECTION (not measured)" in printed and "| tiny | hidden-states | yes | 2 |" in printed


@pytest.mark.parametrize("argv", [["--shapes", "huge"], ["--shapes", "tiny", "--layers", "0"],
                                  ["--shapes", "tiny", "--project", "quickstart"],
                                  ["--shapes", "tiny", "--loss-paths", "logits"]])
def test_bench_train_rejects_bad_input_in_one_line(argv, capsys):
    assert main(["bench-train", *argv]) == 2
    error = capsys.readouterr().err
    assert error.startswith("d3d bench-train: error:") and len(error.strip().splitlines()) == 1


def test_gradient_checkpointing_gives_the_same_losses_and_gradients():
    shape = SHAPES["tiny"]
    batch = random_batch(shape, "cpu")
    gradients = []
    for checkpointing in (False, True):
        model = random_drafter_of(shape, "cpu", torch.float64).train()
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        terms = d3d_loss_terms(model, batch, 7.0, 1.0)
        terms["loss"].backward()
        gradients.append((terms["loss"].detach(), [p.grad for p in model.parameters()]))
    (plain_loss, plain), (checkpointed_loss, checkpointed) = gradients
    torch.testing.assert_close(checkpointed_loss, plain_loss, rtol=1e-12, atol=1e-12)
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_the_baseline_full_logits_losses_equal_the_hidden_state_losses():
    shape = SHAPES["tiny"]
    model, batch = random_drafter_of(shape, "cpu", torch.float64), random_batch(shape, "cpu")
    full, hidden = full_logits_loss_terms(model, batch, 7.0, 0.5), d3d_loss_terms(model, batch, 7.0, 0.5)
    for name in ("diffusion", "ar", "loss"):
        torch.testing.assert_close(hidden[name], full[name], rtol=1e-12, atol=1e-12)


def test_training_attention_is_flex_on_cuda_only_by_default():
    assert training_attention("auto", torch.device("cuda", 0)) == "flex_attention"
    assert training_attention("auto", torch.device("cpu")) == "sdpa"
    assert training_attention("eager", torch.device("cpu")) == "eager"
    with pytest.raises(ValueError):
        training_attention("flash_attention_2", torch.device("cpu"))


def test_a_layers_activations_are_counted_exactly():
    """Counted from what autograd saves, not inferred from memory peaks: the same at any depth and in every run, at
    least a layer's input and its attention and MLP outputs (3 x hidden float32 values per position)."""
    shape = SHAPES["tiny"]
    counts = [layer_activation_bytes(replace(shape, layers=depth), "cpu", torch.float32) for depth in (1, 2, 1)]
    assert counts[0] == counts[1] == counts[2]
    assert counts[0] >= 3 * 4 * shape.hidden
