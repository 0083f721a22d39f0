"""Whether a saved model folder's files are whole: read by the commands' input checks and by `d3d push`."""

import json
from pathlib import Path


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


__all__ = ["check_model_files"]
