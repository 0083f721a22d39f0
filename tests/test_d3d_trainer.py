"""Micro end-to-end training: target-regenerated data, D3DTrainer, acceptance before and after; one pruning stage."""

import json
import logging

import pytest
import torch

from conftest import tiny_target, word_tokenizer
from d3d.common.measure import acceptance_length
from d3d.trainer.d3d_trainer import D3DTrainer, D3DTrainingArguments
from d3d.trainer.data import generate_responses
from d3d.trainer.pruning import drop_layer, prune
from modeling_d3d import D3DForBlockDiffusion

logger = logging.getLogger(__name__)
BLOCK = 4


def prompts(count: int, seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{t}" for t in torch.randint(0, 90, (int(torch.randint(2, 8, (1,), generator=generator)),), generator=generator).tolist()) for _ in range(count)]


def encoded(tokenizer, texts):
    return [torch.tensor([tokenizer(text)["input_ids"]]) for text in texts]


def training_args(tmp_path, name, steps, **overrides):
    return D3DTrainingArguments(
        output_dir=str(tmp_path / name), max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
        num_anchors=8, gamma=2.0, logging_steps=20, save_strategy="no", report_to=[], use_cpu=True,
        lr_scheduler_type="constant", disable_tqdm=True, seed=0, **overrides,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("train")
    target, tokenizer = tiny_target(0, layers=2), word_tokenizer()
    data = generate_responses(target, tokenizer, prompts(48, 0), tmp_path / "data", batch_size=16, max_new_tokens=24)
    held_out = encoded(tokenizer, prompts(6, 1))
    return tmp_path, target, tokenizer, data, held_out


def test_training_raises_acceptance_and_logs_each_term(setup):
    tmp_path, target, _, data, held_out = setup
    taus = {"init": acceptance_length(target, D3DForBlockDiffusion.from_backbone(target, block_size=BLOCK), held_out, 24)}
    for name, ar_weight in (("diffusion+ar", 1.0), ("diffusion only", 0.0)):
        drafter = D3DForBlockDiffusion.from_backbone(target, block_size=BLOCK)
        trainer = D3DTrainer(drafter, training_args(tmp_path, name, 150, ar_weight=ar_weight), train_dataset=data)
        trainer.train()
        assert trainer.data_collator.epoch == 24  # 150 steps of 6 an epoch: the collator was told each epoch
        logged = [entry for entry in trainer.state.log_history if "loss_diffusion" in entry]
        assert logged and all("loss_ar" in entry for entry in logged)
        assert logged[-1]["loss_diffusion"] < logged[0]["loss_diffusion"]
        taus[name] = acceptance_length(target, drafter.eval(), held_out, 24)
    logger.warning("micro run tau: %s", json.dumps(taus))  # diffusion + AR vs diffusion only: reported, not asserted
    assert taus["diffusion+ar"] > taus["init"]


def test_a_drafter_trained_in_bf16_leaves_training_as_it_loads_from_disk(setup, tmp_path):
    _, target, _, data, held_out = setup
    drafter = D3DForBlockDiffusion.from_backbone(target, block_size=BLOCK)
    D3DTrainer(drafter, training_args(tmp_path, "bf16", 2, bf16=True), train_dataset=data).train()
    assert "_original_forward" not in drafter.__dict__  # accelerate's autocast wrapper is gone
    drafter.eval().save_pretrained(tmp_path / "saved")
    reloaded = D3DForBlockDiffusion.from_pretrained(tmp_path / "saved").eval()
    logits = drafter(held_out[0]).logits
    assert logits.dtype == torch.float32 and torch.equal(logits, reloaded(held_out[0]).logits)


def test_drop_layer_keeps_a_working_smaller_drafter(setup):
    _, target, _, _, held_out = setup
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(3, layers=3), block_size=BLOCK).eval()
    smaller = drop_layer(drafter, 1)
    assert smaller.config.num_hidden_layers == 2 and [l.self_attn.layer_idx for l in smaller.model.layers] == [0, 1]
    assert torch.equal(smaller.model.layers[1].mlp.up_proj.weight, drafter.model.layers[2].mlp.up_proj.weight)
    prompt = held_out[0]
    assert torch.equal(
        target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=smaller),
        target.generate(prompt, max_new_tokens=12, do_sample=False),
    )


def test_one_pruning_stage_writes_a_loadable_smaller_drafter_and_report(setup):
    tmp_path, target, tokenizer, data, _ = setup
    drafter = D3DForBlockDiffusion.from_backbone(target, block_size=BLOCK)
    D3DTrainer(drafter, training_args(tmp_path, "teacher", 60), train_dataset=data).train()
    out = tmp_path / "pruned"
    stages = prune(
        drafter.eval(), target, data, encoded(tokenizer, prompts(3, 2)), encoded(tokenizer, prompts(3, 3)), out,
        training_args(tmp_path, "recovery", 20), min_layers=1, min_tau_fraction=0.0, max_new_tokens=16,
    )
    assert [stage.depth for stage in stages] == [2, 1]
    assert {"pruning.json", "pruning.md", "pruning.png"} <= {p.name for p in out.iterdir()}
    chosen = json.loads((out / "pruning.json").read_text())["chosen"]
    loaded = D3DForBlockDiffusion.from_pretrained(out / "drafter")
    assert loaded.config.num_hidden_layers == chosen
    assert (out / "stage-1" / "config.json").exists()
