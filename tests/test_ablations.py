"""The ablation script's parsing and statistics (its end-to-end run needs a quickstart folder: see docs)."""

import math

import pytest

from d3d.quickstart.ablations import Variant, paired_difference, parse_variants


def test_variants_parse_and_bad_ones_are_refused():
    assert parse_variants("1:pretrained:16,0.5:random:64") == [Variant(1.0, True, 16), Variant(0.5, False, 64)]
    for text in ("1:pretrained", "1:scratch:16", "1:random:K"):
        with pytest.raises(ValueError):
            parse_variants(text)


def test_paired_difference_is_the_mean_difference_with_its_standard_error():
    mean, error = paired_difference([3.0, 4.0, 5.0], [2.0, 4.0, 3.0])  # differences 1, 0, 2
    assert mean == pytest.approx(1.0) and error == pytest.approx(math.sqrt(1.0 / 3))
