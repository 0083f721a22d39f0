import pytest
import torch

from conftest import tiny_qwen3_config
from d3d.trainer.collator import D3DCollator
from d3d.trainer.losses import IGNORE_INDEX
from modeling_d3d.masking_d3d import block_layout, create_block_diffusion_mask

BLOCK = 4


def examples():
    return [
        {"prompt": [50, 51, 52], "completion": list(range(1, 13))},  # T = 12
        {"prompt": [60], "completion": [7, 8, 9]},  # T = 3: at most 2 anchors
    ]


def test_anchors_are_distinct_in_range_and_supervise_the_right_tokens():
    collator = D3DCollator(block_size=BLOCK, num_anchors=5, seed=0)
    for _ in range(20):
        batch = collator(examples())
        for row, example in enumerate(examples()):
            prompt, response = example["prompt"], example["completion"]
            offset = len(prompt) - 1
            anchors = batch["anchors"][row].tolist()
            real = [a for a, labels in zip(anchors, batch["block_labels"][row]) if (labels != IGNORE_INDEX).any()]
            assert len(real) == min(5, len(response) - 1)
            positions = [a - offset for a in real]
            assert positions == sorted(set(positions)) and all(1 <= s < len(response) for s in positions)
            for a, labels in zip(real, batch["block_labels"][row]):
                s = a - offset
                supervised = (labels != IGNORE_INDEX).sum().item()
                assert supervised == min(BLOCK - 1, len(response) - s)
                assert labels[:supervised].tolist() == response[s : s + supervised]
                assert batch["input_ids"][row, a].item() == response[s - 1]


def test_no_label_is_visible_to_its_block():
    """Read the packed attention mask: every shared position a block can see lies before its first label."""
    collator = D3DCollator(block_size=BLOCK, num_anchors=6, seed=1)
    batch = collator(examples())
    shared = batch["input_ids"].shape[1]
    block_ids, visible_prefix, _ = block_layout(shared, batch["anchors"], BLOCK)
    embeds = torch.zeros(*block_ids.shape, 8)
    mask = create_block_diffusion_mask(tiny_qwen3_config(), embeds, block_ids, visible_prefix)
    for row in range(2):
        for k, (anchor, labels) in enumerate(zip(batch["anchors"][row], batch["block_labels"][row])):
            label_positions = [anchor.item() + j for j, label in enumerate(labels.tolist(), start=1) if label != IGNORE_INDEX]
            queries = slice(shared + k * BLOCK, shared + (k + 1) * BLOCK)
            seen = mask[row, 0, queries, :shared].any(dim=0).nonzero().flatten().tolist()
            assert seen == list(range(anchor.item()))
            assert not set(seen) & set(label_positions)


def test_ar_labels_are_the_shifted_response_and_padding_is_masked():
    batch = D3DCollator(block_size=BLOCK, num_anchors=2, pad_token_id=0, seed=0)(examples())
    assert batch["ar_labels"][0].tolist() == [IGNORE_INDEX, IGNORE_INDEX] + list(range(1, 13)) + [IGNORE_INDEX]
    assert batch["ar_labels"][1].tolist()[:4] == [7, 8, 9, IGNORE_INDEX]
    assert batch["attention_mask"][1].tolist() == [1] * 4 + [0] * 11
    assert batch["input_ids"].shape == (2, 15) and batch["block_labels"].shape == (2, 2, BLOCK - 1)


def test_too_short_examples_are_refused():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        D3DCollator(block_size=BLOCK, num_anchors=2)([{"prompt": [1], "completion": [2]}])


def test_anchors_depend_on_the_example_the_seed_and_the_epoch_only():
    """What a resumed run needs: a batch packs the same whatever was collated before it (no stream to restore), and
    a new epoch draws new anchors."""
    first = D3DCollator(block_size=BLOCK, num_anchors=3, seed=0)(examples())
    collator = D3DCollator(block_size=BLOCK, num_anchors=3, seed=0)
    for _ in range(3):
        collator([{"prompt": [5, 6], "completion": list(range(1, 20))}])
    assert all(torch.equal(value, first[name]) for name, value in collator(examples()).items())
    collator.epoch = 1
    assert not torch.equal(collator(examples())["anchors"], first["anchors"])
