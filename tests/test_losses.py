"""Losses against slow, obviously-correct references computed another way."""

import itertools
import math

import pytest
import torch

from conftest import tiny_target
from modeling_d3d import D3DForBlockDiffusion
from trainer.collator import D3DCollator
from trainer.d3d_trainer import d3d_loss_terms
from trainer.losses import IGNORE_INDEX, adjust_teacher, distillation_loss

BLOCK, GAMMA, LAMBDA = 4, 2.5, 0.7


def examples():
    generator = torch.Generator().manual_seed(0)
    return [
        {"prompt": torch.randint(0, 90, (n_prompt,), generator=generator).tolist(),
         "completion": torch.randint(0, 90, (n_response,), generator=generator).tolist()}
        for n_prompt, n_response in [(3, 11), (5, 4), (1, 7)]
    ]


def reference_losses(drafter, batch, data):
    """Every block as its own sequence (block drafting), every response token by a causal pass, summed in loops."""
    diff_num = diff_den = ar_num = ar_count = 0.0
    for row, example in enumerate(data):
        ids = torch.tensor([example["prompt"] + example["completion"]])
        log_probs = drafter(ids).logits[0].log_softmax(-1)
        for i in range(len(example["prompt"]), ids.shape[1]):
            ar_num -= log_probs[i - 1, ids[0, i]].item()
            ar_count += 1
        for anchor, labels in zip(batch["anchors"][row].tolist(), batch["block_labels"][row].tolist()):
            if all(label == IGNORE_INDEX for label in labels):
                continue
            block_log_probs = drafter.draft_block(ids[:, : anchor + 1]).logits[0].log_softmax(-1)
            for j, label in enumerate(labels, start=1):
                if label != IGNORE_INDEX:
                    weight = math.exp(-(j - 1) / GAMMA)
                    diff_num -= weight * block_log_probs[j - 1, label].item()
                    diff_den += weight
    diffusion, ar = diff_num / diff_den, ar_num / ar_count
    return diffusion, ar, diffusion + LAMBDA * ar


def test_packed_loss_equals_the_per_block_reference():
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(2), block_size=BLOCK).eval()
    data = examples()
    batch = D3DCollator(block_size=BLOCK, num_anchors=5, seed=3)(data)
    terms = d3d_loss_terms(drafter, batch, GAMMA, LAMBDA)
    diffusion, ar, total = reference_losses(drafter, batch, data)
    assert terms["diffusion"].item() == pytest.approx(diffusion, abs=1e-4)
    assert terms["ar"].item() == pytest.approx(ar, abs=1e-4)
    assert terms["loss"].item() == pytest.approx(total, abs=1e-4)


def brute_force_eta(q0: torch.Tensor, y: int, delta: float, steps: int = 200_000) -> float:
    for step in range(steps + 1):
        eta = step / steps
        mixed = (1 - eta) * q0
        mixed[y] += eta
        others = torch.cat([mixed[:y], mixed[y + 1 :]])
        if mixed[y] - others.max() >= delta - 1e-12:
            return eta
    return 1.0


@pytest.mark.parametrize("seed", range(6))
def test_eta_matches_a_brute_force_search(seed):
    generator = torch.Generator().manual_seed(seed)
    q0 = torch.softmax(torch.randn(7, generator=generator, dtype=torch.float64) * 2, -1)
    y = int(q0.argsort()[seed % 7])  # labels of every rank, including the teacher's own argmax
    adjusted = adjust_teacher(q0[None], torch.tensor([y]), delta=0.01)[0]
    eta = ((adjusted[y] - q0[y]) / (1 - q0[y])).item()
    assert eta == pytest.approx(brute_force_eta(q0, y, 0.01), abs=1e-4)
    torch.testing.assert_close(adjusted.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_eta_is_zero_when_the_margin_already_holds_and_exact_otherwise():
    q0 = torch.tensor([[0.6, 0.3, 0.1], [0.3, 0.6, 0.1]], dtype=torch.float64)
    adjusted = adjust_teacher(q0, torch.tensor([0, 0]), delta=0.01)
    torch.testing.assert_close(adjusted[0], q0[0])  # margin 0.3 >= delta: untouched
    margin = adjusted[1, 0] - adjusted[1, 1:].max()
    assert margin.item() == pytest.approx(0.01, abs=1e-12)


def test_distillation_loss_equals_a_looped_kl():
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(2, 3, BLOCK - 1, 6, generator=generator)
    teacher = torch.randn(2, 3, BLOCK - 1, 6, generator=generator)
    labels = torch.randint(0, 6, (2, 3, BLOCK - 1), generator=generator)
    labels[0, 1, 2] = labels[1, 2, 1:] = IGNORE_INDEX
    numerator = denominator = 0.0
    for index in itertools.product(range(2), range(3), range(BLOCK - 1)):
        label = labels[index].item()
        if label == IGNORE_INDEX:
            continue
        q0 = teacher[index].softmax(-1).double()
        adjusted = adjust_teacher(q0[None], torch.tensor([label]))[0]
        q = student[index].softmax(-1).double()
        kl = sum(a * math.log(a / b) for a, b in zip(adjusted.tolist(), q.tolist()) if a > 0)
        weight = math.exp(-index[2] / GAMMA)
        numerator += weight * kl
        denominator += weight
    assert distillation_loss(student, teacher, labels, GAMMA).item() == pytest.approx(numerator / denominator, abs=1e-5)

