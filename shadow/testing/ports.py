"""Free TCP ports on 127.0.0.1 (free when asked: a caller binds them soon after)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """A port ``p`` with ``p .. p + n - 1`` all free now (a cluster's workers serve their
    metrics on the ports after the coordinator's)."""
    for _ in range(200):
        base = free_port()
        held = []
        try:
            for p in range(base + 1, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")
