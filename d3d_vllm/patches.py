"""Where vLLM 0.32 is told about D3D drafters: four narrow overrides, each a no-op unless the drafter is `d3d`.

- `GPUModelRunner.__init__` (Model Runner V1; the CPU runner inherits it): after vLLM builds its
  `DraftModelProposer`, a D3D drafter gets a `D3DProposer` instead;
- `VllmConfig.use_v2_model_runner`: False for a D3D drafter (the plugin hooks V1's runner; V2's draft-model
  speculator would draft causally), and an explicit `VLLM_USE_V2_MODEL_RUNNER=1` is refused at start;
- `SpeculativeConfig.max_num_new_slots_for_drafting` (the scheduler's token budget for drafting) and
  `VllmConfig.num_lookahead_tokens` (KV slots reserved past the verified tokens): B for D3D, because the block pass
  runs B query tokens per request and writes its scratch K/V in the B slots from the anchor, where vLLM's PARD
  has K.
"""

from collections.abc import Callable
from functools import wraps

from vllm import envs
from vllm.config import SpeculativeConfig, VllmConfig
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from .config import d3d_config


def apply() -> None:
    """Install the overrides (idempotent: vLLM may load its plugins more than once per process)."""
    if getattr(GPUModelRunner.__init__, "_d3d", False):
        return
    GPUModelRunner.__init__ = _with_d3d_drafter(GPUModelRunner.__init__)
    _override_property(SpeculativeConfig, "max_num_new_slots_for_drafting", lambda spec: spec,
                       lambda config, spec: config.block_size)
    _override_property(VllmConfig, "num_lookahead_tokens", lambda config: config.speculative_config,
                       lambda config, vllm_config: config.block_size)
    _override_property(VllmConfig, "use_v2_model_runner", lambda config: config.speculative_config,
                       lambda config, vllm_config: _model_runner_v2_refused())


def _with_d3d_drafter(init: Callable) -> Callable:
    @wraps(init)
    def __init__(self, vllm_config: VllmConfig, *args, **kwargs) -> None:
        init(self, vllm_config, *args, **kwargs)
        if d3d_config(vllm_config.speculative_config) is not None and hasattr(self, "drafter"):
            from .proposer import D3DProposer

            self.drafter = D3DProposer(vllm_config=vllm_config, device=self.device, runner=self)

    __init__._d3d = True
    return __init__


def _model_runner_v2_refused() -> bool:
    """False (Model Runner V1) unless V2 was asked for explicitly, which is refused (one line)."""
    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ValueError("D3D drafter: needs Model Runner V1 (the plugin hooks its GPUModelRunner); unset "
                         "VLLM_USE_V2_MODEL_RUNNER or set it to 0")
    return False


def _override_property(cls: type, name: str, speculative_config_of: Callable, d3d_value: Callable) -> None:
    """`cls.name` is `d3d_value(d3d config, self)` when the speculative config is a D3D drafter's, else vLLM's."""
    original = getattr(cls, name)

    def getter(self):
        config = d3d_config(speculative_config_of(self))
        return original.fget(self) if config is None else d3d_value(config, self)

    setattr(cls, name, property(getter, doc=original.__doc__))
