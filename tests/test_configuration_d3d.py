import pytest

from conftest import word_tokenizer
from modeling_d3d import D3DConfig


def make_config(**kwargs) -> D3DConfig:
    return D3DConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, **kwargs)


def test_defaults_and_round_trip(tmp_path):
    config = make_config(mask_token_id=7)
    assert (config.model_type, config.block_size, config.mask_token_id) == ("d3d", 16, 7)
    config.save_pretrained(tmp_path)
    loaded = D3DConfig.from_pretrained(tmp_path)
    assert (loaded.block_size, loaded.mask_token_id, loaded.vocab_size) == (16, 7, 96)


@pytest.mark.parametrize("block_size", [1, 0, -3])
def test_block_size_below_two_is_refused(block_size):
    with pytest.raises(ValueError, match=f"block_size must be an integer >= 2.*got {block_size}"):
        make_config(block_size=block_size)


@pytest.mark.parametrize("mask_token_id", [96, 1000, -1])
def test_mask_id_outside_vocabulary_is_refused(mask_token_id):
    with pytest.raises(ValueError, match=f"mask_token_id {mask_token_id} is outside the vocabulary"):
        make_config(mask_token_id=mask_token_id)


def test_sliding_window_layers_are_refused():
    with pytest.raises(ValueError, match="sliding-window"):
        make_config(num_hidden_layers=2, use_sliding_window=True, max_window_layers=1)


@pytest.mark.parametrize("special_id", [90, 91])
def test_mask_id_that_is_a_special_token_is_refused(special_id):
    with pytest.raises(ValueError, match=f"mask_token_id {special_id} .* special or added token"):
        make_config(mask_token_id=special_id).check_mask_token(word_tokenizer())


def test_ordinary_mask_id_passes_the_tokenizer_check():
    make_config(mask_token_id=89).check_mask_token(word_tokenizer())


def test_missing_mask_id_is_refused_by_the_tokenizer_check():
    with pytest.raises(ValueError, match="no mask_token_id"):
        make_config().check_mask_token(word_tokenizer())
