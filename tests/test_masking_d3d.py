"""What each position may see, read off the mask itself (no model involved)."""

import pytest
import torch

from conftest import tiny_qwen3_config
from modeling_d3d.masking_d3d import CAUSAL_BLOCK_ID, block_layout, create_block_diffusion_mask, interval_mask
from modeling_d3d.passes_d3d import PassLayoutBuilder
from modeling_d3d.sources_d3d import block_pass_layout
from modeling_d3d.successor_d3d import successor_layout


def visibility(num_causal, starts, block_size, past_length=0, attn="sdpa") -> torch.Tensor:
    """Boolean `(q_length, past + q_length)` matrix: may query q attend to key kv."""
    block_ids, visible_prefix, _ = block_layout(num_causal, torch.tensor([starts]), block_size, past_length)
    embeds = torch.zeros(1, block_ids.shape[1], 8)
    mask = create_block_diffusion_mask(tiny_qwen3_config(attn=attn), embeds, block_ids, visible_prefix, past_length)
    return mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0


def expected_visibility(num_causal, starts, block_size, past_length=0) -> torch.Tensor:
    """The rule written out position by position, independently of the mask function."""
    roles = [("causal", None)] * (past_length + num_causal)
    for k, start in enumerate(starts):
        roles += [("block", (k, start))] * block_size
    total = len(roles)
    rows = []
    for q in range(past_length, total):
        row = []
        for kv in range(total):
            q_role, q_info = roles[q]
            kv_role, kv_info = roles[kv]
            if q_role == "causal":
                row.append(kv_role == "causal" and kv <= q)
            else:
                own_block = kv_role == "block" and kv_info[0] == q_info[0]
                row.append(own_block or (kv_role == "causal" and kv < q_info[1]))
        rows.append(row)
    return torch.tensor(rows)


def test_packed_training_mask_matches_the_written_rule():
    got = visibility(num_causal=10, starts=[2, 5, 9], block_size=4)
    assert torch.equal(got, expected_visibility(10, [2, 5, 9], 4))


def test_each_block_sees_its_prefix_and_itself_only():
    got = visibility(num_causal=10, starts=[2, 5, 9], block_size=4)
    block1 = slice(10 + 4, 10 + 8)
    assert got[block1, :5].all()  # p, r_<s_k
    assert not got[block1, 5:10].any()  # r_>=s_k
    assert got[block1, block1].all()  # bidirectional inside the block
    assert not got[block1, 10:14].any() and not got[block1, 18:].any()  # other blocks


def test_causal_part_never_sees_blocks_or_the_future():
    got = visibility(num_causal=10, starts=[2, 5, 9], block_size=4)
    assert torch.equal(got[:10, :10], torch.ones(10, 10, dtype=torch.bool).tril())
    assert not got[:10, 10:].any()


def test_drafting_mask_over_a_cache_matches_the_written_rule():
    got = visibility(num_causal=3, starts=[9], block_size=5, past_length=6)
    assert torch.equal(got, expected_visibility(3, [9], 5, past_length=6))
    assert got[3:].all()  # the block sees all 6 cached + 3 new causal tokens and itself


def test_eager_mask_is_additive_with_the_same_pattern():
    block_ids, visible_prefix, _ = block_layout(6, torch.tensor([[1, 4]]), 3)
    embeds = torch.zeros(1, block_ids.shape[1], 8)
    eager = create_block_diffusion_mask(tiny_qwen3_config(attn="eager"), embeds, block_ids, visible_prefix)
    assert eager.dtype == torch.float32
    assert set(eager.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    assert torch.equal(eager[0, 0] == 0, expected_visibility(6, [1, 4], 3))


def test_layout_positions_continue_from_each_anchor():
    block_ids, visible_prefix, position_ids = block_layout(4, torch.tensor([[1, 3]]), 3, past_length=2)
    assert position_ids.tolist() == [[2, 3, 4, 5, 1, 2, 3, 3, 4, 5]]
    assert block_ids.tolist() == [[CAUSAL_BLOCK_ID] * 4 + [0, 0, 0, 1, 1, 1]]
    assert visible_prefix[0, 4:].tolist() == [1, 1, 1, 3, 3, 3]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_interval_mask_of_a_block_drafting_pass_is_the_block_diffusion_mask_of_the_same_tokens(attn):
    """The engine's block pass (rows with different cached prefixes, padded to one width, the block in scratch
    columns at its anchor) sees, for every real token, exactly what `create_block_diffusion_mask` lets the same
    tokens see; padding columns are seen by no real token."""
    block_size, generator = 4, torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, 90, (n,), generator=generator).tolist() for n in (9, 3, 14, 1)]
    committed = [2, 2, 13, 0]
    layout = block_pass_layout(contexts, committed, block_size, mask_id=95)
    config = tiny_qwen3_config(attn=attn)
    mask = interval_mask(config, layout.prefix_end, layout.own_start, layout.own_end, layout.kv_length(), torch.float32)
    sees = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    for row, (context, done) in enumerate(zip(contexts, committed)):
        anchor, uncached = len(context) - 1, len(context) - 1 - done
        expected = visibility(uncached, [anchor], block_size, past_length=done, attn=attn)
        real = slice(layout.ids.shape[1] - uncached - block_size, None)  # the padding comes first
        assert torch.equal(sees[row, real, : anchor + block_size], expected), row
        assert not sees[row, real, anchor + block_size :].any(), row


