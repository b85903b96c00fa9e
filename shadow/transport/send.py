"""The sending end of the data path: one ordered channel per shadow worker.

A trainer's sender thread frames each message (``shadow.wire.frames``) and hands it to a
:class:`DataSender`. :class:`ZmqDataSender` is the default one (a PUSH socket per worker);
``shadow.transport.ucx_send.UcxDataSender`` streams over UCX;
``shadow.transport.channels.Channels`` picks one of them per worker by the scheme of the
endpoint the worker advertised (``tcp://`` or ``ucx://``). Fault injection
wraps a DataSender from the outside (``trainer_hooks.testing.FaultyDataSender``), so
nothing here checks for faults. Owned by the thread that creates it (ZeroMQ sockets are
not thread-safe)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import zmq

from shadow.transport.sockets import SocketFactory

if TYPE_CHECKING:
    from shadow.security import Door


class Tracker(Protocol):
    """Tells when the transport no longer reads a zero-copy message's buffers."""

    @property
    def done(self) -> bool: ...


class DataSender(Protocol):
    """Ordered, per-worker delivery of data messages (lists of frames)."""

    def send(self, worker: int, frames: Sequence, track: bool) -> Tracker | None:
        """Queue one message to ``worker``. ``track``: send the frames zero-copy and
        return a tracker (the caller keeps the buffers until it is done); otherwise the
        frames are copied and None is returned."""
        ...

    def open(self, worker: int, endpoint: str, curve: bool | Door | None = None) -> None:
        """(Re)open the channel to ``worker`` at ``endpoint``; whatever was queued on the
        old one is dropped. ``curve``: whether the worker's data socket takes CURVE (True),
        the credential for its door (a :class:`~shadow.security.Door`) or neither (False);
        None: as the channel had it."""
        ...

    def drop(self, worker: int) -> None:
        """Close the channel to ``worker`` and drop what is queued on it."""
        ...

    def poll(self) -> None:
        """Move along, without waiting, what waits on this side (UCX: messages queued
        until a new connection's worker is ready); the sender thread calls it between
        messages, and any tracker's ``done`` does too."""
        ...

    def close(self) -> None:
        """Close every channel, dropping what is queued."""
        ...


def open_each(sender: DataSender, endpoints: Sequence[str]) -> None:
    """Open ``sender``'s channel to every worker that has an endpoint (not ""); if one
    fails, close every channel and raise."""
    try:
        for w, ep in enumerate(endpoints):
            if ep:
                sender.open(w, ep)
    except BaseException:
        sender.close()
        raise


class ZmqDataSender:
    """A PUSH socket per worker, each with the data path's send high-water mark. ``curve``:
    per worker, whether its data socket takes CURVE (True: this process's client keys, as
    every keyed socket before), connections in clear through a door (a
    :class:`~shadow.security.Door`: a keyed cluster's ``mac`` mode, the rank's credential) or
    plain ones (False: no keys); default: CURVE wherever this process has keys. An empty endpoint: no channel to
    that worker until :meth:`open`."""

    def __init__(
        self, ctx: zmq.Context, endpoints: Sequence[str], hwm: int, curve: Sequence[bool | Door] | None = None
    ) -> None:
        self.factory, self.hwm = SocketFactory(ctx), hwm
        self.socks: list[zmq.Socket | None] = [None] * len(endpoints)
        self.curve: list[bool | Door] = list(curve) if curve is not None else [True] * len(endpoints)
        open_each(self, endpoints)

    def send(self, worker: int, frames: Sequence, track: bool) -> Tracker | None:
        sock = self.socks[worker]
        if sock is None:
            raise ValueError(f"no channel to shadow worker {worker}: it was dropped and not opened again")
        if not track:
            return sock.send_multipart(frames, copy=True)
        # one tracker per frame: pyzmq's send_multipart returns the last frame's only, and a
        # frame under the socket's copy threshold (64 KiB) is copied, its tracker done at once,
        # while the zero-copy frames before it still wait in the queue
        last = len(frames) - 1
        trackers = [sock.send(f, zmq.SNDMORE if i < last else 0, copy=False, track=True) for i, f in enumerate(frames)]
        return zmq.MessageTracker(*trackers)

    def open(self, worker: int, endpoint: str, curve: bool | Door | None = None) -> None:
        self.drop(worker)
        if curve is not None:
            self.curve[worker] = curve
        how = self.curve[worker]
        if how is True:
            self.socks[worker] = self.factory.push(endpoint, self.hwm)
        else:  # in clear: through the worker's door with a credential, else plain
            self.socks[worker] = self.factory.push(endpoint, self.hwm, keys=how or None)

    def drop(self, worker: int) -> None:
        sock, self.socks[worker] = self.socks[worker], None
        if sock is not None:
            sock.close(linger=0)

    def poll(self) -> None:
        """Nothing waits here: ZeroMQ's I/O threads move every queued message."""

    def close(self) -> None:
        for w in range(len(self.socks)):
            self.drop(w)
