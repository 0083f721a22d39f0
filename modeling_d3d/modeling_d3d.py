"""`D3DForBlockDiffusion`: the drafter users load (`AutoModel.from_pretrained(folder, trust_remote_code=True)`).

The network (weights and forward passes) is `network_d3d.D3DBlockDiffusionModel`; this class adds the front doors,
each a thin call into the engine or its adapters: `speculative_generate`, `generate_batch`, `batch_server`,
`async_generator`, `select_prompt_chunks`, and `generate` as transformers' assistant (`assistant_model=drafter`).
"""

from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel

from .assistant_d3d import D3DAssistant, D3DAssistedGenerator
from .configuration_d3d import D3DConfig
from .engine_d3d import RoundRecord
from .generation_d3d import front_door_kwargs, speculative_generate
from .hub_generate_d3d import REQUIREMENTS, generate as hub_generate
from .inputs_d3d import check_prompts
from .network_d3d import D3DBlockDiffusionModel, check_compatibility
from .prefill_d3d import DEFAULT_CHUNK_SIZE, PromptSelection, SelectivePrefillOutput, d3d_generate, select_prompt_chunks
from .serving_d3d import D3DBatchServer
from .sources_d3d import BlockSource


def assisted_generation_config(block_size: int) -> GenerationConfig:
    """What transformers' assisted loop reads from the drafter: B-1 drafts a round, constant schedule, no confidence
    stop."""
    return GenerationConfig(num_assistant_tokens=block_size - 1, num_assistant_tokens_schedule="constant",
                            assistant_confidence_threshold=0.0)


class D3DForBlockDiffusion(D3DBlockDiffusionModel):
    """Standalone block-diffusion drafter with its decoding front doors (see the module docstring)."""

    def __init__(self, config: D3DConfig):
        super().__init__(config)
        self.round_record: RoundRecord | None = None
        self._assistant: D3DAssistant | None = None
        self.generation_config.update(**assisted_generation_config(config.block_size).to_diff_dict())

    def generate(self, inputs=None, generation_config=None, logits_processor=None, **kwargs):
        """As an assistant inside `target.generate(..., assistant_model=self)`: one block-drafting pass per round
        through the engine's block source (statistics in `self.round_record`; `self.settle(output)` closes the
        last round). Called directly: ordinary autoregressive generation (AR mode)."""
        if generation_config is not None and getattr(generation_config, "is_assistant", False):
            if self._assistant is None:
                self._assistant = D3DAssistant(BlockSource(self))
            input_ids = inputs if inputs is not None else kwargs.pop("input_ids")
            output = self._assistant.generate(input_ids, generation_config, logits_processor, **kwargs)
            self.round_record = self._assistant.round_record
            return output
        return super().generate(inputs, generation_config=generation_config, logits_processor=logits_processor, **kwargs)

    @classmethod
    def from_backbone(cls, *args, **kwargs) -> "D3DForBlockDiffusion":
        """See `network_d3d.D3DBlockDiffusionModel.from_backbone`; the drafter drafts `B - 1` tokens a round as an
        assistant (a backbone loaded from a path brings its own generation config)."""
        drafter = super().from_backbone(*args, **kwargs)
        drafter.generation_config.update(**assisted_generation_config(drafter.config.block_size).to_diff_dict())
        return drafter

    def settle(self, sequences: torch.Tensor) -> RoundRecord | None:
        """After `target.generate(..., assistant_model=self)`: close the last round from its output; the record."""
        return self._assistant.settle(sequences) if self._assistant is not None else None

    def async_generator(self, device: torch.device | str | None = None, **settings) -> D3DAssistedGenerator:
        """An asynchronous drafter for `target.generate(..., assistant_model=...)`; `settings`: coverage, fanout,
        worker_threads (see `assistant_d3d.D3DAssistedGenerator`)."""
        return D3DAssistedGenerator(self, device=device, **settings)

    def select_prompt_chunks(self, input_ids: torch.LongTensor, retention: float,
                             chunk_size: int = DEFAULT_CHUNK_SIZE) -> PromptSelection:
        """Selective prefill: score the chunks of the prompt `(1, L)` with the one-MASK probe and keep about
        `retention * L` tokens (see `prefill_d3d`)."""
        return select_prompt_chunks(self, input_ids, retention, chunk_size)

    def selective_prefill_generate(self, target: PreTrainedModel, input_ids: torch.LongTensor,
                                   selective_prefill: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                                   **generate_kwargs) -> SelectivePrefillOutput:
        """`target` decodes `input_ids` `(1, L)` with this drafter through the engine; `selective_prefill` < 1
        prefills only the chunks the probe keeps (see `prefill_d3d.d3d_generate`). The one front door that returns
        more than the tokens; the `custom_generate` function is `generation_d3d.speculative_generate`."""
        return d3d_generate(target, self, input_ids, selective_prefill, chunk_size, **generate_kwargs)

    def generate_batch(self, target: PreTrainedModel, input_ids: torch.LongTensor, attention_mask=None,
                       **generate_kwargs):
        """Batched speculative decoding of left-padded prompts `(batch, P)` for `target`:
        `target.generate(..., custom_generate=speculative_generate, drafter=self)`. `asynchronous=True` (with
        `coverage`, `fanout`) prepares successor blocks while the target verifies; statistics go to
        `self.round_record`."""
        check_prompts(input_ids, attention_mask)
        return target.generate(input_ids, attention_mask=attention_mask, custom_generate=speculative_generate,
                               drafter=self, **front_door_kwargs(generate_kwargs))

    def batch_server(self, target: PreTrainedModel, max_batch_size: int = 8, **settings) -> D3DBatchServer:
        """A `serving_d3d.D3DBatchServer` decoding requests for `target` with this drafter, up to `max_batch_size`
        at once (submit, stream, cancel; thread-safe); `settings`: asynchronous, coverage, fanout, max_length."""
        return D3DBatchServer(target, self, max_batch_size, **settings)

    def save_pretrained(self, save_directory, is_main_process: bool = True, **kwargs) -> None:
        """`PreTrainedModel.save_pretrained` (weights, config, remote code), plus the Hub front door:
        `custom_generate/generate.py` (a copy of `hub_generate_d3d.py`) and its `requirements.txt`, so that
        `target.generate(ids, custom_generate=<this folder or its Hub repo>, trust_remote_code=True)` runs the engine."""
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if not is_main_process:
            return
        folder = Path(save_directory) / "custom_generate"
        folder.mkdir(exist_ok=True)
        (folder / "generate.py").write_bytes(Path(hub_generate.__code__.co_filename).read_bytes())
        (folder / "requirements.txt").write_text("\n".join(REQUIREMENTS) + "\n")

    def adjust_generation_fn(self, *args, trust_remote_code=None, **kwargs) -> None:
        """Load the generation config only: the folder's `custom_generate/` is the target's decoding method (the Hub
        front door), which `from_pretrained` would otherwise bind as this drafter's own `generate`."""
        super().adjust_generation_fn(*args, trust_remote_code=False, **kwargs)

    def check_compatibility(self, target: PreTrainedModel, target_tokenizer=None, drafter_tokenizer=None) -> None:
        """Raise `ValueError` unless this drafter can draft for `target` (see `network_d3d.check_compatibility`)."""
        check_compatibility(self, target, target_tokenizer, drafter_tokenizer)


D3DConfig.register_for_auto_class()
D3DForBlockDiffusion.register_for_auto_class("AutoModel")

__all__ = ["D3DForBlockDiffusion", "assisted_generation_config"]
