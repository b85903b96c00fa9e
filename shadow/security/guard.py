"""The ZAP guard of one process's server sockets: CURVE keys admitted with their roles, and
the doors of sockets in clear (:mod:`shadow.security.doors`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import zmq
from zmq.utils.monitor import parse_monitor_message

from shadow.config.choices import ROLES
from shadow.security.doors import DOOR_DOMAIN, DOOR_WAIT_S, TEMPORARY
from shadow.security.keys import _z85, load_peers, load_secret

if TYPE_CHECKING:
    from shadow.config.security import SecurityConfig

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"shadow"  # a socket's ZAP domain: b"shadow:" and the roles it admits, comma-separated
_POLL_MS = 100
# handshake failures never reach ZAP; the server socket's monitor reports them
_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
# a door's monitor also follows its connections (ACCEPTED and DISCONNECTED carry the descriptor)
_DOOR_EVENTS = _HANDSHAKE_EVENTS | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_PROTOCOL_REASONS: dict[int, str] = {  # by the monitor event's value
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "handshake_mechanism",  # client without CURVE
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "handshake_crypto",  # client with a wrong server key
}


class Guard:
    """Authenticates CURVE clients for the server sockets of one process, each with its role.

    Call order: 1. ``start(ctx)`` binds a ZAP handler on the context and starts the guard
    thread; 2. ``server(sock, roles)`` on each server socket before it binds; 3. ``stop()``
    after the server sockets are closed (joins the thread within ``timeout`` seconds).
    ``allow`` maps a role to the directory (or key file) of its public keys.
    ``accepted`` counts admitted handshakes; ``refused`` maps a reason to a count:
    ``unknown_key`` (CURVE client in no allow list), ``role_<role>`` (a key of a role the
    socket does not take: e.g. a client's at a worker's data socket), ``mechanism`` (a
    non-CURVE ZAP request), ``handshake_mechanism`` (client without CURVE),
    ``handshake_crypto`` (client with a wrong server key) and ``handshake`` (any other
    failed handshake).

    A socket in clear (``mac`` mode's data, serve and files sockets) can take a *door*
    (:meth:`door`): ZeroMQ's PLAIN mechanism, whose credential (a user name and a password
    derived from a key the peer was handed over CURVE, :class:`Door`) the guard checks with
    the socket's own function before the connection carries a single message. The stream
    stays in clear; a stranger's connection is closed at the handshake, before any of its
    bytes reach a buffer. Its refusals count as ``door_<reason>`` (``door_mechanism``: a
    peer without the PLAIN mechanism, e.g. one in clear).
    """

    def __init__(
        self, server_key: str | os.PathLike | None, allow: Mapping[str, str | os.PathLike] | None = None
    ) -> None:
        """``server_key`` None: a guard of doors only (:func:`doorkeeper`), no CURVE socket."""
        self.public, self.secret = load_secret(server_key) if server_key is not None else (b"", b"")
        self.peers = load_peers(allow or {})  # the server's own pair is no one's key: every peer brings its own
        self.accepted = 0
        self.refused: dict[str, int] = {}
        self._ctx: zmq.Context | None = None
        self._zap: zmq.Socket | None = None
        self._monitors: list[zmq.Socket] = []
        self._doors: dict[bytes, Callable[[bytes, bytes], str]] = {}  # by ZAP domain: the door's check
        self._caps: dict[bytes, Callable[[], int]] = {}  # by ZAP domain: the most connections it holds
        self._open: dict[bytes, set[int]] = {}  # by ZAP domain: the descriptors of its open connections
        self._domain_of: dict[zmq.Socket, bytes] = {}  # a door's monitor -> its domain
        self._held: list[tuple[float, tuple]] = []  # door handshakes held for a temporary reason: (until, request)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, ctx: zmq.Context) -> None:
        if self._thread is not None:
            if ctx is not self._ctx:
                raise RuntimeError("a Guard serves one zmq.Context (ZAP handlers are per context)")
            return
        zap = ctx.socket(zmq.ROUTER)
        zap.setsockopt(zmq.LINGER, 0)
        try:
            zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            zap.close(linger=0)
            raise RuntimeError(
                f"cannot bind the ZAP handler at {ZAP_ENDPOINT} ({exc}); one Guard per zmq.Context"
            ) from None
        self._ctx, self._zap = ctx, zap
        self._thread = threading.Thread(target=self._run, name="shadow-zap", daemon=True)
        self._thread.start()
        with _doorkeepers_lock:  # the context's one ZAP handler checks the doors of its sockets too
            _doorkeepers[id(ctx)] = (ctx, self)

    def server(self, sock: zmq.Socket, roles: tuple[str, ...] = ROLES) -> None:
        """Make ``sock`` a CURVE server checked by this guard, admitting the keys of ``roles``;
        call before ``bind``."""
        if not self.public:
            raise ValueError("a guard of doors only has no server key: it makes no CURVE socket")
        unknown = sorted(set(roles) - set(ROLES))
        if unknown or not roles:
            raise ValueError(f"roles {list(roles)} must be some of {ROLES}")
        self.start(sock.context)
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = DOMAIN + b":" + ",".join(roles).encode()
        try:  # without it libzmq admits every client with the server key once no ZAP handler is bound
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        except zmq.ZMQError:
            logger.warning(
                "this libzmq lacks ZAP_ENFORCE_DOMAIN: after Guard.stop() the socket admits any CURVE "
                "client that knows the server key; close server sockets before stopping the guard"
            )
        monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        with self._lock:
            self._monitors.append(monitor)

    def door(
        self, sock: zmq.Socket, check: Callable[[bytes, bytes], str], cap: Callable[[], int] | None = None
    ) -> None:
        """Make ``sock`` (in clear, not bound yet) admit only peers whose PLAIN credential
        ``check(user, password)`` accepts: it returns "" to admit, else a short reason
        (counted as ``door_<reason>``). It runs on the guard's thread, once per handshake;
        it must be quick and only read what the socket's owner writes. ``cap()``: the most
        connections the socket holds, those still in their handshake included; a peer that
        would pass it is refused (``door_crowded``) whatever its credential."""
        self.start(sock.context)
        with self._lock:
            domain = DOOR_DOMAIN + b":%d" % len(self._doors)
            self._doors[domain] = check
            self._open[domain] = set()
            if cap is not None:
                self._caps[domain] = cap
        sock.plain_server = True
        sock.zap_domain = domain
        try:
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        except zmq.ZMQError:
            logger.warning("this libzmq lacks ZAP_ENFORCE_DOMAIN: a door admits anyone once the guard stops")
        monitor = sock.get_monitor_socket(_DOOR_EVENTS)
        with self._lock:
            self._domain_of[monitor] = domain
            self._monitors.append(monitor)

    def connections(self, sock_domain: bytes) -> int:
        """Open connections of the door whose ZAP domain is ``sock_domain``, as its monitor
        has told them (those in their handshake included)."""
        return len(self._open.get(sock_domain, ()))

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        with _doorkeepers_lock:
            if self._ctx is not None and _doorkeepers.get(id(self._ctx), (None, None))[1] is self:
                del _doorkeepers[id(self._ctx)]
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("CURVE guard thread did not stop within %.1f s", timeout)

    def _refuse(self, reason: str, peer: str, key: str) -> None:
        n = self.refused[reason] = self.refused.get(reason, 0) + 1
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood of strangers does not flood the log
            logger.warning("refused connection from %s (key %s): %s (%d so far)", peer, key, reason, n)

    def _run(self) -> None:
        zap = self._zap
        if zap is None:
            raise RuntimeError("the guard thread needs the ZAP socket: Guard.start opens it first")
        poller = zmq.Poller()
        polled: set[zmq.Socket] = set()  # the monitors registered with the poller
        poller.register(zap, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                with self._lock:
                    monitors = set(self._monitors)
                for m in monitors - polled:
                    poller.register(m, zmq.POLLIN)
                    polled.add(m)
                if self._held:
                    self._recheck()
                for sock, _ in poller.poll(_POLL_MS):
                    if sock is zap:
                        self._answer_safely(zap.recv_multipart())
                    elif not self._handshake(sock):
                        poller.unregister(sock)
                        polled.discard(sock)
                        with self._lock:
                            self._monitors.remove(sock)
                        sock.close(linger=0)
        except Exception:  # never raise from a background thread; with ZAP_ENFORCE_DOMAIN this fails closed
            logger.exception("CURVE guard thread failed; new connections will not be admitted")
        finally:
            zap.close(linger=0)
            with self._lock:
                for m in self._monitors:
                    m.close(linger=0)
                self._monitors.clear()

    def _answer_safely(self, frames: list[bytes]) -> None:
        try:
            self._answer(frames)
        except (IndexError, UnicodeError, ValueError):  # one bad request must not take the guard down
            logger.exception("cannot answer a ZAP request of %d frames; ignored", len(frames))

    def _answer(self, frames: list[bytes]) -> None:
        # ROUTER envelope, then: version, request id, domain, address, identity, mechanism, credentials
        envelope, request = frames[:2], frames[2:]
        if len(request) < 6 or request[0] != b"1.0":
            logger.warning("malformed ZAP request (%d frames); ignored", len(request))
            return
        request_id, domain, address = request[1], request[2], request[3].decode(errors="replace")
        mechanism, creds = request[5], request[6:]
        if domain.startswith(DOOR_DOMAIN + b":"):
            self._open_door(envelope, request_id, domain, address, mechanism, creds)
            return
        key = _z85(creds[0]) if mechanism == b"CURVE" and creds else "-"
        takes = domain.partition(b":")[2].decode(errors="replace").split(",")
        peer = self.peers.get(key.encode())
        role = peer.role if peer is not None else None
        if mechanism != b"CURVE":
            reason = "mechanism"
        elif role is None:
            reason = "unknown_key"
        elif role not in takes:
            reason = "role_" + role
        else:
            reason = ""
        if reason:
            self._refuse(reason, address, key)
            reply = [b"400", reason.encode(), b""]
        else:
            self.accepted += 1
            assert peer is not None
            logger.debug("admitted %s (key %s) as %s", address, key, peer.user_id().decode())
            reply = [b"200", b"OK", peer.user_id()]
        assert self._zap is not None  # requests come in on it (the guard thread's)
        self._zap.send_multipart([*envelope, b"1.0", request_id, *reply, b""])

    def _recheck(self) -> None:
        """Check each held door handshake again: answered once it passes or its time is up."""
        held, self._held = self._held, []
        now = time.monotonic()
        for until, request in held:
            envelope, request_id, domain, address, mechanism, creds = request
            self._open_door(envelope, request_id, domain, address, mechanism, creds, final=now >= until, until=until)

    def _open_door(
        self,
        envelope: list[bytes],
        request_id: bytes,
        domain: bytes,
        address: str,
        mechanism: bytes,
        creds,
        final: bool = False,
        until: float | None = None,
    ) -> None:
        check, cap = self._doors.get(domain), self._caps.get(domain)
        if mechanism != b"PLAIN" or len(creds) != 2:
            reason = "mechanism"
        elif check is None:
            reason = "closed"
        elif cap is not None and len(self._open.get(domain, ())) > cap():  # this one is among them
            reason = "crowded"
        else:
            try:
                reason = check(bytes(creds[0]), bytes(creds[1]))
            except Exception:  # a check that fails admits no one
                logger.exception("a door's check failed; the connection is refused")
                reason = "failed"
        user = bytes(creds[0][:64]).decode(errors="replace") if creds else "-"
        if reason in TEMPORARY and not final:  # held: the worker may be configured, a connection go
            request = (envelope, request_id, domain, address, mechanism, creds)
            self._held.append((until if until is not None else time.monotonic() + DOOR_WAIT_S, request))
            return
        if reason:
            self._refuse("door_" + reason, address, user)
            # 300 (temporary) closes the connection without an ERROR, and the peer's ZeroMQ
            # connects again; 400 makes it give up for good (libzmq never reconnects after it)
            reply = [b"300" if reason in TEMPORARY else b"400", reason.encode(), b""]
        else:
            self.accepted += 1
            reply = [b"200", b"OK", b"door"]
        assert self._zap is not None
        self._zap.send_multipart([*envelope, b"1.0", request_id, *reply, b""])

    def _handshake(self, monitor: zmq.Socket) -> bool:
        """Count one monitor event; False once the monitored socket has closed."""
        event = parse_monitor_message(monitor.recv_multipart())
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:
            return False
        if event["event"] in (zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED):  # a door's connections
            open_ = self._open.get(self._domain_of.get(monitor, b""))
            if open_ is not None:
                (open_.add if event["event"] == zmq.EVENT_ACCEPTED else open_.discard)(int(event["value"]))
            return True
        reason = "handshake"
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            reason = _PROTOCOL_REASONS.get(event["value"], "handshake")
        # libzmq's v1 monitor names the bound endpoint, not the peer
        self._refuse(reason, f"a peer of {event['endpoint'].decode(errors='replace')}", "unknown")
        return True


_doorkeepers: dict[int, tuple[zmq.Context, Guard]] = {}
_doorkeepers_lock = threading.Lock()


def doorkeeper(ctx: zmq.Context) -> Guard:
    """The guard that checks the doors of ``ctx``'s sockets in clear built without a guard of
    their own (a service's parts built on their own, as in tests and benchmarks): the guard
    already started on ``ctx`` (a context has one ZAP handler), else a guard of doors only,
    made and started on first use."""
    with _doorkeepers_lock:
        held = _doorkeepers.get(id(ctx))
        if held is not None and held[0] is ctx and not held[1]._stopping.is_set():
            return held[1]
    guard = Guard(None)
    guard.start(ctx)  # registers itself (a guard started on ctx meanwhile: start raises)
    with _doorkeepers_lock:
        return _doorkeepers[id(ctx)][1]


def guard_from_config(cfg: SecurityConfig) -> Guard | None:
    """A Guard for ``security.server_key`` and the ``allow_<role>s`` lists; None when CURVE is off."""
    return Guard(cfg.server_key, cfg.allow()) if cfg.server_key else None
