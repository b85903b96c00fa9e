"""A cluster with CURVE on: allowed trainers train and restore as usual; clients without
keys, with unknown keys or with plain sockets get nothing, and every refusal is counted."""

from __future__ import annotations

import time

import pytest
import torch
import zmq
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow import security
from shadow.testing import LocalCluster, status
from tests.conftest import train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow


def role_keys(root) -> dict:
    """A cluster's keys as ``shadow keygen role=...`` lays them out, and its security arguments."""
    security.generate(root, "server")
    for role in ("worker", "trainer", "client", "admin"):
        security.generate(root / f"{role}s", role)
    args = (
        f"security.server_key={root / 'server.key_secret'}",
        f"security.client_key={root / 'workers' / 'worker.key_secret'}",
        *(f"security.allow_{r}s={root / f'{r}s'}" for r in ("worker", "trainer", "client", "admin")),
    )
    keys = {
        r: security.client_keys(root / "server.key", root / f"{r}s" / f"{r}.key_secret")
        for r in ("trainer", "client", "admin")
    }
    return {"args": args, **keys}


def test_curve_cluster_admits_each_role_to_its_own_messages(world1, tmp_path):
    keys = role_keys(tmp_path / "keys")
    security.generate(tmp_path / "other", "intruder")
    intruder = security.client_keys(tmp_path / "keys" / "server.key", tmp_path / "other" / "intruder.key_secret")
    cluster = LocalCluster(tmp_path, args=keys["args"], keys=keys["admin"])
    security.set_client(keys["trainer"])
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="curve")
        for it in range(1, 5):
            train_step(ddp, opt, sched, it)
        assert session.close() == 4
        fresh, fopt, fsched = build(seed=3)
        assert trainer_hooks.restore(fresh, fopt, source=cluster.address, scheduler=fsched).iteration == 4
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b)
        security.set_client(keys["client"])  # a read-only client restores (memory fetches from the workers too)
        again, aopt, asched = build(seed=4)
        assert trainer_hooks.restore(again, aopt, source=cluster.address, scheduler=asched).iteration == 4
        assert status(cluster.address, keys=keys["client"])["job"]["committed"] == 4
        other, oopt, _ = build(seed=5)
        with pytest.raises(trainer_hooks.ShadowConnectionError, match="a client may not send 'attach'"):
            trainer_hooks.attach(DDP(other), oopt, coordinator=cluster.address, job="curve2")

        with pytest.raises(TimeoutError):  # plain socket: the handshake fails
            status(cluster.address, timeout=1.0, keys=None)
        with pytest.raises(TimeoutError):  # a valid CURVE key that is in no allow list
            status(cluster.address, timeout=1.0, keys=intruder)
        worker = cluster.status()["workers"][0]
        push = zmq.Context.instance().socket(zmq.PUSH)  # a client's key at a worker's data socket (trainers only)
        push.setsockopt(zmq.LINGER, 0)
        keys["client"].apply(push)
        push.connect(worker["data"])
        push.send(b"not even a header", zmq.NOBLOCK)
        deadline = time.monotonic() + 10
        while True:
            st = cluster.status()
            refused, w0 = st["security"]["refused"], st["workers"][0]["rejected"]
            if refused.get("unknown_key") and w0.get("auth_role_client"):
                break
            assert time.monotonic() < deadline, (refused, w0)
            time.sleep(0.2)
        push.close(linger=0)
        assert st["security"]["curve"] and st["security"]["accepted"] >= 3
        assert st["security"]["refused_by_role"] == {"client/role": 1}
        assert st["workers"][0]["frames_in"] == worker["frames_in"]  # nothing reached the worker's loop
    finally:
        security.set_client(None)
        cluster.stop()
