"""A stranger with no key at a service's ZeroMQ sockets, speaking ZMTP 3.0 by hand (the
NULL mechanism's greeting and READY, then frames): what any ZeroMQ peer without keys sends,
from a raw socket so that one process can hold thousands of connections. For tests and
benchmarks of what such a peer costs a service; 127.0.0.1 only."""

from __future__ import annotations

import subprocess
import sys

# ``conns`` greeted connections held, then ``total`` bytes of one unfinished message (frames
# of ``frame`` bytes, never the last) on the first; ``churn``: new connections greeted and
# dropped without pause, until killed. Prints "sent N" once it has sent what it could.
STRANGER = r"""
import socket, struct, sys, time
host, kind, mode = sys.argv[1], sys.argv[3], sys.argv[7]
port, frame, total, conns = (int(a) for a in sys.argv[2:3] + sys.argv[4:7])
hello = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)
body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(kind)) + kind.encode()
hello += bytes([0x04, len(body)]) + body
held, sent = [], 0
for _ in range(conns):
    s = socket.create_connection((host, port))
    try:
        s.sendall(hello)
    except OSError:
        pass
    held.append(s)
if total:
    s = held[0]
    s.settimeout(5.0)
    chunk, head = b"\0" * frame, bytes([0x03]) + struct.pack(">Q", frame)
    try:
        while sent < total:
            s.sendall(head + chunk)
            sent += frame
    except OSError:
        pass
print(f"sent {sent}", flush=True)
while mode == "churn":
    try:
        s = socket.create_connection((host, port))
        s.sendall(hello)
        s.close()
    except OSError:
        time.sleep(0.01)
time.sleep(3600)
"""


def attack(endpoint: str, kind: str, frame: int, total: int, conns: int = 1, mode: str = "hold") -> subprocess.Popen:
    """Start a stranger at ``endpoint`` (``tcp://host:port``) posing as a ZeroMQ ``kind``
    (``PUSH``, ``DEALER``); read its stdout's first line ("sent N") to know it has sent what
    it could; kill it to stop it."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    argv = [sys.executable, "-c", STRANGER, host, port, kind, str(frame), str(total), str(conns), mode]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
