"""Checks of a command's inputs that run while its arguments are parsed, before any model loads (argparse `type=`
functions): a bad value is one line, `d3d COMMAND: error: argument --NAME: WHAT`, and exit 2."""

import argparse
import json
import re
from pathlib import Path

# A Hub repository id: `name` or `owner/name` (what `from_pretrained` looks up on the Hub when no such folder exists).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


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
    """A saved model folder (checked as `model_folder`) or a Hub id; a path that is no folder is refused here rather
    than looked up on the Hub."""
    if Path(text).is_dir():
        return model_folder(text)
    if not HUB_ID.fullmatch(text) or Path(text).exists():
        raise argparse.ArgumentTypeError(f"no such folder: {text} (and not a Hub id such as owner/name)")
    return text


def check_model_files(folder: Path) -> None:
    """Raise `ValueError` naming the file unless `folder`'s `config.json` (if any) is JSON and each of its
    `*.safetensors` files has a whole header and all the data it announces (a truncated download fails here, not as
    a traceback from the loader)."""
    from safetensors import SafetensorError, safe_open

    config = folder / "config.json"
    if config.is_file():
        try:
            json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{config} is not valid JSON ({error})") from error
    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(weights, "pt"):
                pass
        except SafetensorError as error:
            raise ValueError(f"{weights} is not a whole safetensors file ({error}): truncated or "
                             "corrupt; save or download it again") from error


__all__ = ["HUB_ID", "check_model_files", "model_folder", "model_source", "positive_float", "positive_int"]
