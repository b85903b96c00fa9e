"""A cluster spread over hosts: the coordinator and each worker on an address of their
own, workers joining by the coordinator's address alone, a trainer on yet another.

Two setups: several loopback addresses (always), and real network namespaces joined by
a bridge (separate network stacks, as separate hosts have; needs CAP_NET_ADMIN)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.testing import free_port, status
from tests.conftest import ROOT, train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow


def _spawn(cmd: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, SHADOW_WORKER_LOST_S="3")
    )


def _wait_workers(address: str, n: int, procs: list, log_path) -> dict:
    deadline = time.monotonic() + 60
    while True:
        try:
            st = status(address, timeout=1.0)
            if sum(1 for w in st["workers"] if w["ready"]) == n:
                return st
        except TimeoutError:
            pass
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"cluster did not form:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)


def _train_and_restore(address: str, job: str) -> None:
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=address, scheduler=sched, job=job)
    for it in range(1, 5):
        train_step(ddp, opt, sched, it)
    assert session.close() == 4
    fresh, fopt, fsched = build(seed=5)
    assert trainer_hooks.restore(fresh, fopt, source=address, scheduler=fsched, job=job).iteration == 4
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def _stop(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def test_loopback_addresses(world1, tmp_path):
    """Coordinator on 127.0.0.2, workers on 127.0.0.3 and 127.0.0.4, trainer on 127.0.0.1."""
    port = free_port()
    address = f"tcp://127.0.0.2:{port}"
    log_path = tmp_path / "cluster.log"
    procs = []
    with open(log_path, "a") as log:
        try:
            procs.append(
                _spawn(
                    [sys.executable, "-m", "shadow", "coordinator", "workers=2", "host=127.0.0.2", f"port={port}"], log
                )
            )
            for host in ("127.0.0.3", "127.0.0.4"):
                procs.append(
                    _spawn(
                        [
                            sys.executable,
                            "-m",
                            "shadow",
                            "worker",
                            f"coordinator={address}",
                            f"host={host}",
                            "threads=1",
                        ],
                        log,
                    )
                )
            st = _wait_workers(address, 2, procs, log_path)
            assert sorted(w["data"].rsplit(":", 1)[0] for w in st["workers"]) == ["tcp://127.0.0.3", "tcp://127.0.0.4"]
            _train_and_restore(address, "loopback")
        finally:
            _stop(procs)


NS = ("shc", "shw1", "shw2")  # coordinator host, two worker hosts
SUBNET = "10.250.77"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def _namespaces():
    """A bridge in this namespace (the trainer's host, .254) and one namespace per host
    (.1, .2, .3) plugged into it with a veth pair each."""
    try:
        _ip("link", "add", "shbr0", "type", "bridge")
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(
            f"cannot create network namespaces here ({getattr(exc, 'stderr', exc)!s}); "
            "test_loopback_addresses covers the multi-address case"
        )
    try:
        _ip("addr", "add", f"{SUBNET}.254/24", "dev", "shbr0")
        _ip("link", "set", "shbr0", "up")
        for i, ns in enumerate(NS, start=1):
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            _ip("link", "add", f"v{ns}", "type", "veth", "peer", "name", f"v{ns}p")
            _ip("link", "set", f"v{ns}p", "netns", ns)
            _ip("link", "set", f"v{ns}", "master", "shbr0")
            _ip("link", "set", f"v{ns}", "up")
            _ip("addr", "add", f"{SUBNET}.{i}/24", "dev", f"v{ns}p", ns=ns)
            _ip("link", "set", f"v{ns}p", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        yield
    finally:
        for ns in NS:
            subprocess.run(["ip", "link", "del", f"v{ns}"], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", "shbr0"], capture_output=True)


def test_network_namespaces(world1, tmp_path):
    """Separate network stacks: workers started with nothing but the coordinator's address
    (host=auto) bind and advertise their own host's address, and a trainer on a fourth
    host trains and restores through them."""
    port = 5555  # a namespace of its own: no other process can hold it
    address = f"tcp://{SUBNET}.1:{port}"
    log_path = tmp_path / "cluster.log"
    procs = []
    with _namespaces(), open(log_path, "a") as log:
        try:
            procs.append(
                _spawn(
                    [
                        "ip",
                        "netns",
                        "exec",
                        "shc",
                        sys.executable,
                        "-m",
                        "shadow",
                        "coordinator",
                        "workers=2",
                        f"host={SUBNET}.1",
                        f"port={port}",
                    ],
                    log,
                )
            )
            for ns in ("shw1", "shw2"):
                procs.append(
                    _spawn(
                        [
                            "ip",
                            "netns",
                            "exec",
                            ns,
                            sys.executable,
                            "-m",
                            "shadow",
                            "worker",
                            f"coordinator={address}",
                            "threads=1",
                        ],
                        log,
                    )
                )
            st = _wait_workers(address, 2, procs, log_path)
            assert sorted(w["data"].rsplit(":", 1)[0] for w in st["workers"]) == [
                f"tcp://{SUBNET}.2",
                f"tcp://{SUBNET}.3",
            ]
            _train_and_restore(address, "netns")
        finally:
            _stop(procs)
