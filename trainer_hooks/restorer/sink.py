"""Receiving a checkpoint's parameters straight into a live model's parameter tensors (a
:class:`shadow.restore.ParamSink`), from a cluster's memory: each chunk is checked before
it is put, no flat parameter array is allocated and nothing is copied again at install.
For parameters in CPU memory; a model on a GPU, and every read from a tier (whose whole-file
checksum is known only at the end), go through the flat arrays."""

from __future__ import annotations

import bisect
import threading

import numpy as np
import torch

from shadow.core.layout import Layout
from shadow.transport.fetch import Scatter


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
        self.world: int | None = None  # a checkpoint of another world is not put in place (ParamSink)

    @classmethod
    def of(cls, layout: Layout, params: list[torch.Tensor]) -> ModelParams | None:
        """A sink for ``params``, or None if any is not a contiguous fp32 CPU tensor (a
        sharded one, FSDP2's DTensor, holds only its rank's rows: it takes them from the
        flat arrays)."""
        ok = all(
            type(p) in (torch.Tensor, torch.nn.Parameter)
            and p.device.type == "cpu"
            and p.dtype == torch.float32
            and p.is_contiguous()
            for p in params
        )
        return cls(layout, params) if ok and params else None

    def staging(self, nbytes: int) -> memoryview:
        """This thread's buffer for one chunk."""
        buf = getattr(self.local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self.local.buf = np.empty(nbytes, dtype=np.uint8)
        return buf[:nbytes].data

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
