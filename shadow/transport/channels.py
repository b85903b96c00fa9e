"""A trainer's data channels over the transport each worker advertised: :class:`Channels`,
the :class:`~shadow.transport.send.DataSender` that picks ZeroMQ or UCX per worker by its
endpoint's scheme (``tcp://`` or ``ucx://``), so a trainer follows whatever transport its
cluster runs; UCX for Python is loaded only when a worker asks for it. Owned by the thread
that creates it (ZeroMQ sockets are not thread-safe)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import zmq

from shadow.transport.send import DataSender, Tracker, ZmqDataSender
from shadow.transport.ucx_base import is_ucx

if TYPE_CHECKING:
    from shadow.security import Door


class Channels:
    """A :class:`DataSender` that takes each worker's channel over the transport its
    endpoint names: ZeroMQ for ``tcp://`` (and ``ipc://``), UCX for ``ucx://``
    (:class:`~shadow.transport.ucx_send.UcxDataSender`, made the first time a worker asks for
    it)."""

    def __init__(
        self, ctx: zmq.Context, endpoints: Sequence[str], hwm: int, curve: Sequence[bool | Door] | None = None
    ) -> None:
        self.hwm = hwm
        self.curve = list(curve) if curve is not None else None
        self.via_ucx = [is_ucx(ep) for ep in endpoints]
        self.zmq = ZmqDataSender(
            ctx, [ep if not u else "" for ep, u in zip(endpoints, self.via_ucx, strict=True)], hwm, curve
        )
        self.ucx: DataSender | None = None
        try:
            for w, ep in enumerate(endpoints):
                if self.via_ucx[w]:
                    self._ucx_sender().open(w, ep, self.curve[w] if self.curve is not None else None)
        except BaseException:
            self.close()
            raise

    def _ucx_sender(self) -> DataSender:
        if self.ucx is None:
            from shadow.transport.ucx_send import UcxDataSender

            self.ucx = UcxDataSender([""] * len(self.via_ucx), self.hwm)
        return self.ucx

    def send(self, worker: int, frames: Sequence, track: bool) -> Tracker | None:
        if self.via_ucx[worker]:
            return self._ucx_sender().send(worker, frames, track)
        return self.zmq.send(worker, frames, track)

    def open(self, worker: int, endpoint: str, curve: bool | Door | None = None) -> None:
        self.drop(worker)
        self.via_ucx[worker] = is_ucx(endpoint)
        if self.via_ucx[worker]:
            self._ucx_sender().open(worker, endpoint, curve)
        else:
            self.zmq.open(worker, endpoint, curve)

    def drop(self, worker: int) -> None:
        self.zmq.drop(worker)
        if self.ucx is not None:
            self.ucx.drop(worker)

    def poll(self) -> None:
        if self.ucx is not None:
            self.ucx.poll()

    def close(self) -> None:
        self.zmq.close()
        if self.ucx is not None:
            self.ucx.close()
