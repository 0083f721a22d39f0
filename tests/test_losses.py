"""Losses against slow, obviously-correct references computed another way."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_target
from d3d.trainer.collator import D3DCollator
from d3d.trainer.d3d_trainer import d3d_loss_terms
from d3d.trainer.losses import IGNORE_INDEX, adjust_teacher, distillation_loss, position_weights, training_losses
from modeling_d3d import D3DForBlockDiffusion

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
    identity = nn.Linear(6, 6, bias=False)  # a head that passes logits through as "hidden states"
    nn.init.eye_(identity.weight)
    loss = distillation_loss(student, identity, teacher, identity, labels, GAMMA)
    assert loss.item() == pytest.approx(numerator / denominator, abs=1e-5)


# The losses as they were before they read hidden states: every position's logits, then the supervised ones picked
# by their labels (upcast to at least float32, so a float64 model is compared in float64).
def full_logits_diffusion_loss(diffusion_logits, block_labels, gamma):
    wide = diffusion_logits.to(torch.promote_types(diffusion_logits.dtype, torch.float32))
    nll = F.cross_entropy(wide.flatten(0, -2), block_labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    weights = position_weights(block_labels.shape[-1], gamma, dtype=wide.dtype) * (block_labels != IGNORE_INDEX)
    return (nll.view_as(block_labels) * weights).sum() / weights.sum().clamp_min(1e-12)


def full_logits_ar_loss(ar_logits, ar_labels):
    wide = ar_logits.to(torch.promote_types(ar_logits.dtype, torch.float32))
    return F.cross_entropy(wide.flatten(0, -2), ar_labels.flatten(), ignore_index=IGNORE_INDEX)


def full_logits_distillation_loss(student_logits, teacher_logits, block_labels, gamma, delta=0.01):
    supervised = block_labels != IGNORE_INDEX
    teacher = adjust_teacher(teacher_logits.double().softmax(-1), block_labels.clamp_min(0), delta)
    kl = (teacher * (teacher.clamp_min(1e-30).log() - student_logits.double().log_softmax(-1))).sum(-1)
    weights = position_weights(block_labels.shape[-1], gamma, dtype=kl.dtype) * supervised
    return (kl * weights).sum() / weights.sum().clamp_min(1e-12)


def full_logits_terms(model, batch, teacher):
    packed = {name: batch[name] for name in ("input_ids", "anchors", "attention_mask")}
    outputs = model(**packed)
    terms = {"diffusion": full_logits_diffusion_loss(outputs.diffusion_logits, batch["block_labels"], GAMMA),
             "ar": full_logits_ar_loss(outputs.ar_logits, batch["ar_labels"])}
    with torch.no_grad():
        teacher_logits = teacher(**packed).diffusion_logits
    terms["kl"] = full_logits_distillation_loss(outputs.diffusion_logits, teacher_logits, batch["block_labels"], GAMMA)
    terms["loss"] = terms["diffusion"] + LAMBDA * terms["ar"] + terms["kl"]
    return terms


def gradients(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("chunk_elements", [2**26, 5 * 96, 96])  # one chunk; chunks of 5 positions; of one
def test_hidden_state_losses_equal_the_full_logits_losses_and_their_gradients(chunk_elements):
    """Ragged rows (padding, padded blocks, blocks past the response end, prompts): every term and every parameter's
    gradient equals the full-logits computation in float64, with and without chunks."""
    student = D3DForBlockDiffusion.from_backbone(tiny_target(2), block_size=BLOCK).double()
    teacher = D3DForBlockDiffusion.from_backbone(tiny_target(4), block_size=BLOCK).double().eval()
    batch = D3DCollator(block_size=BLOCK, num_anchors=5, seed=3)(examples())
    assert (batch["block_labels"] == IGNORE_INDEX).any() and (batch["attention_mask"] == 0).any()
    expected = full_logits_terms(student, batch, teacher)
    expected_gradients = gradients(student, expected["loss"])
    terms = d3d_loss_terms(student, batch, GAMMA, LAMBDA, teacher, chunk_elements=chunk_elements)
    assert set(terms) == set(expected)
    for name in expected:
        torch.testing.assert_close(terms[name], expected[name], rtol=1e-12, atol=1e-12)
    for name, gradient in gradients(student, terms["loss"]).items():
        torch.testing.assert_close(gradient, expected_gradients[name], rtol=1e-10, atol=1e-12, msg=name)



class MatmulRecorder(TorchDispatchMode):
    """Records the shapes `(m, k, n)` of every matrix product dispatched while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.products = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            first, second = args[-2], args[-1]
            self.products.append((first.shape[0], first.shape[1], second.shape[1]))
        return func(*args, **(kwargs or {}))


