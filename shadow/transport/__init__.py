"""How shadow's bytes move: :mod:`shadow.transport.sockets` is the one place where a ZeroMQ
socket gets its options (linger, high-water marks, the largest message a peer may send,
CURVE on either side)."""

from shadow.transport.sockets import SocketFactory, data_limit, fetch_limit

__all__ = ["SocketFactory", "data_limit", "fetch_limit"]
