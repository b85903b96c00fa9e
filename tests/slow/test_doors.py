"""Issue 53: another account with no key, at a keyed worker's sockets in clear (``mac``
mode's data, serve and files sockets). Before, each took any connection: an unfinished
multipart message grew the worker by every byte sent, and greeted connections held a
descriptor each until the worker ran out. Now each socket is a door (ZeroMQ PLAIN checked
by the worker's guard): a stranger is refused at the handshake, before any of its bytes
reach a buffer, and its connection is closed at once."""

from __future__ import annotations

import os

import pytest
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow import security
from shadow.testing import LocalCluster, rss_bytes
from shadow.testing.strangers import attack
from shadow.transport import data_limit
from shadow.wire import messages as M
from tests.helpers.keys import role_keys
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow

#: what one attacker sends at each socket: an unfinished message of this many bytes
SENT_BYTES = 192 << 20


def _refused(st: dict) -> int:
    """Handshakes the worker refused (its guard's counts, by reason)."""
    return sum(n for k, n in st["workers"][0]["rejected"].items() if k.startswith("auth_handshake"))


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def keyed(tmp_path):
    keys = role_keys(tmp_path / "keys")
    cluster = LocalCluster(tmp_path, workers=1, args=(*keys["args"], "security.data=mac"), keys=keys["admin"])
    security.set_client(keys["trainer"])
    try:
        yield cluster
    finally:
        security.reset_client()
        cluster.stop()


def _train(cluster: LocalCluster, job: str, iterations: int) -> None:
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job=job)
    for it in range(1, iterations + 1):
        train_step(ddp, opt, sched, it)
    assert session.close() == iterations


def test_an_unfinished_message_from_a_stranger_reaches_no_buffer(world1, keyed):
    """Item 1: an unfinished multipart message at each socket in clear, 192 MiB each, from
    a process with no key: the worker's memory stays within 10%, and a job trains and
    commits beside it."""
    (worker,) = keyed.status()["workers"]
    pid = worker["pid"]
    _train(keyed, "before", 2)  # the worker's arrays and buffers in place: the level to hold
    rss0 = rss_bytes(pid)
    attackers = [
        attack(worker["data"], "PUSH", data_limit(), SENT_BYTES),
        attack(worker["serve"], "DEALER", M.socket_limit("serve"), SENT_BYTES),
        attack(worker["files"], "DEALER", M.socket_limit("files"), SENT_BYTES),
    ]
    try:
        for a in attackers:  # each has sent what it could (a refused connection takes nothing more)
            assert a.stdout is not None and a.stdout.readline().startswith("sent")
        _train(keyed, "beside", 3)
        rss1 = rss_bytes(pid)
        assert rss1 <= 1.1 * rss0, f"the worker grew from {rss0 >> 20} to {rss1 >> 20} MiB"
        st = keyed.wait_status(lambda st: _refused(st) >= 3, what="three strangers refused")
        assert not st["workers"][0]["stale"]
    finally:
        for a in attackers:
            a.kill()
            a.wait()


def test_greeted_connections_from_a_stranger_hold_no_descriptor(world1, keyed):
    """Item 3: 2,000 connections that finish ZeroMQ's greeting without a key, held open by
    the stranger: the worker closes each at its handshake, so its descriptors stay where
    they were and a trainer attaches and trains."""
    (worker,) = keyed.status()["workers"]
    pid = worker["pid"]
    fd0 = _descriptors(pid)
    attacker = attack(worker["data"], "PUSH", 0, 0, conns=2000)
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().startswith("sent")
        # every one greeted and refused: the worker answered each handshake and closed it
        keyed.wait_status(
            lambda st: _refused(st) >= 2000,
            timeout=120,
            what="2,000 greetings refused",
        )
        fd1 = _descriptors(pid)
        assert fd1 <= fd0 + 32, f"the worker holds {fd1} descriptors, {fd0} before"
        _train(keyed, "beside", 3)
    finally:
        attacker.kill()
        attacker.wait()
