"""The Hub front door: `target.generate(ids, custom_generate="org/d3d-drafter", trust_remote_code=True, ...)`.

A drafter's `save_pretrained` copies this file to `custom_generate/generate.py` beside its weights and remote code;
transformers then runs `generate` below in place of its own loop, handing it every argument `target.generate` was
given (`tokenizer` and `streamer` included). It loads the drafter from the same repo or folder (its remote code
is the D3D engine) unless `drafter=` is given, and calls the drafter's own front door, `drafter.generate_batch`,
which turns `stop_strings` + `tokenizer` into the stopping criterion `generate` builds and feeds the streamer.
Self-contained: torch and transformers only, no import of the project or of the drafter's modules.
"""

import inspect

import torch
from transformers import AutoModel

# What `custom_generate/requirements.txt` asks for (transformers checks it before running this file): the ranges of
# `versions_d3d` (this file imports nothing of the project; a test keeps the two and setup.cfg equal).
REQUIREMENTS = ("torch>=2.4", "transformers>=5.17,<5.24")
# `generate` keyword arguments that say where to load the drafter from, not how to decode.
LOADING_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")


def called_with(model) -> str:
    """The repo id or folder given as `target.generate(..., custom_generate=<it>)`: read from the frame of
    transformers' `generate` that is calling this file (it does not pass it on)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            names = frame.f_locals
            if frame.f_code.co_name == "generate" and names.get("self") is model \
                    and isinstance(names.get("custom_generate"), str):
                return names["custom_generate"]
            frame = frame.f_back
    finally:
        del frame
    raise ValueError("Could not tell which repo this D3D front door was loaded from: pass "
                     "drafter=AutoModel.from_pretrained(<the drafter repo>, trust_remote_code=True)")


def load_drafter(model, location: str, loading: dict, drafter_device=None):
    """The drafter of `location` in the target's dtype, on `drafter_device` or the target's device. Kept on the
    target as `target.d3d_drafter` (a plain attribute, not a submodule) and reused while the repo, revision, dtype
    and device are the same; its `round_record` is the round record of the last call."""
    device = torch.device(drafter_device) if drafter_device is not None else model.get_input_embeddings().weight.device
    key = (location, tuple(sorted((name, str(value)) for name, value in loading.items())), str(model.dtype), str(device))
    drafter = model.__dict__.get("d3d_drafter")
    if drafter is None or getattr(drafter, "d3d_source", None) != key:
        drafter = AutoModel.from_pretrained(location, trust_remote_code=True, dtype=model.dtype, **loading)
        drafter = drafter.to(device).eval()
        drafter.d3d_source = key
        model.__dict__["d3d_drafter"] = drafter  # not model.d3d_drafter = ...: that would register a submodule
    return drafter


def generate(model, inputs=None, drafter=None, assistant_model=None, **kwargs):
    """Speculative decoding of `inputs` `(batch, P)` (left-padded with `attention_mask`) by `model`, the target,
    with the D3D engine: what `target.generate` takes for greedy decoding and sampling (`stop_strings` with
    `tokenizer`, `streamer`, `max_new_tokens`, logits processors...) and the engine's settings (`asynchronous`,
    `coverage`, `fanout`, `drafter_device`...). drafter: a loaded D3D drafter (default: this repo's, see
    `load_drafter`). Returns what `generate` returns: `(batch, P + longest)` sequences."""
    if assistant_model is not None:
        raise ValueError("custom_generate=<a D3D drafter repo> drafts with that drafter: pass drafter=, not "
                         "assistant_model=")
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("The D3D front door needs the prompt ids: target.generate(input_ids, custom_generate=...)")
    loading = {name: kwargs.pop(name) for name in LOADING_KWARGS if kwargs.get(name) is not None}
    if drafter is None:
        drafter = load_drafter(model, called_with(model), loading, kwargs.get("drafter_device"))
    if getattr(getattr(drafter, "config", None), "model_type", None) != "d3d":  # every model has a generate_batch
        raise ValueError(f"drafter= must be a D3D drafter (AutoModel.from_pretrained(<repo>, trust_remote_code=True)), "
                         f"got {type(drafter).__name__}")
    settings = {name: value for name, value in kwargs.items() if value is not None}
    return drafter.generate_batch(model, input_ids, **settings)
