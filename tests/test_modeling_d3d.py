import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3ForCausalLM

from conftest import tiny_qwen3_config, tiny_target, word_tokenizer
from modeling_d3d import D3DForBlockDiffusion, choose_mask_token_id
from modeling_d3d.masking_d3d import block_layout

BLOCK = 4


@pytest.fixture(params=["sdpa", "eager"])
def attn(request) -> str:
    return request.param


def drafter_for(attn: str, seed: int = 3) -> D3DForBlockDiffusion:
    return D3DForBlockDiffusion.from_backbone(tiny_target(seed, attn=attn), block_size=BLOCK).eval()


def packed_logits(drafter, shared: torch.Tensor, anchors: list[int], anchor_tokens: list[int] | None = None):
    """Logits `(K, B, V)` of K blocks packed after `shared` `(1, S)`, with explicit anchor tokens so a test can change
    the shared copy of a token without touching a block."""
    starts = torch.tensor([anchors])
    tokens = torch.tensor([anchor_tokens if anchor_tokens is not None else shared[0, anchors].tolist()])
    block_ids, visible_prefix, position_ids = block_layout(shared.shape[1], starts, BLOCK)
    ids = torch.cat([shared, drafter.mask_blocks(tokens)], dim=1)
    out = drafter(input_ids=ids, position_ids=position_ids, block_ids=block_ids, visible_prefix=visible_prefix)
    return out.logits[0, : shared.shape[1]], out.logits[0, shared.shape[1] :].reshape(len(anchors), BLOCK, -1)


def test_ar_mode_equals_the_backbone(attn):
    backbone = tiny_target(5, attn=attn)
    drafter = D3DForBlockDiffusion.from_backbone(backbone, block_size=BLOCK).eval()
    ids = torch.randint(0, 90, (3, 17))
    torch.testing.assert_close(drafter(ids).logits, backbone(ids).logits, atol=1e-5, rtol=0)
    for name, tensor in backbone.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], tensor), name


def test_from_backbone_path_loads_the_same_weights(tmp_path):
    backbone = tiny_target(6)
    backbone.save_pretrained(tmp_path)
    drafter = D3DForBlockDiffusion.from_backbone(str(tmp_path), block_size=8, mask_token_id=11, dtype=torch.float32)
    assert (drafter.config.block_size, drafter.config.mask_token_id) == (8, 11)
    ids = torch.randint(0, 90, (1, 9))
    torch.testing.assert_close(drafter(ids).logits, backbone(ids).logits, atol=1e-5, rtol=0)


def test_default_mask_id_is_an_unused_id_and_is_recorded(tmp_path):
    tokenizer = word_tokenizer(num_words=90)  # 92 tokens, embedding has 96 rows
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(0), tokenizer=tokenizer)
    assert drafter.config.mask_token_id == 95 and drafter.config.mask_token_id >= len(tokenizer)
    drafter.save_pretrained(tmp_path)
    assert D3DForBlockDiffusion.from_pretrained(tmp_path).config.mask_token_id == 95


def test_default_mask_id_prefers_an_ordinary_reserved_token_when_the_vocabulary_is_full():
    tokenizer = word_tokenizer(num_words=90, words=("reserved_0", "w_last"))
    assert choose_mask_token_id(len(tokenizer), tokenizer) == 88
    with pytest.raises(ValueError, match="pass mask_token_id explicitly"):
        choose_mask_token_id(len(word_tokenizer()), word_tokenizer())


def test_special_mask_id_with_tokenizer_is_refused():
    with pytest.raises(ValueError, match="mask_token_id 90 .* special"):
        D3DForBlockDiffusion.from_backbone(tiny_target(0), mask_token_id=90, tokenizer=word_tokenizer())


def test_backbone_that_is_not_qwen3_is_refused():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32))
    with pytest.raises(ValueError, match="Qwen3-style causal LM.*'llama'"):
        D3DForBlockDiffusion.from_backbone(llama)


def test_drafting_without_mask_token_is_refused():
    drafter = D3DForBlockDiffusion.from_backbone(tiny_target(0), mask_token_id=5)
    drafter.config.mask_token_id = None
    with pytest.raises(ValueError, match="no mask_token_id"):
        drafter.draft_block(torch.tensor([[1, 2, 3]]))


