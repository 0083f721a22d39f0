"""From `generate` settings to one row's `RowSettings`: the one conversion every front door uses (`generate` with
`custom_generate`, `D3DBatchServer.submit`, the Space).

The target's own logits processors and stopping criteria are built by transformers from a generation config, as
`generate` builds them. A row's lengths are its own: `generate` prepares a config for the padded width of its
batch (`min_length = min_new_tokens + width`, `max_length = max_new_tokens + width`), and the batched `generate`
counts every row's tokens from that width, so each row's minimum and maximum are re-based on its own prompt (`min_length`
and `max_length` move by `len(prompt) - width`), and the processors that read a prompt's length are rebuilt for it.
"""

import copy

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode

from .engine_d3d import RowSettings

# generate settings whose processors depend on the prompt's length or the batch (repetition_penalty reads every row's
# padding): rebuilt for each row from a config generate prepared.
LENGTH_DEPENDENT_SETTINGS = ("min_length", "min_new_tokens", "forced_eos_token_id", "begin_suppress_tokens",
                             "exponential_decay_length_penalty", "repetition_penalty")
UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def check_generation_settings(generation_config, synced_gpus: bool = False) -> None:
    """Raise `ValueError` for `generate` settings the engine does not run (beam search, contrastive search, DoLa,
    several sequences per prompt, per-step outputs, classifier-free guidance), never a silent substitute."""
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"D3D speculative decoding runs greedy decoding or sampling, not {mode.value.replace('_', ' ')} "
                         f"(num_beams={generation_config.num_beams}); drop those settings or decode without a drafter")
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError("num_return_sequences > 1 is not supported by D3D speculative decoding; repeat the prompt "
                         "in the batch instead")
    used = [name for name in UNSUPPORTED_OUTPUTS if getattr(generation_config, name, False)]
    if used:
        raise ValueError(f"{', '.join(used)} are not returned by D3D speculative decoding")
    if generation_config.guidance_scale not in (None, 1.0):
        raise ValueError("guidance_scale (classifier-free guidance) is not supported by D3D speculative decoding")
    if synced_gpus:
        raise ValueError("synced_gpus is not supported by D3D speculative decoding")


def eos_ids(generation_config) -> frozenset[int]:
    """The config's EOS ids: the tensor `generate` prepared, else `eos_token_id`."""
    eos = getattr(generation_config, "_eos_token_tensor", None)
    if eos is None:
        eos = generation_config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset(torch.as_tensor(eos).reshape(-1).tolist())


def row_config(generation_config, prompt_length: int, prepared_width: int | None, device):
    """A copy of `generation_config` with this row's own lengths and its EOS tensor (processors read it).
    prepared_width: the width `generate` prepared the config for (None: the lengths are as a user gives them)."""
    config = copy.deepcopy(generation_config)
    if prepared_width is None:  # prepare the lengths as generate does, for this prompt
        new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_length
        if isinstance(new, bool) or not isinstance(new, int) or new < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {new!r}")
        config.max_length = prompt_length + new
        if config.min_new_tokens is not None:
            config.min_length = config.min_new_tokens + prompt_length
    else:  # generate's lengths count from the padded width: the same counts from this row's own
        shift = prompt_length - prepared_width
        config.max_length += shift
        if config.min_length:
            config.min_length = max(config.min_length + shift, 0)
    eos = sorted(eos_ids(config))
    config._eos_token_tensor = torch.tensor(eos, device=device) if eos else None
    return config


def row_settings(target, generation_config, prompt: list[int], logits_processor: LogitsProcessorList | None = None,
                 stopping_criteria: StoppingCriteriaList | None = None, tokenizer=None, seed: int | None = None,
                 prepared_width: int | None = None, synced_gpus: bool = False) -> RowSettings:
    """The `RowSettings` of one row decoding `prompt` (its ids, no padding) with `generation_config`.

    Without `prepared_width`, the config is as a user gives it (`max_new_tokens`, `min_new_tokens`, ...):
    `logits_processor` and `stopping_criteria` are added to those built from it, as `generate` merges them (one of a
    type the config also builds replaces it); `tokenizer` serves `stop_strings`. With `prepared_width`, the config,
    processors and criteria are those `generate` prepared for a batch of that width before calling a
    `custom_generate`: the lengths are re-based on this row's own (see the module docstring) and the processors that
    depend on the length or the batch are rebuilt for this row (the other processors given are kept).
    Raises `ValueError` for settings the engine does not run or a row with no room for one new token.
    """
    check_generation_settings(generation_config, synced_gpus)
    device = target.device
    config = row_config(generation_config, len(prompt), prepared_width, device)
    max_new_tokens = config.max_length - len(prompt)
    processors = LogitsProcessorList(logits_processor or [])
    criteria = StoppingCriteriaList(stopping_criteria or [])
    ids = torch.tensor([prompt], device=device)
    if prepared_width is None:
        if config.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer")
        processors = target._get_logits_processor(generation_config=config, input_ids_seq_length=len(prompt),
                                                  encoder_input_ids=ids, logits_processor=processors,
                                                  device=str(device))
        criteria = target._get_stopping_criteria(generation_config=config, stopping_criteria=criteria,
                                                 tokenizer=tokenizer)  # its EOS and length criteria are the engine's
    elif any(getattr(config, name, None) for name in LENGTH_DEPENDENT_SETTINGS):  # built for the batch: rebuilt
        built = target._get_logits_processor(generation_config=config, input_ids_seq_length=len(prompt),
                                             encoder_input_ids=ids, device=str(device))
        built_types = {type(p) for p in built}
        processors = LogitsProcessorList([*built, *(p for p in processors if type(p) not in built_types)])
    return RowSettings(max_new_tokens, bool(config.do_sample), eos_ids(config), processors, criteria, seed)


__all__ = ["LENGTH_DEPENDENT_SETTINGS", "check_generation_settings", "eos_ids", "row_settings"]
