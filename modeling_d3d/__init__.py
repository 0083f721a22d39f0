"""D3D drafter model code. Flat files with relative imports only: the folder ships to the Hub as remote code.

Layers, bottom up: `configuration_d3d`, `masking_d3d`, `network_d3d` (weights and forward passes); `caches_d3d`,
`shapes_d3d` (the compiled-shape policy), `guards_d3d` (what compiled passes check of their model), `passes_d3d` (one
forward over cache rows: verify, prefill), `threads_d3d`
(worker threads' modes, CPU worker pools), `acceptance_d3d` (logits to tokens: processing, drafts, acceptance);
`sources_d3d` (the source interface, `BlockSource`), `successor_d3d` (`SuccessorSource`); `engine_d3d` (the one loop); `settings_d3d`
(generate settings -> `RowSettings`); `inputs_d3d` (the front doors' prompt check); front doors: `generation_d3d` (`custom_generate`), `assistant_d3d` (`assistant_model=`),
`prefill_d3d`, `serving_d3d`, and `modeling_d3d.D3DForBlockDiffusion` (the class users load).
"""

from .assistant_d3d import D3DAssistant, D3DAssistedGenerator
from .configuration_d3d import D3DConfig
from .engine_d3d import RoundOutcome, RoundRecord, RoundTiming, RowSettings, SpeculativeEngine
from .generation_d3d import speculative_generate
from .modeling_d3d import D3DForBlockDiffusion
from .network_d3d import D3DBlockDiffusionModel, D3DBlockDraft, D3DPackedOutput, choose_mask_token_id
from .prefill_d3d import PromptSelection, SelectivePrefillOutput, d3d_generate, select_prompt_chunks
from .serving_d3d import D3DBatchServer, RequestHandle
from .sources_d3d import BlockSource
from .successor_d3d import SuccessorSource

__all__ = [
    "BlockSource", "D3DAssistant", "D3DAssistedGenerator", "D3DBatchServer", "D3DBlockDiffusionModel", "D3DBlockDraft",
    "D3DConfig", "D3DForBlockDiffusion", "D3DPackedOutput", "PromptSelection", "RequestHandle", "RoundOutcome",
    "RoundRecord", "RoundTiming", "RowSettings", "SelectivePrefillOutput", "SpeculativeEngine", "SuccessorSource",
    "choose_mask_token_id", "d3d_generate", "select_prompt_chunks", "speculative_generate",
]
