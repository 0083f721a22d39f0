"""What a compiled pass checks of its model: one fingerprint when an engine is built, in place of dynamo's guards on
the model at every call.

Dynamo checks, before every call of a compiled pass, that the model is still the one it traced: each module's type,
each parameter's and buffer's dtype, device, shape and strides, the config values the forward read (two thirds of
the ~1,000 entries of a 2-layer Qwen3's guard tree; on a CPU ~0.27 ms of a 12-layer target's ~3 ms compiled decoding
step, more the deeper the model: docs/results.md). Compiled passes drop those guards (`GUARD_FILTER`, torch's
`skip_guard_on_all_nn_modules_unsafe`; the guards on the pass's inputs, the cache and global state stay) and their
owner, `passes_d3d.CompiledPasses`, compares the model's `model_fingerprint` with the one it compiled for whenever an
engine takes a pass: a model changed in between (`model.half()`, a layer or its activation swapped, a hook added, a
config value or a module's attribute changed, train mode) gets newly compiled passes, never a stale graph. A model
changed while one engine decodes (a batch server's) is not seen until the next engine is built.
"""

from collections.abc import Callable

import torch

PLAIN = frozenset((bool, int, float, str))  # a module's attributes compared by value (`training`, eps, sizes, a
# sliding window; one set to or from None is seen by its appearing); of its other objects, those in its parameter,
# buffer, submodule and forward-hook dicts, its `config` and a `forward` set on the instance are compared by identity,
# the rest not at all: what a caller keeps on a model (a round record, None before the first call) must not compile
# anything again

# dynamo's filter dropping every guard on the model (torch >= 2.8; None before: every guard is kept)
GUARD_FILTER: Callable | None = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)


def _tensor(tensor: torch.Tensor | None) -> tuple | None:
    return None if tensor is None else (id(tensor), type(tensor), tensor.dtype, tensor.device, tensor.shape,
                                        tensor.stride(), tensor.requires_grad)


def _module(module: torch.nn.Module) -> tuple:
    attributes = module.__dict__  # read directly: a module's `__getattr__` is slow, and this runs for every module
    return (id(module), type(module), type(module).forward, id(attributes.get("forward")), id(attributes.get("config")),
            tuple([item for item in attributes.items() if type(item[1]) in PLAIN]),
            tuple(attributes["_modules"]), tuple(map(id, attributes["_modules"].values())),
            tuple(attributes["_parameters"]), tuple(map(_tensor, attributes["_parameters"].values())),
            tuple(attributes["_buffers"]), tuple(map(_tensor, attributes["_buffers"].values())),
            tuple(map(id, attributes["_forward_hooks"].values())),
            tuple(map(id, attributes["_forward_pre_hooks"].values())))


def _config(config) -> tuple:
    return tuple((name, value if type(value) in PLAIN or value is None else repr(value))
                 for name, value in vars(config).items())


def model_fingerprint(model: torch.nn.Module) -> tuple:
    """What a compiled forward of `model` depends on, as one comparable value: per module its identity, type, its
    class's `forward`, its plain attributes (`PLAIN`), which objects its `config`, its `forward` set on the instance,
    its submodules and forward hooks are, and its parameters' and buffers' identity, dtype, device, shape, strides and
    `requires_grad` (`model.half()` changes them in place); and the config's values. Not its tensors' values: a
    compiled pass reads those at every call (`load_state_dict` needs nothing compiled again). ~0.1 ms a decoder
    layer on a CPU."""
    return tuple(map(_module, model.modules())), _config(model.config)


__all__ = ["GUARD_FILTER", "model_fingerprint"]
