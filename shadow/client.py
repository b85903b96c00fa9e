"""Request/reply to the coordinator with a bounded wait."""
from __future__ import annotations

import zmq

from shadow.errors import ShadowConnectionError
from shadow.wire import messages as M


def check_address(address: str) -> None:
    if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"coordinator address {address!r} is not a ZeroMQ endpoint; expected e.g. tcp://127.0.0.1:5555")


def request(sock: zmq.Socket, address: str, payload: bytes, timeout: float, expect: tuple[str, ...]) -> dict:
    """Send ``payload`` and wait up to ``timeout`` seconds for one of ``expect``."""
    sock.send(payload)
    if not sock.poll(timeout * 1000):
        raise ShadowConnectionError(
            f"no shadow coordinator answered at {address} within {timeout:.0f} s; "
            "start one with `shadow cluster workers=N port=P` or fix the address (a cluster with CURVE "
            "security answers only clients with an allowed key: SHADOW_CURVE_SERVER_KEY / SHADOW_CURVE_CLIENT_KEY "
            "or security.server_public / security.client_key)")
    msg = M.decode(sock.recv())
    if msg["t"] == "error":
        raise ShadowConnectionError(f"shadow coordinator at {address}: {msg['message']}")
    if msg["t"] not in expect:
        raise ShadowConnectionError(f"unexpected {msg['t']!r} reply from {address}")
    return msg


def dealer(ctx: zmq.Context, address: str, keys=None) -> zmq.Socket:
    """A DEALER connected to ``address``; a CURVE client when ``keys`` (default: this
    process's keys, :func:`shadow.security.current_client`) are set."""
    from shadow import security

    check_address(address)
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    keys = keys if keys is not None else security.current_client()
    if keys is not None:
        keys.apply(s)
    s.connect(address)
    return s
