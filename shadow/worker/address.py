"""Which of this host's addresses a worker binds and advertises, so that a worker joins a
cluster by the coordinator's address alone."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def route_address(endpoint: str) -> str:
    """The local IPv4 address the kernel routes to ``endpoint`` (``tcp://host:port``): the
    interface the coordinator -- and so, on a flat network, the trainers -- reach us on.
    No packet is sent (a UDP socket's ``connect`` only picks the route)."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname:
        raise ValueError(f"host=auto needs a tcp:// coordinator address, got {endpoint!r}; give host= explicitly")
    try:
        target = socket.gethostbyname(parts.hostname)
    except OSError as exc:
        raise ValueError(f"cannot resolve the coordinator host {parts.hostname!r}: {exc}") from None
    if target.startswith("127."):
        return target  # a coordinator on a loopback address: serve on the same one
    if target == "0.0.0.0":  # a coordinator on every interface of this host: the address others reach it on
        return primary_address()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, parts.port or 9))
        except OSError as exc:
            raise ValueError(f"no route to the coordinator at {target}: {exc}; give host= explicitly") from None
        return s.getsockname()[0]


def primary_address() -> str:
    """This host's address on its default route (no packet is sent), or its hostname's
    address, or loopback on a host without a network."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))
            return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def bind_and_advertise(host: str, coordinator: str) -> tuple[str, str]:
    """``(interface to bind, address to tell peers)`` for a worker's ``host`` setting:
    ``auto`` binds and advertises the route to the coordinator; a wildcard (``0.0.0.0``,
    ``*``) binds every interface and advertises that route."""
    if host == "auto":
        addr = route_address(coordinator)
        return addr, addr
    if host in ("0.0.0.0", "*"):
        return "0.0.0.0", route_address(coordinator)
    return host, host


class Binding:
    """Where a worker's server sockets (data, serve) bind, and the address it advertises for
    them: ``bind_host`` and ``host`` from :func:`bind_and_advertise`."""

    def __init__(self, bind_host: str, host: str) -> None:
        self.bind_host, self.host = bind_host, host

    def bind(self, sock) -> str:
        """Bind ``sock`` to a random port of the bind host; returns the endpoint peers connect to."""
        port = sock.bind_to_random_port(f"tcp://{self.bind_host}")
        return f"tcp://{self.host}:{port}"
