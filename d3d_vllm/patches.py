"""Where vLLM 0.32 is told about D3D drafters: three narrow overrides, each a no-op unless the drafter is `d3d`.

- `GPUModelRunner.__init__` (the CPU runner inherits it): after vLLM builds its `DraftModelProposer`, a D3D drafter
  gets a `D3DProposer` instead;
- `SpeculativeConfig.max_num_new_slots_for_drafting` (the scheduler's token budget for drafting) and
  `VllmConfig.num_lookahead_tokens` (KV slots reserved past the verified tokens): B for D3D, because the proposer
  appends the whole block `[anchor, M x (B-1)]` to every request, where vLLM's PARD appends K.
"""

from collections.abc import Callable
from functools import wraps

from vllm.config import SpeculativeConfig, VllmConfig
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from .config import d3d_config


def apply() -> None:
    """Install the overrides (idempotent: vLLM may load its plugins more than once per process)."""
    if getattr(GPUModelRunner.__init__, "_d3d", False):
        return
    GPUModelRunner.__init__ = _with_d3d_drafter(GPUModelRunner.__init__)
    _override_property(SpeculativeConfig, "max_num_new_slots_for_drafting", lambda spec: spec)
    _override_property(VllmConfig, "num_lookahead_tokens", lambda config: config.speculative_config)


def _with_d3d_drafter(init: Callable) -> Callable:
    @wraps(init)
    def __init__(self, vllm_config: VllmConfig, *args, **kwargs) -> None:
        init(self, vllm_config, *args, **kwargs)
        if d3d_config(vllm_config.speculative_config) is not None and hasattr(self, "drafter"):
            from .proposer import D3DProposer

            self.drafter = D3DProposer(vllm_config=vllm_config, device=self.device, runner=self)

    __init__._d3d = True
    return __init__


def _override_property(cls: type, name: str, speculative_config_of: Callable) -> None:
    """`cls.name` returns the D3D block size when the speculative config is a D3D drafter's, else vLLM's value."""
    original = getattr(cls, name)

    def getter(self) -> int:
        config = d3d_config(speculative_config_of(self))
        return original.fget(self) if config is None else config.block_size

    setattr(cls, name, property(getter, doc=original.__doc__))