def ragged_hidden_states(dtype=torch.float64, seed=0):
    """Hidden states and labels as `forward_packed` and the collator give them, with every kind of unsupervised position:
    AR `(2, 9, 32)` with prompt and padding positions ignored; diffusion `(2, 3, BLOCK - 1, 32)` with blocks past the
    response end and a fully padded block."""
    generator = torch.Generator().manual_seed(seed)
    ar_hidden = torch.randn(2, 9, 32, generator=generator, dtype=dtype)
    diffusion_hidden = torch.randn(2, 3, BLOCK - 1, 32, generator=generator, dtype=dtype)
    ar_labels = torch.randint(0, 96, (2, 9), generator=generator)
    ar_labels[0, :3] = ar_labels[1, :2] = ar_labels[1, 7:] = IGNORE_INDEX
    block_labels = torch.randint(0, 96, (2, 3, BLOCK - 1), generator=generator)
    block_labels[0, 2, 1:] = block_labels[1, 0] = IGNORE_INDEX
    return ar_hidden, diffusion_hidden, ar_labels, block_labels


def plain_losses(ar_hidden, diffusion_hidden, head, ar_labels, block_labels, teacher_hidden, teacher_head):
    """The same total through the head at every position (full logits) and autograd."""
    diffusion_logits = head(diffusion_hidden)
    with torch.no_grad():
        teacher_logits = teacher_head(teacher_hidden)
    return (full_logits_diffusion_loss(diffusion_logits, block_labels, GAMMA)
            + LAMBDA * full_logits_ar_loss(head(ar_hidden), ar_labels)
            + full_logits_distillation_loss(diffusion_logits, teacher_logits, block_labels, GAMMA))


def loss_gradients(loss_fn, head, ar_hidden, diffusion_hidden, *rest):
    """Gradients of `loss_fn(...)` w.r.t. the AR hidden states, the diffusion hidden states and the head's weight."""
    leaves = [ar_hidden.clone().requires_grad_(), diffusion_hidden.clone().requires_grad_()]
    head.zero_grad()
    loss = loss_fn(*leaves, head, *rest)
    loss.backward()
    return loss.detach(), [leaves[0].grad, leaves[1].grad, head.weight.grad.clone()]


def chunked_total(ar_hidden, diffusion_hidden, head, ar_labels, block_labels, teacher_hidden, teacher_head,
                  chunk_elements=3 * 96):
    return training_losses(ar_hidden, diffusion_hidden, head, ar_labels, block_labels, GAMMA, LAMBDA, teacher_hidden,
                           teacher_head, 0.01, chunk_elements)["loss"]


def test_chunked_gradients_wrt_hidden_states_and_head_equal_the_full_logits_ones_and_see_every_position():
    """Gradients w.r.t. every hidden state (zero where unsupervised) and the head's weight equal the plain full-logits
    computation in float64; moving the supervised set by one position either way breaks the equality."""
    torch.manual_seed(0)
    head, teacher_head = nn.Linear(32, 96, bias=False).double(), nn.Linear(32, 96, bias=False).double()
    ar_hidden, diffusion_hidden, ar_labels, block_labels = ragged_hidden_states()
    teacher_hidden = torch.randn_like(diffusion_hidden)
    rest = (ar_labels, block_labels, teacher_hidden, teacher_head)
    expected_loss, expected = loss_gradients(plain_losses, head, ar_hidden, diffusion_hidden, *rest)
    loss, got = loss_gradients(chunked_total, head, ar_hidden, diffusion_hidden, *rest)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("ar hidden", "diffusion hidden", "head weight"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    assert (expected[0][ar_labels == IGNORE_INDEX] == 0).all() and (expected[1][block_labels == IGNORE_INDEX] == 0).all()

    def differs(ar, blocks):  # the chunked path on a supervised set moved by one position, against the true gradients
        _, moved = loss_gradients(chunked_total, head, ar_hidden, diffusion_hidden, ar, blocks, teacher_hidden,
                                  teacher_head)
        return any(not torch.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in zip(moved, expected))

    dropped_ar, added_ar = ar_labels.clone(), ar_labels.clone()
    dropped_ar[0, 5], added_ar[0, 0] = IGNORE_INDEX, 7
    dropped_block, added_block = block_labels.clone(), block_labels.clone()
    dropped_block[1, 2, 0], added_block[1, 0, 0] = IGNORE_INDEX, 7
    assert differs(dropped_ar, block_labels) and differs(added_ar, block_labels)
    assert differs(ar_labels, dropped_block) and differs(ar_labels, added_block)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])  # float32 master weights, or bf16 weights
