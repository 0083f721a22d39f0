"""D3D drafter model code. Flat files with relative imports only: the folder ships to the Hub as remote code."""

from .async_d3d import D3DAssistedGenerator
from .batched_d3d import BatchStats, D3DAsyncBatchDecoder, D3DBatchDecoder, RowSettings, batched_speculative_generate
from .configuration_d3d import D3DConfig
from .modeling_d3d import D3DBlockDraft, D3DForBlockDiffusion, D3DPackedOutput, choose_mask_token_id
from .prefill_d3d import PromptSelection, SelectivePrefillDrafter, SelectivePrefillOutput, d3d_generate, select_prompt_chunks
from .serving_d3d import D3DBatchServer, RequestHandle
from .speculative_d3d import SpeculativeStats

__all__ = [
    "BatchStats", "D3DAssistedGenerator", "D3DAsyncBatchDecoder", "D3DBatchDecoder", "D3DBatchServer", "D3DBlockDraft",
    "D3DConfig", "D3DForBlockDiffusion", "D3DPackedOutput", "PromptSelection", "RequestHandle", "RowSettings",
    "SelectivePrefillDrafter", "SelectivePrefillOutput", "SpeculativeStats", "batched_speculative_generate",
    "choose_mask_token_id", "d3d_generate", "select_prompt_chunks",
]
