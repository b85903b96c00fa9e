"""Job-scoped keys on a running keyed cluster, in both data modes: a trainer key of job
``team-a`` trains it and a client key of ``team-a`` restores it bit for bit (from memory and
from the local tier through the worker holding it); the keys of job ``team-b`` cannot attach
to it, see it in the status, restore it, read its shard files from a worker's disk with a
ticket of their own job, or (curve) fetch its state from a worker's serve socket."""

from __future__ import annotations

import pytest
import torch
import zmq
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow import security
from shadow.config.tuning import Tuning
from shadow.core.errors import ShadowError
from shadow.persist import checkpoints
from shadow.restore.files_client import read_file
from shadow.restore.memory import restore_info
from shadow.testing import LocalCluster, status
from shadow.transport.client import dealer
from shadow.wire import messages as M
from tests.helpers.keys import role_keys
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow

TUNING = Tuning.load().replace(fetch_timeout_s=5.0)
SCOPED = {
    "a_trainer": ("trainer", "team-a"),
    "a_client": ("client", "team-*"),  # a pattern: every team's job
    "b_trainer": ("trainer", "team-b"),
    "b_client": ("client", "team-b"),
}


def _same(model, params) -> None:
    for a, b in zip(params, model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["mac", "curve"])
def test_a_jobs_keys_reach_that_job_only(world1, tmp_path, mode):
    keys = role_keys(tmp_path / "keys", scoped=SCOPED)
    local = tmp_path / "local"
    args = (*keys["args"], f"security.data={mode}", f"persist.local.dir={local}", "persist.local.every_n=1")
    cluster = LocalCluster(tmp_path, args=args, keys=keys["admin"])
    try:
        security.set_client(keys["a_trainer"])
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="team-a")
        states = {}
        for it in range(1, 4):
            train_step(ddp, opt, sched, it)
            states[it] = [p.detach().clone() for p in model.parameters()]
        epoch = session.epoch
        assert session.close() == 3
        cluster.wait_status(
            lambda st: (st["persist"]["local"]["last_complete"] or {}).get("iteration") == 3,
            what="iteration 3 on the local tier",
        )

        security.set_client(keys["b_trainer"])  # another job's trainer key: no attach to team-a
        other, oopt, _ = build(seed=5)
        with pytest.raises(trainer_hooks.ShadowConnectionError, match="limited to jobs team-b.*attach to job 'team-a'"):
            trainer_hooks.attach(DDP(other), oopt, coordinator=cluster.address, job="team-a")

        security.set_client(keys["b_client"])  # another job's client key: sees and restores nothing of it
        st = status(cluster.address, keys=keys["b_client"])
        assert st["job"] is None and "restorable" not in st
        fresh, fopt, fsched = build(seed=3)
        with pytest.raises(ShadowError, match="limited to jobs team-b"):
            trainer_hooks.restore(fresh, fopt, source=cluster.address, scheduler=fsched, job="team-a")
        with pytest.raises(ShadowError, match="limited to jobs team-b"):
            restore_info(cluster.address, None, 10.0)  # the held job, named by omission
        (ckpt,) = [c for c in checkpoints.list_checkpoints(str(local), job="team-a") if c.iteration == 3]
        shard = ckpt.manifest["shards"][0]
        mine = restore_info(cluster.address, "team-b", 10.0)  # its own job's info: tickets that read team-b
        (tier,) = [t for t in mine["storage"] if t["tier"] == "local"]
        w = tier["workers"][0]
        auth = (w["ticket"], w["key"]) if mode == "mac" else None
        with pytest.raises(ShadowError, match="does not read job 'team-a'|may not read job 'team-a'"):
            read_file(w["files"], "team-a", ckpt.path.rstrip("/").rsplit("/", 1)[-1], shard, TUNING, auth)
        if mode == "curve":  # its key at a worker's serve socket: no fetch of team-a's state
            sock = dealer(zmq.Context.instance(), cluster.status()["workers"][0]["serve"], curve=True)
            try:
                sock.send(M.encode("fetch", epoch=epoch, iteration=3))
                assert sock.poll(30_000), "the worker did not answer"
                reply = M.decode(sock.recv())
                assert reply["t"] == "error" and "may not read job 'team-a'" in reply["message"], reply
            finally:
                sock.close(linger=0)

        security.set_client(keys["a_client"])  # a client key of every team's job restores it
        assert status(cluster.address, keys=keys["a_client"])["job"]["name"] == "team-a"
        back, bopt, bsched = build(seed=4)
        info = trainer_hooks.restore(back, bopt, source=cluster.address, scheduler=bsched, job="team-a")
        assert info.iteration == 3 and info.tier == "memory"
        _same(back, states[3])
        older, oopt2, osched = build(seed=6)
        info = trainer_hooks.restore(older, oopt2, source=cluster.address, scheduler=osched, job="team-a", iteration=2)
        assert info.iteration == 2 and info.tier == "local"
        _same(older, states[2])

        refused = cluster.status()["security"]["refused_by_role"]
        assert refused.get("trainer/scope") == 1 and refused.get("client/scope", 0) >= 2, refused
    finally:
        security.reset_client()
        cluster.stop()
