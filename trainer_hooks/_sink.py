"""Receiving a checkpoint's parameters straight into a live model's parameter tensors (a
:class:`shadow.restore.ParamSink`): no flat parameter array is allocated and nothing is
copied again at install. For parameters in CPU memory; a model on a GPU is restored
through the flat arrays."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator

import numpy as np
import torch

from shadow.layout import Layout
from shadow.transport.fetch import Scatter

PAGE = 4096


class ModelParams:
    """``params`` (the optimizer's, in the order of ``layout``) as one scatter target: a
    chunk of the flat parameter bytes lands in the tensors it covers."""

    def __init__(self, layout: Layout, params: list[torch.Tensor]) -> None:
        self.layout_hash = layout.hash
        self.tensors: tuple = tuple(params)
        self.starts = [spec.offset * 4 for spec in layout.params]  # byte offsets in the flat form
        self.views = [p.detach().numpy().reshape(-1).view(np.uint8) for p in params]
        self.scatter: Scatter = self  # the fetch's Scatter
        self.local = threading.local()  # each fetch thread's staging buffer
        self.written = False  # a chunk has been put into the parameters

    @classmethod
    def of(cls, layout: Layout, params: list[torch.Tensor]) -> ModelParams | None:
        """A sink for ``params``, or None if any is not a contiguous fp32 CPU tensor."""
        ok = all(p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() for p in params)
        return cls(layout, params) if ok and params else None

    def staging(self, nbytes: int) -> memoryview:
        """This thread's buffer for one chunk, page-aligned (a valid ``O_DIRECT`` target)."""
        buf = getattr(self.local, "buf", None)
        if buf is None or len(buf) < nbytes:
            raw = np.empty(nbytes + PAGE, dtype=np.uint8)
            start = (-raw.ctypes.data) % PAGE
            buf = self.local.buf = raw[start : start + nbytes]
        return buf[:nbytes].data

    def chunks(self, byte_offset: int, nbytes: int) -> Iterator[memoryview]:
        """The flat parameter bytes ``[byte_offset, byte_offset + nbytes)``, where they are
        now, in order (a shard file's checksum is taken over them)."""
        i, end = max(0, bisect.bisect_right(self.starts, byte_offset) - 1), byte_offset + nbytes
        while byte_offset < end and i < len(self.views):
            at = byte_offset - self.starts[i]
            n = min(len(self.views[i]) - at, end - byte_offset)
            if n > 0:
                yield self.views[i][at : at + n].data
                byte_offset += n
            i += 1

    def put(self, byte_offset: int, data: memoryview) -> None:
        self.written = True
        src = np.frombuffer(data, dtype=np.uint8)
        i, done = max(0, bisect.bisect_right(self.starts, byte_offset) - 1), 0
        while done < len(src) and i < len(self.views):
            at = byte_offset + done - self.starts[i]  # where in tensor i
            view = self.views[i]
            n = min(len(view) - at, len(src) - done)
            if n > 0:
                view[at : at + n] = src[done : done + n]
                done += n
            i += 1
        if done != len(src):
            raise ValueError(f"{len(src)} parameter bytes from byte {byte_offset} run past the model's parameters")
