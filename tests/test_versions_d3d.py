"""The supported versions (`modeling_d3d.versions_d3d`): the ranges as pip spells them, and the one-line refusals of
an unsupported torch and of compiled asynchronous drafting on CUDA before torch 2.13."""

import pytest
import torch

from modeling_d3d.versions_d3d import (TORCH_RANGE, TRANSFORMERS_RANGE, check_compiled_async, check_torch, release,
                                       requirement, supported)


def test_versions_are_read_as_major_minor_and_checked_against_the_ranges():
    assert release("2.11.0+cu130") == (2, 11) and release("5.17.0") == (5, 17)
    assert release("2.13.0.dev20260101") == (2, 13)
    assert requirement("transformers", TRANSFORMERS_RANGE) == "transformers>=5.17,<5.24"
    assert requirement("torch", TORCH_RANGE) == "torch>=2.4"
    assert [supported(v, TRANSFORMERS_RANGE) for v in ("5.16.2", "5.17.0", "5.23.0", "5.24.0")] == [False, True, True,
                                                                                                  False]
    assert supported("2.11.0+cu130", TORCH_RANGE) and supported(torch.__version__, TORCH_RANGE)
    with pytest.raises(ValueError, match="not a version: 'nightly'"):
        release("nightly")


def test_an_unsupported_torch_is_refused_in_one_line():
    with pytest.raises(ImportError) as error:
        check_torch("2.3.1")
    assert str(error.value) == "D3D needs torch>=2.4; this is torch 2.3.1"
    check_torch()  # this torch is supported


def test_compiled_async_on_cuda_needs_torch_2_13_in_one_line():
    """torch 2.11 and 2.12's CUDA graph trees assert when a graph is called from another thread than the one that
    imported the module, which the worker of asynchronous drafting is."""
    for version in ("2.11.0+cu130", "2.12.1"):
        with pytest.raises(ValueError) as error:
            check_compiled_async("cuda:0", version)
        assert str(error.value) == (
            f"compile=True with asynchronous=True on CUDA needs torch>=2.13 (CUDA graph trees are per thread from "
            f"2.13; this is torch {version}): upgrade torch, or use compile=True synchronously, or asynchronous=True "
            "without compile")
        check_compiled_async("cpu", version)  # no CUDA graphs on a CPU
    check_compiled_async(torch.device("cuda"), "2.13.0")
