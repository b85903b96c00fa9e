"""The data path over UCX (``transport.data=ucx``), for RDMA fabrics (InfiniBand, RoCE, EFA)
and, in tests and on hosts without them, TCP. Needs the optional extra
``shadow-checkpoint[ucx]`` (UCX for Python, ``ucxx``); ZeroMQ stays the default data path
and the only control plane.

One UCX connection per trainer rank and worker, opened to the worker's listener
(``ucx://host:port``, advertised in its register like a ZeroMQ endpoint). Each carries an
ordered stream of data messages, the same messages as over ZeroMQ (``shadow.wire.frames``:
a header frame, then one part per run, tagged with checksums or, on a keyed cluster's
``mac`` data path, MACs under the rank's key). On the stream a message is:

* a preamble (:data:`PREAMBLE`: magic, frame count, total bytes) and the frames' sizes,
  8 bytes each, sent together from one small buffer;
* the frames, each sent zero-copy from where the trainer holds it (the pinned staging ring
  for gradients) and received into one fresh buffer per message, where the worker's
  kernels read the parts (the ZeroMQ path keeps its frames the same way).

What reaches a worker is checked before it is believed, as on ZeroMQ:
:class:`UcxDataSocket` refuses a preamble that is not ours, a frame count or size beyond
what a sender ever makes, and a connection that queues more messages than the data path's
receive high-water mark (it closes that connection: UCX streams have no receive-side flow
control, so a connection that outruns the worker is not read into memory without bound;
a trainer's credit keeps a real one far below it). Every frame then goes through
:class:`~shadow.transport.receive.FrameReceiver` (tags or MACs, bounds, epoch, layout).
UCX carries no CURVE: a keyed cluster streams over UCX in ``mac`` mode only.

A dead peer ends its connection with an error (UCX's peer error handling is on): the
trainer's sends to it complete and free their buffers, and later messages to that worker
are dropped until the channel is opened again (:meth:`UcxDataSender.open`: a resync's new
sender, or a ``replica_in``); the coordinator finds the messages missing and resyncs, as
when a ZeroMQ connection drops. The trainer does not reconnect on its own: a worker that
comes back listens on a new port, which only the coordinator knows. No UCX callback runs
Python on UCX's progress thread: it would wait for the GIL while holding the UCX worker's
lock, which a send on the sender thread waits for.

Settings: UCX's own environment (``UCX_TLS``, ``UCX_NET_DEVICES``, ...) applies as
documented by UCX; the TCP transport's segment size defaults to 1 MiB here
(:data:`DEFAULTS`; UCX's 64 KiB moves large frames at about a third of ZeroMQ's rate),
unless the environment sets it.
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from shadow.errors import ShadowError
from shadow.transport.send import open_each

logger = logging.getLogger(__name__)

SCHEME = "ucx"
MAGIC = b"SHU1"
#: magic, frame count, total bytes of the frames
PREAMBLE = struct.Struct("<4sIQ")
SIZE = struct.Struct("<Q")
#: UCX settings this data path changes from UCX's defaults, unless ``UCX_<name>`` is set
DEFAULTS = {"TCP_TX_SEG_SIZE": "1M", "TCP_RX_SEG_SIZE": "1M"}
#: connections a worker holds at once (a trainer rank has one); more are closed at once
MAX_CONNECTIONS = 4096

INSTALL = "pip install 'shadow-checkpoint[ucx]' (UCX for Python, ucxx)"


def lib() -> Any:
    """UCX for Python's core module, or a :class:`ShadowError` saying how to install it."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets a variable this UCX no longer reads
    try:
        from ucxx._lib import libucxx
    except ImportError as exc:
        raise ShadowError(
            f"transport.data=ucx needs UCX for Python, which is not installed ({exc}): {INSTALL}"
        ) from None
    return libucxx


def available() -> bool:
    """Whether UCX for Python is installed here (found, not loaded: loading it sets UCX's
    environment and maps its libraries into this process)."""
    import importlib.util

    try:
        return importlib.util.find_spec("ucxx") is not None
    except (ImportError, ValueError):
        return False


def _array(buf) -> Any:
    from ucxx._lib.arr import Array

    return Array(buf)


def endpoint(host: str, port: int) -> str:
    """A worker's UCX data endpoint as it is advertised."""
    return f"{SCHEME}://{host}:{port}"