def test_interval_mask_and_the_block_diffusion_mask_disagree_when_the_layout_is_wrong():
    """The comparison above can fail: a block that misses the last token before its anchor is not the D3D rule."""
    contexts, block_size = [[5, 6, 7, 8]], 4
    layout = block_pass_layout(contexts, [0], block_size, mask_id=95)
    layout.prefix_end[0, -block_size:] -= 1
    mask = interval_mask(tiny_qwen3_config(), layout.prefix_end, layout.own_start, layout.own_end, layout.kv_length(),
                         torch.float32)
    expected = visibility(3, [3], block_size)
    assert not torch.equal(mask[0, 0, -(3 + block_size):, : 3 + block_size], expected)


@pytest.mark.parametrize("fixed", [False, True])
def test_interval_mask_of_a_successor_pass_is_the_block_diffusion_mask_of_the_same_tokens(fixed):
    """The packed successor pass (rows with different cached prefixes and block counts, padded to one width and, with
    `fixed`, to more blocks than any row plans) sees, for every real token, exactly what `create_block_diffusion_mask`
    lets the same tokens see: block `(token, j)` sees the context and the first `j` drafts; padding columns are seen
    by no real token."""
    block_size, generator = 4, torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 90, (n,), generator=generator).tolist() for n in (9, 3, 14)]
    committed, drafts = [5, 0, 13], [[7, 8, 9], [10, 11, 12], [13, 14, 15]]
    anchors = [[(20, 0), (21, 1), (9, 2)], [(12, 2)], [(22, 0), (15, 2)]]
    layout, blocks = successor_layout(contexts, committed, drafts, anchors, block_size, 95, fixed, 4 if fixed else 0)
    assert blocks == (4 if fixed else 3)
    config = tiny_qwen3_config()
    mask = interval_mask(config, layout.prefix_end, layout.own_start, layout.own_end, layout.kv_length(), torch.float32)
    sees = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    for row, (context, done, row_drafts, row_anchors) in enumerate(zip(contexts, committed, drafts, anchors)):
        uncached = len(context) - done + len(row_drafts)
        row_anchors = row_anchors + row_anchors[-1:] * (blocks - len(row_anchors))  # fewer blocks: the last repeats
        starts = [len(context) + j for _, j in row_anchors]
        expected = visibility(uncached, starts, block_size, past_length=done)
        real = slice(layout.ids.shape[1] - uncached - blocks * block_size, None)  # the padding comes first
        seen = done + uncached + blocks * block_size
        assert torch.equal(sees[row, real, :seen], expected), row
        assert not sees[row, real, seen:].any(), row
        for column in range(real.start):  # padding sees only the scratch column it writes
            assert sees[row, column].nonzero().flatten().tolist() == [layout.write_index[row, column].item()], row
        blocks_ids = [t for token, _ in row_anchors for t in [token] + [95] * (block_size - 1)]
        assert layout.ids[row, real].tolist() == context[done:] + row_drafts + blocks_ids, row


def test_a_layout_refuses_a_span_outside_its_columns():
    """An internal error, not a silently longer row: spans must fit the layout's width."""
    layout = PassLayoutBuilder(2, 4, 0)
    with pytest.raises(RuntimeError, match="outside"):
        layout.put_causal(0, 2, [1, 2, 3], 0)
    with pytest.raises(RuntimeError, match="outside"):
        layout.put_block(1, 1, [1, 2, 3, 4], 5, 5)
    with pytest.raises(RuntimeError, match="outside"):
        layout.put_padding(1, 3, 2, 9, 2)
    layout.put_causal(0, 1, [1, 2, 3], 0)
    assert layout.build().ids.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0]]
