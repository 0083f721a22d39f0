"""Ordering, uploads and timing of device work without device-wide synchronization.

CUDA runs work asynchronously, in streams; the engine never fences with `torch.cuda.synchronize` on its hot path:

- `Fence`: recorded on the stream where work is submitted, waited on by the stream that consumes it (the device
  orders the two; the host goes on). Waiting on a fence that was never recorded raises (a CUDA stream waiting on an
  unrecorded event would not wait at all: a silent race).
- `handoff(tensors, stream)`: `record_stream` for tensors made on one stream and used on another, so the caching
  allocator does not hand their memory out again while the other stream still reads it.
- `upload(host, device)`: a host tensor on the device in one copy, from pinned memory without blocking the host.
- `Clock`: time points as CUDA timing events on a stream (elsewhere: the host clock, since work there has run when a
  call returns); `seconds` reads two of them once the work is known to be done, so timing adds no synchronization.

On CPUs every operation is a no-op beyond its bookkeeping; the order checks stay.
"""

import contextlib
import time
from dataclasses import dataclass

import torch


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on `device` (CUDA runs asynchronously). Off the hot path only (prefill, benchmarks):
    rounds order their work with `Fence`s and time it with a `Clock`."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def side_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """A stream of its own for background work on `device` (CUDA), else None (work runs in call order)."""
    device = torch.device(device)
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def current_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """This thread's current stream on `device` (CUDA), else None."""
    device = torch.device(device)
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def use_stream(stream: "torch.cuda.Stream | None"):
    """Make `stream` this thread's current stream inside the block (None: leave it)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def handoff(tensors, stream: "torch.cuda.Stream | None") -> None:
    """Tell the allocator that `stream` uses `tensors` (made on another stream of its device); None entries and
    tensors of other devices are skipped (those are used on their own device's stream)."""
    if stream is None:
        return
    for tensor in tensors:
        if tensor is not None and tensor.device == stream.device:
            tensor.record_stream(stream)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` in one copy: on CUDA from pinned memory, queued on the current stream without blocking the
    host (the pinned block is reused only once the copy is done, which PyTorch's host allocator tracks)."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def ordered_without_blocking(source: torch.device, destination: torch.device) -> bool:
    """Whether a copy from `source` to `destination` may be queued without blocking the host: only onto a CUDA
    device, where it is ordered on the destination's stream before the work that reads it. A copy from CUDA to the
    host must block: a non-blocking one returns before the bytes land, and the host (a `.tolist()`) would read stale
    memory."""
    return torch.device(destination).type == "cuda"


def move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: queued where that is safe (`ordered_without_blocking`), else a blocking copy."""
    return tensor.to(device, non_blocking=ordered_without_blocking(tensor.device, device))


class Fence:
    """A point in one stream's work on `device`: `record` it where the work is submitted, `wait` on it where the work
    is consumed (device side), or `synchronize` when the host needs the result (that stream only, never the whole
    device). name: what it guards, for error messages."""

    def __init__(self, device: torch.device, name: str = "work"):
        self.device, self.name = torch.device(device), name
        self.event = torch.cuda.Event() if self.device.type == "cuda" else None
        self.recorded = False

    def record(self, stream: "torch.cuda.Stream | None" = None) -> "Fence":
        """Mark the work submitted so far on `stream` (default: this thread's current stream of the device)."""
        if self.event is not None:
            self.event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        self.recorded = True
        return self

    def wait(self, stream: "torch.cuda.Stream | None" = None) -> None:
        """Make `stream` (default: this thread's current stream of the fence's device) run its later work after the
        recorded work; the host does not wait."""
        self._check()
        if self.event is not None:
            (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(self.event)

    def synchronize(self) -> None:
        """The host waits for the recorded work (and nothing else)."""
        self._check()
        if self.event is not None:
            self.event.synchronize()

    def _check(self) -> None:
        if not self.recorded:
            raise RuntimeError(f"A stream waits for {self.name} that was never submitted (fence not recorded)")


@dataclass
class TimePoint:
    """A point in a stream's work: the host clock when it was marked and, on CUDA, a timing event."""

    host: float
    event: "torch.cuda.Event | None" = None


class Clock:
    """Time points on `device`'s streams: CUDA timing events, or the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def mark(self, stream: "torch.cuda.Stream | None" = None) -> TimePoint:
        """A point after the work submitted so far on `stream` (default: this thread's current stream)."""
        if self.device.type != "cuda":
            return TimePoint(time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return TimePoint(time.perf_counter(), event)


def seconds(start: TimePoint, end: TimePoint) -> float:
    """Seconds from `start` to `end`, two points of one stream: device time between the events on CUDA (read once the
    work is done: call it after a read of the results, or it waits for `end`), the host clock elsewhere."""
    if start.event is None or end.event is None:
        return end.host - start.host
    end.event.synchronize()  # done already after the round's read: returns at once
    return start.event.elapsed_time(end.event) / 1000


__all__ = ["Clock", "Fence", "TimePoint", "current_stream", "handoff", "seconds", "side_stream", "synchronize", "upload",
           "use_stream"]