def test_chunked_losses_under_bf16_autocast_match_the_plain_autocast_computation(weight_dtype):
    """Under bf16 autocast the head runs in bf16 as `nn.Linear` would and the losses in float32; values and gradients
    (hidden states in their dtype, the weight's in its own) agree with the plain computation to bf16 rounding."""
    torch.manual_seed(0)
    head = nn.Linear(32, 96, bias=False).to(weight_dtype)
    teacher_head = nn.Linear(32, 96, bias=False).to(weight_dtype)
    ar_hidden, diffusion_hidden, ar_labels, block_labels = ragged_hidden_states(torch.float32)
    rest = (ar_labels, block_labels, torch.randn_like(diffusion_hidden), teacher_head)
    results = []
    for loss_fn in (plain_losses, chunked_total):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(loss_gradients(loss_fn, head, ar_hidden, diffusion_hidden, *rest))
    (expected_loss, expected), (loss, got) = results
    assert loss.dtype == torch.float32  # (the reference's L_KL is in float64)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-3)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2


def test_the_head_forms_logits_only_at_supervised_positions_a_chunk_at_a_time_without_recomputing():
    """Every product with the vocabulary covers at most a chunk of supervised positions, and each supervised position
    goes through the student's head three times (logits, their gradient w.r.t. the hidden state and w.r.t. the weight:
    nothing recomputed) and the teacher's once; L_diff and L_KL share their logits."""
    torch.manual_seed(0)
    head, teacher_head = nn.Linear(32, 96, bias=False), nn.Linear(32, 96, bias=False)
    ar_hidden, diffusion_hidden, ar_labels, block_labels = ragged_hidden_states(torch.float32)
    ar_hidden.requires_grad_()
    diffusion_hidden.requires_grad_()
    recorder = MatmulRecorder()
    with recorder:
        chunked_total(ar_hidden, diffusion_hidden, head, ar_labels, block_labels, torch.randn_like(diffusion_hidden),
                      teacher_head, chunk_elements=4 * 96).backward()
    supervised_ar, supervised_masked = int((ar_labels != IGNORE_INDEX).sum()), int((block_labels != IGNORE_INDEX).sum())
    positions = []
    for m, k, n in recorder.products:
        assert 96 in (m, k, n)
        positions.append(k if m == 96 else m)  # (positions, 32) @ (32, 96), (positions, 96) @ (96, 32), (96, p) @ (p, 32)
    assert max(positions) == 4
    assert sum(positions) == 3 * (supervised_ar + supervised_masked) + supervised_masked


def test_a_second_backward_through_the_chunked_losses_is_a_clear_error():
    head = nn.Linear(32, 96, bias=False)
    ar_hidden, diffusion_hidden, ar_labels, block_labels = ragged_hidden_states(torch.float32)
    loss = training_losses(ar_hidden.requires_grad_(), diffusion_hidden, head, ar_labels, block_labels)["loss"]
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward runs once"):
        loss.backward()


@pytest.mark.parametrize("partitioned", [False, True])
def test_a_head_the_chunked_losses_cannot_read_is_a_clear_error(partitioned):
    head = nn.Linear(32, 96, bias=not partitioned)
    if partitioned:  # what a ZeRO-3 parameter looks like outside its module's forward
        head.weight = nn.Parameter(torch.empty(0))
    ar_hidden, diffusion_hidden, ar_labels, block_labels = ragged_hidden_states(torch.float32)
    with pytest.raises(RuntimeError, match="without bias|must be gathered"):
        training_losses(ar_hidden, diffusion_hidden, head, ar_labels, block_labels)