def parse(ep: str) -> tuple[str, int]:
    """``(host, port)`` of a ``ucx://host:port`` endpoint; ValueError naming it otherwise."""
    parts = urlsplit(ep)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != SCHEME or not parts.hostname or not port:
        raise ValueError(f"{ep!r} is not a UCX data endpoint (ucx://host:port)")
    return parts.hostname, port


def is_ucx(ep: str) -> bool:
    return ep.startswith(SCHEME + "://")


def _context(L: Any) -> Any:
    config = {k: v for k, v in DEFAULTS.items() if "UCX_" + k not in os.environ}
    return L.UCXContext(config_dict=config, feature_flags=(L.Feature.STREAM, L.Feature.WAKEUP))


def _as_bytes(frame) -> np.ndarray:
    """A frame's bytes as a flat uint8 array over the same memory."""
    return np.frombuffer(frame, dtype=np.uint8) if len(memoryview(frame)) else np.empty(0, np.uint8)


def _close_endpoint(ep: Any, blocking: bool = False) -> None:
    """Close a UCX endpoint unless UCX already closed it (a peer that went away): closing
    one twice crashes UCX for Python. ``blocking``: progress until the close is carried out
    (up to 10 x 10 ms), so that the peer hears of it even if this worker is never
    progressed again."""
    try:
        if ep.alive:
            if blocking:
                ep.close_blocking(period=10_000_000, max_attempts=10)
            else:
                ep.close()
    except Exception:
        logger.debug("closing a UCX endpoint", exc_info=True)


# -- the trainer's end -------------------------------------------------------------------------
class _Sent:
    """One message's send requests and the buffers they read: ``done`` once UCX reads none
    of them any more: sent, failed, or their connection is gone (UCX may leave a request
    on a failed connection incomplete; it reads nothing more from it, and the buffers stay
    referenced here in any case)."""

    __slots__ = ("reqs", "bufs", "ep")

    def __init__(self, reqs: list, bufs: list, ep: Any) -> None:
        self.reqs, self.bufs, self.ep = reqs, bufs, ep

    @property
    def done(self) -> bool:
        return self.finished or not self.ep.alive

    @property
    def finished(self) -> bool:
        """UCX completed every request (it holds none of the buffers any more)."""
        return all(r.completed for r in self.reqs)


class _Dropped:
    """A message that was never handed to UCX (its channel is broken)."""

    done = True


_DROPPED = _Dropped()
#: sends UCX never completed, kept for the life of the process rather than freed under it
_LEAKED: list = []


class _Channel:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ep: Any = None
        self.out: collections.deque[_Sent] = collections.deque()
        self.broken: str | None = None
        self.dropped = 0


