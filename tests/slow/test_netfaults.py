"""Hosts apart: the network fault harness (shadow.testing.netns) does what it says, and the
fault matrix's network scenarios hold on a real keyed cluster spread over namespaces.

Needs root and ``ip netns``; skipped elsewhere with the reason."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from shadow.testing.netns import Network, unavailable
from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")]

SERVE = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000))
s.listen()
while True:
    c, _ = s.accept()
    while c.recv(1 << 16):
        pass
    c.close()
"""

SEND = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
t0 = time.monotonic()
s.sendall(b"x" * int(sys.argv[3]))
s.shutdown(socket.SHUT_WR)
s.recv(1)
print(time.monotonic() - t0)
"""


def _send(net: Network, src: str, dst: str, nbytes: int = 1, timeout: float = 1.5) -> float | None:
    """Seconds to send ``nbytes`` from host ``src`` to ``dst``'s server; None if it could not."""
    cmd = [*net.command(src), sys.executable, "-c", SEND, net.address(dst), str(timeout), str(nbytes)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return float(done.stdout) if done.returncode == 0 else None


def _serving(net: Network, host: str) -> subprocess.Popen:
    p = net.popen(host, [sys.executable, "-c", SERVE])
    deadline = time.monotonic() + 30
    while _send(net, Network.HERE, host) is None:  # the server is up once a send from here lands
        assert p.poll() is None and time.monotonic() < deadline, "the test server did not start"
    return p


def test_cut_isolate_and_cap():
    """A cut drops both ways between its two hosts only; isolation cuts a host from all;
    each heals; a cap slows a host's transfers; nothing is left behind."""
    with Network(["a", "b", "c"]) as net:
        servers = [_serving(net, h) for h in ("b", "c")]
        try:
            assert _send(net, "a", "b") is not None and _send(net, "b", "c") is not None
            net.cut("a", "b")
            assert net.faults["cuts"] == [["a", "b"]]
            assert _send(net, "a", "b") is None  # a silent drop: the connect times out
            assert _send(net, "a", "c") is not None and _send(net, Network.HERE, "b") is not None
            net.heal("a", "b")
            assert _send(net, "a", "b") is not None
            net.cut(Network.HERE, "c")
            assert _send(net, Network.HERE, "c") is None and _send(net, "b", "c") is not None
            net.isolate("b")
            assert _send(net, "a", "b") is None and _send(net, Network.HERE, "b") is None
            assert _send(net, "a", "c") is not None
            net.heal_all()
            assert net.faults == {"cuts": [], "drops": [], "isolated": [], "capped": []}
            assert _send(net, "a", "b", timeout=10) is not None and _send(net, Network.HERE, "c") is not None
            net.cap("b", "8mbit", burst="16kb")
            took = _send(net, "a", "b", 1 << 20, timeout=30)  # 8 Mbit at 8 Mbit/s: about 1 s
            assert took is not None and took > 0.5, took
            net.uncap("b")
        finally:
            for p in servers:
                p.kill()
                p.wait()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.tag not in namespaces
    assert net.bridge not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


UDP_RECV = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 7001))
s.settimeout(float(sys.argv[1]))
print("ready", flush=True)
try:
    s.recvfrom(64)
    print("got")
except socket.timeout:
    print("none")
"""

UDP_SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(30):
    s.sendto(b"x", (sys.argv[1], 7001))
    time.sleep(0.05)
"""


def _datagram(net: Network, src: str, dst: str) -> bool:
    """Whether a datagram from host ``src`` reaches host ``dst`` (one way: nothing comes back)."""
    recv = net.popen(dst, [sys.executable, "-c", UDP_RECV, "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
        subprocess.run([*net.command(src), sys.executable, "-c", UDP_SEND, net.address(dst)], timeout=60, check=True)
        out, _ = recv.communicate(timeout=60)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    return out.strip() == "got"


def test_a_one_way_drop_is_asymmetric():
    """``drop(a, b)``: a's packets to b are lost while b's still reach a; a cut of the same
    pair healed leaves the drop in force; undrop and heal_all restore both ways."""
    with Network(["a", "b"]) as net:
        assert _datagram(net, "a", "b") and _datagram(net, "b", "a")
        net.drop("a", "b")
        assert net.faults["drops"] == [["a", "b"]]
        assert not _datagram(net, "a", "b") and _datagram(net, "b", "a")
        net.cut("a", "b")
        assert not _datagram(net, "b", "a")
        net.heal("a", "b")  # the cut goes; the one-way drop stays
        assert not _datagram(net, "a", "b") and _datagram(net, "b", "a")
        net.undrop("a", "b")
        assert _datagram(net, "a", "b")
        net.drop(Network.HERE, "b")
        assert not _datagram(net, Network.HERE, "b") and _datagram(net, "b", Network.HERE)
        net.heal_all()
        assert net.faults["drops"] == [] and _datagram(net, Network.HERE, "b")


def test_hosts_do_not_reach_each_other_through_loopback():
    """Each host is a network stack of its own: a port bound on one host's loopback is not
    this process's (what lets every service of the matrix use fixed ports)."""
    with Network(["a"]) as net:
        with socket.socket() as s:  # held here; free on host a
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            code = f"import socket; s = socket.socket(); s.bind(('127.0.0.1', {port})); print('bound')"
            done = subprocess.run([*net.command("a"), sys.executable, "-c", code], capture_output=True, text=True)
            assert done.stdout.strip() == "bound", done.stderr


def test_split_brain_scenario(tmp_path):
    """One seeded trial of the fault matrix's split brain (a worker cut off from the
    coordinator while the trainers reach it), strict: training equal to the uninterrupted
    run, every restore (memory and each tier) equal to the trainer's state at its
    iteration, the committed iteration never back, nothing lost, back to streaming within
    the bound. The other network scenarios run in ``tools/fault_matrix.py --scenarios net``."""
    scenario = "net_split_brain"
    out = tmp_path / "report.json"
    cmd = [sys.executable, "tools/fault_matrix.py", "--scenarios", scenario, "--trials", "1", "--strict"]
    done = subprocess.run(
        [*cmd, "--json", str(out), "--workdir", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (trial,) = json.loads(out.read_text())["scenarios"][scenario]["trials"]
    assert trial["exact"] and trial["lost_iterations"] == 0, trial
