"""Every front door refuses prompts of the wrong shape and attention masks that do not match them with one clear
`ValueError` naming the shapes (never a raw error from inside, never a mask silently ignored); right ones decode."""

import pytest
import torch

from conftest import tiny_target
from modeling_d3d import D3DBatchServer, D3DForBlockDiffusion, speculative_generate

IDS = torch.tensor([[1, 2, 3, 4]])
ONES = torch.ones_like(IDS)
BAD = {  # name: (input_ids, attention_mask, what the message says: the shapes, for one prompt in its door's words)
    "1-D input_ids": (IDS[0], None, r"(\(batch, P\)|one prompt of shape \(1, L\)).*\(4,\)"),
    "3-D input_ids": (IDS[None], None, r"(\(batch, P\)|one prompt of shape \(1, L\)).*\(1, 1, 4\)"),
    "no tokens": (IDS[:, :0], None, r"(at least one token|L >= 1).*\(1, 0\)"),
    "a wider mask": (IDS, torch.tensor([[0, 0, 1, 1, 1, 1]]), r"attention_mask of shape \(1, 6\).*\(1, 4\)"),
    "two mask rows for one prompt": (IDS, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), r"\(2, 4\).*\(1, 4\)"),
    "a 1-D mask": (IDS, ONES[0], r"attention_mask of shape \(4,\).*\(1, 4\)"),
}


@pytest.fixture(scope="module")
def models():
    target = tiny_target(1, vocab_size=16)
    return target, D3DForBlockDiffusion.from_backbone(tiny_target(2, vocab_size=16), block_size=4).eval()


def decode(door: str, target, drafter, input_ids, attention_mask) -> torch.Tensor:
    settings = dict(max_new_tokens=3, do_sample=False)
    if attention_mask is not None:
        settings["attention_mask"] = attention_mask
    if door == "generate_batch":
        return drafter.generate_batch(target, input_ids, **settings)
    if door == "speculative_generate":
        return drafter.selective_prefill_generate(target, input_ids, **settings).sequences
    if door == "selective prefill":
        return drafter.selective_prefill_generate(target, input_ids, selective_prefill=0.5, chunk_size=2,
                                                  **settings).sequences
    return target.generate(input_ids, custom_generate=speculative_generate, drafter=drafter, **settings)


DOORS = ["generate_batch", "speculative_generate", "selective prefill", "custom_generate"]
LOSSLESS_DOORS = [door for door in DOORS if door != "selective prefill"]


# transformers' own `generate` reads the prompt's shape and a 1-D mask before it calls a `custom_generate`: those two
# cases reach `speculative_generate` only through the other doors
REACHING = [(door, case) for door in DOORS for case in BAD
            if door != "custom_generate" or BAD[case][1] is not None and case != "a 1-D mask"]


@pytest.mark.parametrize("door, case", REACHING)
def test_a_prompt_or_mask_of_the_wrong_shape_is_one_clear_error(models, door, case):
    input_ids, attention_mask, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        decode(door, *models, input_ids, attention_mask)


@pytest.mark.parametrize("door", LOSSLESS_DOORS)
def test_a_right_prompt_and_mask_decode_as_the_target_alone(models, door):
    target, drafter = models
    expected = target.generate(IDS, attention_mask=ONES, max_new_tokens=3, do_sample=False)
    assert torch.equal(decode(door, target, drafter, IDS, ONES)[:, -3:], expected[:, -3:])


def test_the_server_takes_one_prompt_and_names_the_shape(models):
    with D3DBatchServer(*models) as server:
        for ids, message in ((IDS[None], r"one prompt.*\(1, 1, 4\)"), (torch.ones(2, 3, dtype=torch.long), r"\(2, 3\)"),
                             ([], r"at least one token.*\(0,\)")):
            with pytest.raises(ValueError, match=message):
                server.submit(ids, max_new_tokens=3)
        assert len(server.submit(IDS[0], max_new_tokens=3).result(timeout=60)) == 3
