"""What both ends of the UCX data path (``shadow.transport.ucx``) share: the framing on the
stream and the handshake's words, loading UCX for Python, endpoints, and the requests UCX
may still read or write after their connection is gone, held until it lets go of them."""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from shadow.core.errors import ShadowError

logger = logging.getLogger("shadow.transport.ucx")

SCHEME = "ucx"
MAGIC = b"SHU1"
#: magic, frame count, total bytes of the frames
PREAMBLE = struct.Struct("<4sIQ")
SIZE = struct.Struct("<Q")
#: UCX settings this data path changes from UCX's defaults, unless ``UCX_<name>`` is set
DEFAULTS = {"TCP_TX_SEG_SIZE": "1M", "TCP_RX_SEG_SIZE": "1M"}
#: connections a worker holds at once (a trainer rank has one); more are closed at once
MAX_CONNECTIONS = 4096
#: what a worker sends first on each connection it accepts; a trainer sends nothing before
READY = b"SHUR"
#: seconds a trainer waits for a new connection's READY before it connects again
READY_TIMEOUT_S = 5.0
#: the magic of the probe a trainer sends once it has READY: a message like a data message,
#: which the worker answers with ACK instead of handing it on
PROBE = b"SHUP"
ACK = b"SHUA"
#: the probe's two frame sizes: the token's frame, then the door's (:func:`pack_door`). A
#: worker takes nothing else as a connection's first message, and nothing more before the
#: probe proved the door: a stranger costs it this much
PROBE_SIZES = (64, 4096)
_DOOR = struct.Struct("<HH")
#: seconds a trainer waits for its probe's ACK before it connects again
ACK_TIMEOUT_S = 2.0
#: after the probe's ACK, what a worker sends on a connection: how many data messages have
#: reached it whole on that connection (magic, count); the trainer keeps a message until then
ACKED_MAGIC = b"SHUK"
ACKED = struct.Struct("<4sQ")
#: the probe's first frame starts with the trainer's channel token (random, one per channel
#: it opens): a worker that sees a token again reads what the old connection brought first
TOKEN_BYTES = 16
#: connections in a row a trainer makes to a worker that fail before their handshake is
#: done, before it gives up on it (until ``open()``)
CONNECT_ATTEMPTS = 3
#: ready connections in a row a trainer makes again, with no message acknowledged between,
#: before it gives up on the worker (a connection that keeps failing once it is up)
RECONNECTS = 4

INSTALL = "pip install 'shadow-checkpoint[ucx]' (UCX for Python, ucxx)"


def pack_door(user: bytes, password: bytes) -> bytes:
    """The probe's second frame: the user name and password a trainer proves at a worker's
    door (:class:`shadow.security.Door`; both empty without keys), as lengths then bytes."""
    if len(user) > 255 or len(password) > 255:
        raise ValueError("a door's user name and password are at most 255 bytes each")
    return _DOOR.pack(len(user), len(password)) + user + password


def unpack_door(frame) -> tuple[bytes, bytes] | None:
    """What :func:`pack_door` packed into ``frame`` (None: malformed)."""
    raw = bytes(frame[: _DOOR.size + 510])
    if len(raw) < _DOOR.size:
        return None
    nu, np_ = _DOOR.unpack_from(raw)
    if nu > 255 or np_ > 255 or _DOOR.size + nu + np_ > len(raw):
        return None
    return raw[_DOOR.size : _DOOR.size + nu], raw[_DOOR.size + nu : _DOOR.size + nu + np_]


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


def _close_endpoint(ep: Any) -> None:
    """Close a UCX endpoint unless UCX already closed it or is closing it, and wait (up to
    10 x 10 ms) until the close is carried out, so that the peer hears of it even if this
    worker is never progressed again.

    Always the blocking close: UCX for Python's non-blocking one crashes the process (a null
    request) on an endpoint already closing, and ``alive`` still says True then (a close
    under way, or an error callback running on the progress thread). The blocking one
    returns at once on such an endpoint."""
    try:
        if ep.alive:
            ep.close_blocking(period=10_000_000, max_attempts=10)
    except Exception:
        logger.debug("closing a UCX endpoint", exc_info=True)


#: UCX objects of closed data channels, kept so that their destructors never run
_RETIRED: list = []


def _retire(*objs: Any) -> None:
    """Keep ``objs`` alive until the process ends, past interpreter shutdown too (a closed
    worker's data channel: destroying its UCX listener or worker crashed the process)."""
    import ctypes

    for obj in objs:
        if obj is not None:
            _RETIRED.append(obj)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class Pending:
    """UCX requests and the buffers they read or write; ``finished`` once UCX has completed
    every request (it holds none of the buffers any more)."""

    __slots__ = ("reqs", "bufs")

    def __init__(self, reqs: list, bufs: list) -> None:
        self.reqs, self.bufs = reqs, bufs

    @property
    def finished(self) -> bool:
        return all(r.completed for r in self.reqs)


class Held:
    """Requests of connections that closed or failed before UCX completed them. UCX may
    leave such a request incomplete for a while (or for good) and read or write its
    buffers until it completes, so they stay referenced here until then."""

    def __init__(self) -> None:
        self._items: list[Pending] = []

    def add(self, *items: Pending | None) -> None:
        self._items.extend(p for p in items if p is not None and not p.finished)

    def prune(self) -> None:
        if self._items:
            self._items = [p for p in self._items if not p.finished]

    def __len__(self) -> int:
        return len(self._items)

    def settle(self, worker: Any, seconds: float) -> list[Pending]:
        """Progress ``worker`` until it is idle and UCX has let go of everything held, or
        ``seconds`` pass (closed connections' sends and receives complete as UCX carries out
        the closes); what it still holds, no longer held here: the caller keeps it for good."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            busy = worker.progress_once()
            self.prune()
            if not busy and not self._items:
                break
        left, self._items = self._items, []
        return left
