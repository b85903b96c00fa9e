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


def test_curve_cluster_admits_allowed_clients_only(world1, tmp_path):
    keys = tmp_path / "keys"
    security.generate(keys, "server")
    security.generate(keys / "clients", "trainer")
    security.generate(tmp_path / "other", "intruder")
    good = security.client_keys(keys / "server.key", keys / "clients" / "trainer.key_secret")
    intruder = security.client_keys(keys / "server.key", tmp_path / "other" / "intruder.key_secret")
    cluster = LocalCluster(
        tmp_path,
        args=(f"security.server_key={keys / 'server.key_secret'}", f"security.allow={keys / 'clients'}"),
        keys=good,
    )
    security.set_client(good)
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

        with pytest.raises(TimeoutError):  # plain socket: the handshake fails
            status(cluster.address, timeout=1.0)
        with pytest.raises(TimeoutError):  # a valid CURVE key that is not on the allow list
            status(cluster.address, timeout=1.0, keys=intruder)
        worker = cluster.status()["workers"][0]
        push = zmq.Context.instance().socket(zmq.PUSH)  # plain frames at a worker's data socket
        push.setsockopt(zmq.LINGER, 0)
        push.connect(worker["data"])
        push.send(b"not even a header", zmq.NOBLOCK)
        deadline = time.monotonic() + 10
        while True:
            st = cluster.status()
            refused, w0 = st["security"]["refused"], st["workers"][0]["rejected"]
            if refused.get("unknown_key") and sum(refused.values()) >= 2 and any(k.startswith("auth_") for k in w0):
                break
            assert time.monotonic() < deadline, (refused, w0)
            time.sleep(0.2)
        push.close(linger=0)
        assert st["security"]["curve"] and st["security"]["accepted"] >= 2
        assert st["workers"][0]["frames_in"] == worker["frames_in"]  # nothing reached the worker's loop
    finally:
        security.set_client(None)
        cluster.stop()
