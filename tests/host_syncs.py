"""Counting the host-device traffic a CPU run would have on a GPU.

On a CPU every tensor is on the host, so `HostSyncs` tracks which tensors would be on the device: the parameters
and buffers of the models, the caches, tensors created on the device (`device=`) or copied there (`.to(device)`),
and everything computed from any of them. "The device" is one of the `devices` given or a `.device` read from a
device tensor (a `device=` naming the device of a host tensor is the host). It counts, while active:

- reads: a device tensor's value reaching Python (`item`, `tolist`, `bool`, `int`, `float`, `__index__`, `numpy`,
  printing, `.cpu()`, `.to` another device) or an operation whose output size depends on device values
  (`nonzero`, boolean indexing, `masked_select`, `unique`): each one blocks the host until the device has caught up;
- uploads: host data copied to the device (`.to(device)` / `copy_` / item assignment of a host tensor into a device
  one, `torch.tensor`/`torch.as_tensor` of Python or host data with `device=`).

Host tensors (built without `device=`) are free to read: on a GPU they never leave the host.
"""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.__format__, torch.Tensor.__repr__,
         torch.Tensor.cpu, torch.Tensor.nonzero, torch.nonzero, torch.masked_select, torch.Tensor.masked_select,
         torch.unique, torch.Tensor.unique}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}
DATA_FACTORIES = {torch.tensor, torch.as_tensor}
WRITES = {torch.Tensor.copy_, torch.Tensor.__setitem__}
MARK = "_d3d_on_device"
DEVICE = torch.Tensor.device  # the descriptor: reading `tensor.device` calls its `__get__`


def on_device(value) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, MARK, False)


def mark(value) -> None:
    for tensor in tree_flatten(value)[0]:
        if isinstance(tensor, torch.Tensor):
            setattr(tensor, MARK, True)


class HostSyncs(TorchFunctionMode):
    """Count reads and uploads (see the module docstring) of the device tensors of `models` and `caches`."""

    def __init__(self, models=(), caches=(), devices=()):
        super().__init__()
        self.reads, self.uploads = 0, 0
        self.devices = list(devices) + [cache.device for cache in caches]  # kept alive: compared by identity
        for model in models:
            mark(list(model.parameters()) + list(model.buffers()))
        for cache in caches:
            mark([cache.key_buffer, cache.value_buffer] + cache.keys + cache.values)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tree_flatten((args, kwargs))[0]
        device_input = any(on_device(t) for t in inputs)
        if func in READS and on_device(args[0]):
            self.reads += 1
            result = func(*args, **kwargs)
            if func is torch.Tensor.cpu and result is args[0]:  # on a CPU the same tensor: a host alias of it
                result = result.view_as(result)
            return result  # on the host now
        if func is torch.Tensor.__getitem__ and on_device(args[0]) and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(args[1])[0]):
            self.reads += 1  # boolean indexing: the output size is read from the device
        if getattr(func, "__self__", None) is DEVICE and on_device(args[0]):
            device = func(*args, **kwargs)
            self.devices.append(device)
            return device
        moves = func in MOVES and (func is torch.Tensor.cuda or self.names_the_device(args[1:], kwargs))
        if moves and not on_device(args[0]):
            self.uploads += 1
        named = kwargs.get("device") is not None or any(isinstance(a, (str, torch.device)) for a in args[1:])
        if func in MOVES and on_device(args[0]) and named and not moves:  # `.to("cpu")`: a download
            self.reads += 1
            result = func(*args, **kwargs)
            return result.view_as(result) if result is args[0] else result
        created_on_device = func not in MOVES and self.names_the_device((), kwargs)
        if func in DATA_FACTORIES and created_on_device and not device_input:
            self.uploads += 1
        if func in WRITES and on_device(args[0]):
            source = args[1] if func is torch.Tensor.copy_ else args[2]
            if (isinstance(source, torch.Tensor) and not on_device(source)) or isinstance(source, (list, tuple)):
                self.uploads += 1
        result = func(*args, **kwargs)
        if moves and result is args[0]:  # on a CPU `.to` returns the host tensor itself: the device copy is an alias
            result = result.view_as(result)
        if device_input or created_on_device or moves:
            mark(result)
        return result

    def names_the_device(self, args, kwargs) -> bool:
        """Whether a call's `device=` (or a `.to(...)` argument) is the device: a device tensor or its `.device`."""
        named = [kwargs.get("device"), *args]
        return any(on_device(a) or any(a is device for device in self.devices) for a in named if a is not None)


__all__ = ["HostSyncs"]
