"""Device-to-host copies that never stall the training step.

On CUDA every copy is queued with ``non_blocking=True`` into pinned host memory and
followed by a CUDA event; whoever needs the host values (the sender thread, or a
decision taken an iteration later) waits on that event, never the autograd or training
thread. Bulk copies (the reduced gradient buckets) run on a dedicated copy stream,
ordered after the work queued so far on the current stream (for a bucket: its
all-reduce); small reads (scalars, probes, audit samples, rank 0's state) run on the
current stream, so they see the values as of that point of the step.

CPU tensors take the same calls: the copy happens at once and the event is :data:`DONE`,
so the CPU tests exercise this code.
"""

from __future__ import annotations

from typing import Any

import torch


class _Done:
    """The event of a copy that has already happened (CPU tensors)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


DONE = _Done()


def _record(stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    # blocking: a thread that waits on it sleeps instead of spinning on a core the trainer may need
    ev = torch.cuda.Event(blocking=True)
    ev.record(stream)
    return ev


class CopyStream:
    """Bulk device-to-host copies for one device (the staging of reduced buckets).

    ``copy(dst, src)`` orders the copy after everything queued on the current stream,
    runs it on a side stream and returns its event. ``fence()`` makes the current stream
    wait for every copy queued so far (GPU-side: the host does not wait): call it before
    anything may write to a source again, e.g. DDP's bucket buffers in the next backward.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.last: torch.cuda.Event | _Done = DONE

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        stream = self.stream  # None unless the device is a GPU
        if stream is None or src.device.type != "cuda":
            dst.copy_(src)
            return DONE
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            ev = _record(stream)
        src.record_stream(stream)  # the allocator may not hand src's memory out before the copy ran
        self.last = ev
        return ev

    def copy_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        """``dst.copy_(src)`` for every pair, as :meth:`copy` does one: ordered once after
        the current stream, one event for all of them (an FSDP2 rank's gradients, one
        tensor per parameter)."""
        stream = self.stream
        if stream is None or not pairs or pairs[0][1].device.type != "cuda":
            for dst, src in pairs:
                dst.copy_(src)
            return DONE
        stream.wait_stream(torch.cuda.current_stream(pairs[0][1].device))
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            ev = _record(stream)
        for _, src in pairs:
            src.record_stream(stream)
        self.last = ev
        return ev

    def fence(self) -> None:
        if self.cuda and not isinstance(self.last, _Done):  # DONE: nothing copied yet
            torch.cuda.current_stream(self.device).wait_event(self.last)


class AsScalar:
    """A 0-dim (or one-element) tensor that becomes a Python number when a
    :class:`HostCopy` is read (``kind``: ``float``, ``int`` or ``bool``)."""

    __slots__ = ("tensor", "kind")

    def __init__(self, tensor: torch.Tensor, kind: type = float) -> None:
        self.tensor, self.kind = tensor, kind


class HostCopy:
    """A copy of a nested structure (dicts, lists, tuples, numbers, strings, tensors)
    taken now: containers are copied, device tensors are copied non-blocking into pinned
    memory on the current stream, CPU tensors are cloned. :meth:`get` waits for the
    copies (one event) and returns the structure with host tensors.

    The caller's later in-place changes (``scaler.update()``, the next step) do not reach
    the copy: on CUDA the copies are queued on the current stream before them."""

    def __init__(self, obj: Any) -> None:
        self._cuda = False
        self._value = self._copy(obj)
        self._event = _record() if self._cuda else DONE

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type == "cuda":
            self._cuda = True
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host
        if t.device.type == "cpu":
            return t.clone()
        return t.to("cpu")  # another accelerator: no pinned path here (rare; it waits)

    def _copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, AsScalar):
            return AsScalar(self._tensor(obj.tensor), obj.kind)
        if isinstance(obj, dict):
            return {k: self._copy(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._copy(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self._copy(v) for v in obj)
        return obj

    @property
    def ready(self) -> bool:
        """The copies have landed (never waits)."""
        return self._event.query()

    def get(self) -> Any:
        """Wait for the copies; the structure with host tensors and Python scalars."""
        self._event.synchronize()
        return _finish(self._value)


def _finish(obj: Any) -> Any:
    if isinstance(obj, AsScalar):
        return obj.kind(obj.tensor.reshape(-1)[0].item())
    if isinstance(obj, dict):
        return {k: _finish(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finish(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_finish(v) for v in obj)
    return obj


def gather(values: list[torch.Tensor]) -> torch.Tensor | None:
    """One-element views (``t.reshape(-1)[i]``) stacked into one float32 tensor on their
    device (one small kernel), to be read with a :class:`HostCopy`; None when empty."""
    if not values:
        return None
    return torch.stack([v.float() for v in values])


def scaler_state(scaler: Any) -> Any:
    """``GradScaler.state_dict()`` without its two ``.item()`` calls: a structure for
    :class:`HostCopy` whose :meth:`HostCopy.get` equals the state dict at this point."""
    if scaler is None:
        return None
    if not getattr(scaler, "_enabled", True) or not hasattr(scaler, "_growth_tracker"):
        return scaler.state_dict()  # disabled ({}), or not torch's GradScaler: its own state dict
    scale, tracker = scaler._scale, scaler._growth_tracker
    return {
        "scale": float(scaler._init_scale) if scale is None else AsScalar(scale, float),
        "growth_factor": scaler._growth_factor,
        "backoff_factor": scaler._backoff_factor,
        "growth_interval": scaler._growth_interval,
        "_growth_tracker": int(scaler._init_growth_tracker) if tracker is None else AsScalar(tracker, int),
    }