class UcxDataSender:
    """A :class:`~shadow.transport.send.DataSender` over UCX: one connection per worker,
    driven by UCX's progress thread (it sleeps on UCX's event file descriptor). ``hwm``:
    messages in flight per worker before :meth:`send` waits (as a ZeroMQ send blocks at its
    high-water mark); a connection that fails frees what it held at once. ``endpoints``:
    ``ucx://host:port`` per worker, or "" for a worker not reached over UCX."""

    def __init__(self, endpoints: Sequence[str], hwm: int, curve: Sequence[bool] | None = None) -> None:
        if curve is not None and any(c for c, ep in zip(curve, endpoints, strict=False) if ep):
            raise ValueError(
                "a worker's data socket takes CURVE, which UCX does not carry: stream over UCX with "
                "security.data=mac (frames under MACs) or keep transport.data=zmq"
            )
        self.L = lib()
        self.hwm = max(1, hwm)
        self.ctx = _context(self.L)
        # requests are handed to the progress thread, which submits them (delayed submission):
        # calling into UCX from this thread while that one progresses the same worker is a race.
        # It sleeps on UCX's event descriptor for at most 1 ms: waiting for events alone, or
        # 100 ms at a time, stalled a fresh connection's stream for seconds (a connection to
        # a restarted worker delivered 0 or 1 of 9 messages); 1 ms costs an idle thread ~1000
        # wake-ups a second, and a polling thread would take a core
        self.worker = self.L.UCXWorker(self.ctx, enable_delayed_submission=True)
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=1)
        self.chans: list[_Channel | None] = [None] * len(endpoints)
        self._orphans: list[_Sent] = []  # sends of closed connections UCX has not let go of yet
        open_each(self, endpoints)

    # -- DataSender ------------------------------------------------------------------------------
    def send(self, worker: int, frames: Sequence, track: bool) -> Any:
        ch = self.chans[worker] if 0 <= worker < len(self.chans) else None
        if ch is None:
            raise ValueError(f"no channel to shadow worker {worker}: it was dropped and not opened again")
        self._reap(ch)
        while len(ch.out) >= self.hwm and ch.broken is None:
            time.sleep(0.0002)
            self._reap(ch)
        if ch.broken is not None:  # until open() gives this worker a channel again (a resync, a replica_in)
            if not ch.dropped:
                logger.warning(
                    "shadow worker %d: %s; its messages are dropped until it is reached again", worker, ch.broken
                )
            ch.dropped += 1
            return _DROPPED if track else None
        bufs = [_as_bytes(f) if track else np.frombuffer(bytes(f), dtype=np.uint8) for f in frames]
        head = bytearray(PREAMBLE.pack(MAGIC, len(bufs), sum(b.nbytes for b in bufs)))
        for b in bufs:
            head += SIZE.pack(b.nbytes)
        pre = np.frombuffer(bytes(head), dtype=np.uint8)
        reqs = [ch.ep.stream_send(_array(pre))]
        reqs += [ch.ep.stream_send(_array(b)) for b in bufs if b.nbytes]
        sent = _Sent(reqs, [pre, *bufs], ch.ep)
        ch.out.append(sent)
        return sent if track else None

    def open(self, worker: int, endpoint: str, curve: bool | None = None) -> None:
        if curve:
            raise ValueError(f"shadow worker {worker} takes CURVE on its data socket, which UCX does not carry")
        parse(endpoint)
        self.drop(worker)
        ch = _Channel(endpoint)
        self.chans[worker] = ch
        self._connect(worker, ch)

    def drop(self, worker: int) -> None:
        ch, self.chans[worker] = self.chans[worker], None
        if ch is not None:
            self._close_ep(ch)

    def close(self) -> None:
        for w in range(len(self.chans)):
            self.drop(w)
        try:
            self.worker.stop_progress_thread()
        except Exception:  # already stopped, or never started
            logger.debug("stopping UCX's progress thread", exc_info=True)
        deadline = time.monotonic() + 1.0  # cancelled sends complete as UCX carries out the closes
        while self._orphans and time.monotonic() < deadline:
            self.worker.progress_once()
            self._orphans = [sent for sent in self._orphans if not sent.finished]
        if self._orphans:  # held for good: UCX may still read them
            _LEAKED.extend(self._orphans)
            logger.warning("%d UCX sends never completed after their connections closed", len(self._orphans))
            self._orphans = []

    # -- connections -----------------------------------------------------------------------------
    def _connect(self, worker: int, ch: _Channel) -> None:
        host, port = parse(ch.endpoint)
        ch.broken = None
        try:
            ep = self.L.UCXEndpoint.create(self.worker, host, port, True)
        except Exception as exc:  # UCX refuses the address at once (most failures come later, as errors)
            ch.broken = f"cannot connect to {ch.endpoint}: {exc}"
            logger.warning("shadow worker %d: %s", worker, ch.broken)
            return
        # no close callback: UCX would call it on its progress thread, which then waits for the GIL
        # while holding the worker's lock, and a send on this thread waits for that lock
        ch.ep = ep

    def _check_alive(self, ch: _Channel) -> None:
        if ch.broken is None and (ch.ep is None or not ch.ep.alive):
            ch.broken = f"the UCX connection to {ch.endpoint} closed"

    def _reap(self, ch: _Channel) -> None:
        if self._orphans:
            self._orphans = [sent for sent in self._orphans if not sent.finished]
        while ch.out and ch.out[0].done:
            sent = ch.out.popleft()
            if not sent.finished:  # its connection is gone; UCX may still hold the buffers
                self._orphans.append(sent)
            for r in sent.reqs:
                if not r.completed:
                    break
                try:
                    r.check_error()
                except Exception as exc:
                    if ch.broken is None:
                        ch.broken = f"a send to {ch.endpoint} failed: {exc}"
                    break
        self._check_alive(ch)

    def _close_ep(self, ch: _Channel) -> None:
        ep, ch.ep = ch.ep, None
        if ep is not None:
            _close_endpoint(ep)
        # whatever was in flight is cancelled; what UCX has not let go of is kept until it does
        self._orphans.extend(sent for sent in ch.out if not sent.finished)
        ch.out.clear()


from shadow.transport.ucx_socket import UcxDataSocket  # noqa: E402  (the worker's end; it imports this module)

__all__ = ["UcxDataSender", "UcxDataSocket", "available", "endpoint", "is_ucx", "lib", "parse"]
