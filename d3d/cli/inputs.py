"""Checks of a command's inputs that run while its arguments are parsed, before any model loads (argparse `type=`
functions): a bad value is one line, `d3d COMMAND: error: argument --NAME: WHAT`, and exit 2."""

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from d3d.common.model_files import check_model_files


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _integer(text, 1, None, "an integer >= 1")


def port(text: str) -> int:
    """A TCP port."""
    return _integer(text, 1, 65535, "a port, 1..65535")


def _integer(text: str, low: int, high: int | None, what: str) -> int:
    """`text` as an int from `low` to `high` (None: no bound); else `ArgumentTypeError` saying `what` it must be."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A number > 0."""
    return _number(text, lambda value: value > 0, "a number > 0")


def non_negative_float(text: str) -> float:
    """A number >= 0."""
    return _number(text, lambda value: value >= 0, "a number >= 0")


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    return _number(text, lambda value: 0 <= value <= 1, "a number from 0 to 1")


def top_p(text: str) -> float:
    """A number in (0, 1]: the probability mass nucleus sampling keeps."""
    return _number(text, lambda value: 0 < value <= 1, "a number in (0, 1]")


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _integer(text, 0, None, "an integer >= 0")


def _number(text: str, accepted: Callable[[float], bool], what: str) -> float:
    """`text` as a float if it is finite and `accepted` holds for it; else `ArgumentTypeError` saying `what` it must
    be."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or not accepted(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def device(text: str) -> str:
    """A device torch knows, such as cpu, cuda or cuda:1."""
    import torch

    try:
        torch.device(text)
    except RuntimeError as error:
        raise argparse.ArgumentTypeError(f"must be a device such as cpu, cuda or cuda:1, got {text!r}") from error
    return text


def repo_id(text: str) -> str:
    """A Hub repository id, `name` or `owner/name`."""
    if not _is_repo_id(text):
        raise argparse.ArgumentTypeError(f"must be a Hub repository id such as owner/name, got {text!r}")
    return text


def _is_repo_id(text: str) -> bool:
    """Whether the Hub takes `text` as a repository id (`huggingface_hub.utils.validate_repo_id`)."""
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def model_folder(text: str) -> str:
    """A saved model folder that exists, whose `config.json` is JSON and whose `*.safetensors` files are whole."""
    folder = Path(text)
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text}")
    try:
        check_model_files(folder)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def model_source(text: str) -> str:
    """A saved model folder (checked as `model_folder`) or a Hub id `owner/name`; anything else (a path or a bare
    name that is no folder) is refused here rather than looked up on the Hub."""
    if Path(text).is_dir():
        return model_folder(text)
    if text.count("/") == 1 and _is_repo_id(text) and not Path(text).exists():
        return text
    raise argparse.ArgumentTypeError(f"no such folder: {text} (and not a Hub id such as owner/name)")


__all__ = ["device", "fraction", "model_folder", "model_source", "non_negative_float", "port",
           "positive_float", "positive_int", "repo_id"]