def test_changing_a_block_token_only_changes_that_block(attn):
    drafter = drafter_for(attn)
    shared = torch.randint(0, 90, (1, 12))
    anchors = [3, 6, 10]
    base_shared, base_blocks = packed_logits(drafter, shared, anchors)
    for k in range(len(anchors)):
        tokens = shared[0, anchors].tolist()
        tokens[k] = (tokens[k] + 1) % 90
        new_shared, new_blocks = packed_logits(drafter, shared, anchors, tokens)
        torch.testing.assert_close(new_shared, base_shared, atol=0, rtol=0)
        for other in range(len(anchors)):
            changed = (new_blocks[other] - base_blocks[other]).abs().amax(-1) > 1e-6
            if other == k:
                assert changed[1:].all()  # bidirectional: every masked position of block k moved
            else:
                assert not changed.any()


def test_block_sees_the_response_before_its_anchor_only(attn):
    drafter = drafter_for(attn)
    shared = torch.randint(0, 90, (1, 12))
    anchors, anchor_tokens = [6], shared[0, [6]].tolist()
    _, base = packed_logits(drafter, shared, anchors, anchor_tokens)
    for index in range(12):
        perturbed = shared.clone()
        perturbed[0, index] = (perturbed[0, index] + 1) % 90
        _, blocks = packed_logits(drafter, perturbed, anchors, anchor_tokens)
        moved = not torch.allclose(blocks, base, atol=1e-6, rtol=0)
        assert moved == (index < 6), index


@pytest.mark.parametrize("anchors", [[1, 4, 7, 10], [0, 5, 11], [11]])
def test_packed_training_equals_block_drafting(attn, anchors):
    drafter = drafter_for(attn)
    shared = torch.randint(0, 90, (2, 12))  # anchor 11: its block runs past the end of the sequence
    packed = drafter.forward_packed(shared, torch.tensor([anchors, anchors]))
    for row in range(2):
        for k, anchor in enumerate(anchors):
            draft = drafter.draft_block(shared[row : row + 1, : anchor + 1])
            torch.testing.assert_close(packed.diffusion_logits[row, k], draft.logits[0], atol=1e-4, rtol=0)
    causal = drafter(shared).logits
    torch.testing.assert_close(packed.ar_logits, causal, atol=1e-5, rtol=0)


def test_packed_training_with_padding_ignores_pad_tokens():
    drafter = drafter_for("sdpa")
    shared = torch.randint(0, 90, (1, 9))
    padded = torch.cat([shared, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 9), torch.zeros(1, 3)], dim=1).long()
    anchors = torch.tensor([[2, 7]])
    plain = drafter.forward_packed(shared, anchors)
    padded_out = drafter.forward_packed(padded, anchors, attention_mask=mask)
    torch.testing.assert_close(padded_out.diffusion_logits, plain.diffusion_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded_out.ar_logits[:, :9], plain.ar_logits, atol=1e-5, rtol=0)


def test_drafting_with_a_reused_extended_cache_equals_drafting_from_scratch(attn):
    drafter = drafter_for(attn)
    sequence = torch.randint(0, 90, (1, 30))
    cache = None
    for length in [3, 4, 9, 10, 17, 30]:
        incremental = drafter.draft_block(sequence[:, :length], past_key_values=cache)
        cache = incremental.past_key_values
        assert cache.get_seq_length() == length - 1
        scratch = drafter.draft_block(sequence[:, :length])
        torch.testing.assert_close(incremental.logits, scratch.logits, atol=1e-5, rtol=0)
        assert torch.equal(incremental.tokens, scratch.tokens)


def test_cache_longer_than_the_prefix_is_refused():
    drafter = drafter_for("sdpa")
    cache = drafter.draft_block(torch.randint(0, 90, (1, 10))).past_key_values
    with pytest.raises(ValueError, match="cache holds 9 tokens"):
        drafter.draft_block(torch.randint(0, 90, (1, 6)), past_key_values=cache)


def test_flash_attention_is_refused_with_a_clear_error():
    drafter = drafter_for("sdpa")
    drafter.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="arbitrary attention mask"):
        drafter.draft_block(torch.randint(0, 90, (1, 5)))


def test_sampled_drafts_follow_the_processed_distribution():
    drafter = drafter_for("sdpa")
    torch.manual_seed(0)
    prefix = torch.randint(0, 90, (1, 6))
    logits = drafter.draft_block(prefix).logits[0, 0]
    draws = torch.stack([drafter.draft_block(prefix, do_sample=True).tokens[0, 0] for _ in range(400)])
    top = logits.argmax()
    frequency = (draws == top).float().mean().item()
    assert abs(frequency - logits.softmax(-1)[top].item()) < 0.08


def test_backbone_class_is_still_a_qwen3_causal_lm():
    assert isinstance(tiny_target(0), Qwen3ForCausalLM) and tiny_qwen3_config().model_type == "qwen3"
