"""Request/reply to the coordinator with a bounded wait."""

from __future__ import annotations

import logging
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
        if left <= 0:
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
            raise ShadowConnectionError(
                f"no shadow coordinator answered at {address} within {timeout:.0f} s; "
                "start one with `shadow cluster workers=N port=P` or fix the address (a cluster with CURVE "
                "security answers only clients with an allowed key: SHADOW_CURVE_SERVER_KEY / SHADOW_CURVE_CLIENT_KEY "
                "or security.server_public / security.client_key)"
            )
        msg = M.decode(sock.recv())
        if msg["t"] == "waiting" and interim is not None:
            last = msg
            interim(msg)
            continue
        if msg["t"] == "error":
            raise ShadowConnectionError(f"shadow coordinator at {address}: {msg['message']}")
        if msg["t"] not in expect:
            raise ShadowConnectionError(f"unexpected {msg['t']!r} reply from {address}")
        return msg


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
