"""D3D drafter model code. Flat files with relative imports only: the folder ships to the Hub as remote code."""

from .async_d3d import D3DAssistedGenerator
from .configuration_d3d import D3DConfig
from .modeling_d3d import D3DBlockDraft, D3DForBlockDiffusion, D3DPackedOutput, choose_mask_token_id
from .prefill_d3d import PromptSelection, SelectivePrefillDrafter, SelectivePrefillOutput, d3d_generate, select_prompt_chunks
from .speculative_d3d import SpeculativeStats

__all__ = [
    "D3DAssistedGenerator", "D3DBlockDraft", "D3DConfig", "D3DForBlockDiffusion", "D3DPackedOutput", "PromptSelection",
    "SelectivePrefillDrafter", "SelectivePrefillOutput", "SpeculativeStats", "choose_mask_token_id", "d3d_generate",
    "select_prompt_chunks",
]
