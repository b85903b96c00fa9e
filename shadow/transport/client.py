"""Request/reply to the coordinator with a bounded wait."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

import zmq

from shadow.config.tuning import DEFAULT, Tuning
from shadow.core.errors import ShadowConnectionError
from shadow.wire import messages as M

logger = logging.getLogger(__name__)


def check_address(address: str) -> None:
    if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(
            f"coordinator address {address!r} is not a ZeroMQ endpoint; expected e.g. tcp://127.0.0.1:5555"
        )


class LogWaiting:
    """An ``interim`` for :func:`request`: logs, every few seconds, that ``who`` is waiting
    for a cluster whose workers are still starting."""

    EVERY_S = 5.0

    def __init__(self, who: str, address: str) -> None:
        self.who, self.address, self.t0, self.next = who, address, time.monotonic(), 0.0
        self.heard = False  # a ``waiting`` came: the coordinator holds the request

    def __call__(self, msg: dict) -> None:
        self.heard = True
        now = time.monotonic()
        if now >= self.next:
            self.next = now + self.EVERY_S
            if msg.get("reason"):
                logger.warning("%s: attach held for %.0f s: %s", self.who, now - self.t0, msg["reason"])
                return
            logger.info(
                "%s: waiting for %d of %d workers of the shadow cluster at %s (%d ready, %d starting: "
                "compiling their kernels) for %.0f s",
                self.who,
                msg["expected"] - msg["ready"],
                msg["expected"],
                self.address,
                msg["ready"],
                msg["starting"],
                now - self.t0,
            )


def request(
    sock: zmq.Socket,
    address: str,
    payload: bytes,
    timeout: float,
    expect: tuple[str, ...],
    interim: Callable[[dict], None] | None = None,
) -> dict:
    """Send ``payload`` and wait up to ``timeout`` seconds for one of ``expect``.

    ``interim`` receives the ``waiting`` notices a coordinator sends while it holds the
    request (its workers are still starting) and is called about once a second meanwhile
    with the newest one; the total wait stays bounded by ``timeout``."""
    sock.send(payload)
    deadline = time.monotonic() + timeout
    last: dict | None = None
    while True:
        left = deadline - time.monotonic()
        if left > 0 and not sock.poll(int(min(left, 1.0) * 1000)):
            if last is not None and interim is not None:  # (last is set only when interim is)
                interim(last)
            continue
        if left <= 0 and not sock.poll(0):  # (a reply that came while this thread did not run is taken)
            if last is not None and last.get("reason"):
                raise ShadowConnectionError(
                    f"shadow coordinator at {address} held this request for {timeout:.0f} s "
                    f"(SHADOW_CONNECT_TIMEOUT_S): {last['reason']}"
                )
            if last is not None:
                raise ShadowConnectionError(
                    f"shadow coordinator at {address}: {last['ready']} of {last['expected']} workers were ready "
                    f"after {timeout:.0f} s ({last['starting']} still starting); check the worker logs, or allow "
                    "longer with SHADOW_CONNECT_TIMEOUT_S"
                )
            raise _silent(address, timeout)
        msg = M.decode(sock.recv())
        if msg["t"] == "waiting" and interim is not None:
            last = msg
            interim(msg)
            continue
        return _answer(msg, address, expect)


#: a host a ``moved`` reply may name: a DNS name, an IPv4 or an IPv6 address
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-_]{0,252}|\[?[0-9A-Fa-f:.]{2,45}\]?")


def moved_to(address: str, msg: dict) -> str:
    """Where a shared cluster's front at ``address`` sent this request on to (its ``moved``
    reply): the port it names, on the host this client reached the front at (a job's
    coordinator beside the front: whatever name or address reaches the front reaches it, a
    DNS name, a Kubernetes Service, a bind to every interface), or on the host the reply
    names (``host``: a job an agent runs on another host). ``ShadowConnectionError`` for
    anything else."""
    host = address.rsplit(":", 1)[0] if address.startswith("tcp://") else None
    other = msg.get("host")
    if host is not None and other:
        if not isinstance(other, str) or not _HOST.fullmatch(other):
            raise ShadowConnectionError(
                f"shadow cluster at {address} sent job {msg['job']!r} on to host {other!r}, which is not a host "
                "name or address"
            )
        host = "tcp://" + (f"[{other}]" if ":" in other and not other.startswith("[") else other)
    port = str(msg["to"]).rsplit(":", 1)[-1]
    if host is None or not port.isdigit() or not 0 < int(port) < 65536:
        raise ShadowConnectionError(
            f"shadow cluster at {address} sent job {msg['job']!r} on to {msg['to']!r}, which this client cannot "
            "follow (a shared cluster is reached over tcp://, and names a port of its own host)"
        )
    logger.debug("job %r is served on port %s of the shared cluster at %s", msg["job"], port, address)
    return f"{host}:{port}"


def _answer(msg: dict, address: str, expect: tuple[str, ...]) -> dict:
    """``msg`` if it is one of ``expect``; an ``error`` (or any other reply) raises."""
    if msg["t"] == "error":
        raise ShadowConnectionError(f"shadow coordinator at {address}: {msg['message']}")
    if msg["t"] not in expect:
        raise ShadowConnectionError(f"unexpected {msg['t']!r} reply from {address}")
    return msg


def _silent(address: str, timeout: float) -> ShadowConnectionError:
    return ShadowConnectionError(
        f"no shadow coordinator answered at {address} within {timeout:.0f} s; "
        "start one with `shadow cluster workers=N port=P` or fix the address (a cluster with CURVE "
        "security answers only clients with an allowed key: SHADOW_CURVE_SERVER_KEY / SHADOW_CURVE_CLIENT_KEY "
        "or security.server_public / security.client_key)"
    )


#: connections :func:`ask` tries in all: a new one after each ``timeout / ASK_TRIES`` seconds without a reply
ASK_TRIES = 3


def ask(
    address: str,
    payload: bytes,
    timeout: float,
    expect: tuple[str, ...],
    tuning: Tuning = DEFAULT,
    keys=None,
    follow: bool = True,
) -> dict:
    """A read-only query (``status``, ``restore_info``, ``catalog``, ``jobs``: asking twice
    changes nothing) to the coordinator at ``address``, on a connection of its own, with
    up to ``timeout`` seconds for the reply. After each ``timeout / ASK_TRIES`` seconds
    without one, the query is sent again on a new connection (a new handshake); the
    earlier connections stay open and the first reply on any of them is taken. A connection
    whose handshake stalled or whose reply was lost then costs a part of the wait, not all
    of it; a coordinator that answers no one still fails after ``timeout``. ``keys``: as
    :func:`dealer`'s (default: this process's). A shared cluster's front that answers
    ``moved`` (the job is served by its own coordinator) is followed once (``follow``), within
    the same wait."""
    ctx: zmq.Context = zmq.Context.instance()
    deadline = time.monotonic() + timeout
    socks: list[zmq.Socket] = []
    poller = zmq.Poller()
    try:
        for attempt in range(ASK_TRIES):
            if attempt:
                logger.info(
                    "no answer from the shadow coordinator at %s in %.1f s; asking again on a new connection "
                    "(%d of %d)",
                    address,
                    timeout - (deadline - time.monotonic()),
                    attempt + 1,
                    ASK_TRIES,
                )
            sock = dealer(ctx, address, keys, tuning)
            socks.append(sock)
            poller.register(sock, zmq.POLLIN)
            sock.send(payload)
            last = attempt == ASK_TRIES - 1
            until = deadline if last else min(deadline, time.monotonic() + timeout / ASK_TRIES)
            while True:
                left = until - time.monotonic()
                ready = poller.poll(int(max(0.0, min(left, 1.0)) * 1000))  # the last look after the time is up too
                for s, _ in ready:
                    msg = M.decode(s.recv())
                    if msg["t"] == "moved" and follow:  # a shared cluster's front: once, in what is left of the wait
                        to = moved_to(address, msg)
                        return ask(to, payload, max(1.0, deadline - time.monotonic()), expect, tuning, keys, False)
                    if msg["t"] != "waiting":
                        return _answer(msg, address, expect)
                if left <= 0:
                    break
        raise _silent(address, timeout)
    finally:
        for s in socks:
            s.close(linger=0)


def dealer(
    ctx: zmq.Context,
    address: str,
    keys=None,
    tuning: Tuning = DEFAULT,
    rcvhwm: int | None = None,
    curve: bool = True,
    door=None,
) -> zmq.Socket:
    """A DEALER connected to ``address``, receiving what a service answers within
    ``tuning``'s limits; a CURVE client when ``keys`` (default: this process's keys,
    :func:`shadow.security.current_client`) are set, unless ``curve`` is False (a worker's
    serve socket in mac mode), then through its door with ``door`` (a
    :class:`~shadow.security.Door`, when given). ``rcvhwm``: see
    :meth:`shadow.transport.SocketFactory.dealer`."""
    from shadow.transport import SocketFactory, fetch_limit

    check_address(address)
    if not curve:
        factory = SocketFactory(ctx, keys=door)
    else:
        factory = SocketFactory(ctx) if keys is None else SocketFactory(ctx, keys=keys)
    return factory.dealer(address, fetch_limit(tuning), rcvhwm=rcvhwm)
