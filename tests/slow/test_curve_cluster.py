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
from shadow.persist import checkpoints
from shadow.restore.memory import MemorySource, restore_info
from shadow.restore.resolve import pick
from shadow.testing import LocalCluster, status
from shadow.transport.client import dealer
from shadow.wire import frames as F
from shadow.wire import messages as M
from tests.helpers.keys import role_keys
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow


def _count(rejected: dict, reason: str) -> int:
    """Refusals counted under ``reason``, or under a more precise one it starts
    (``auth_handshake``: ``auth_handshake_mechanism`` too)."""
    return sum(n for k, n in rejected.items() if k.startswith(reason))


@pytest.mark.parametrize("mode", ["mac", "curve"])
def test_curve_cluster_admits_each_role_to_its_own_messages(world1, tmp_path, mode, s3, monkeypatch):
    """With keys, in either data mode (``security.data``): gradient frames in clear under
    per-rank MACs, or CURVE-encrypted as well. Restores from memory, from the local tier
    (straight from the disk and through the worker holding it) and from the object store
    come back bit for bit."""
    keys = role_keys(tmp_path / "keys")
    security.generate(tmp_path / "other", "intruder")
    intruder = security.client_keys(tmp_path / "keys" / "server.key", tmp_path / "other" / "intruder.key_secret")
    args = (
        *keys["args"],
        f"security.data={mode}",
        f"persist.local.dir={tmp_path / 'local'}",
        "persist.local.every_n=1",
        f"persist.remote.url=s3://shadow/{mode}",
        "persist.remote.every_n=2",
    )
    cluster = LocalCluster(tmp_path, args=args, keys=keys["admin"], env=s3.env)
    security.set_client(keys["trainer"])
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="curve")
        states = {}
        for it in range(1, 5):
            train_step(ddp, opt, sched, it)
            states[it] = [p.detach().clone() for p in model.parameters()]
        ident = (session.job_id, session.epoch, session.layout.hash)
        assert session.close() == 4
        assert {w["mode"] for w in cluster.status()["workers"]} == {mode}
        fresh, fopt, fsched = build(seed=3)
        assert trainer_hooks.restore(fresh, fopt, source=cluster.address, scheduler=fsched).iteration == 4
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b)
        cluster.wait_status(  # a busy writer may skip a cut, but the last one is asked for again
            lambda st: (
                (st["persist"]["local"]["last_complete"] or {}).get("iteration") == 4
                and not st["persist"]["local"]["in_flight"]
            ),
            what="iteration 4 on the local tier",
        )
        kept = [c.iteration for c in checkpoints.list_checkpoints(str(tmp_path / "local"), job="curve")]
        k = max(i for i in kept if i < 4)  # an older one: memory holds 4
        older, oopt, osched = build(seed=6)
        info = trainer_hooks.restore(older, oopt, source=cluster.address, scheduler=osched, iteration=k)
        assert info.iteration == k and info.tier == "local"
        for a, b in zip(states[k], older.parameters(), strict=True):
            assert torch.equal(a, b)
        src = MemorySource(cluster.address, 30.0)  # the same tier as a host without that disk reads it
        src.candidates("curve")
        (tier,) = [t for t in src.tiers() if t.name == "local"]
        tier.direct = False
        via, vopt, vsched = build(seed=7)
        info = trainer_hooks.apply_snapshot(pick(tier, "curve", k)[1], via, vopt, scheduler=vsched)
        assert info.iteration == k and info.tier == "local"
        for a, b in zip(states[k], via.parameters(), strict=True):
            assert torch.equal(a, b)
        remote = cluster.wait_status(  # the last cut (4) was due for the bucket too (every_n=2): its copy follows
            lambda st: (
                (st["persist"]["remote"]["last_complete"] or {}).get("iteration") == 4
                and not st["persist"]["remote"]["in_flight"]
            ),
            120,
            what="iteration 4 in the bucket",
        )["persist"]["remote"]
        assert remote["failures"] == 0, remote
        r = remote["last_complete"]["iteration"]
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        bucket, bopt, bsched = build(seed=8)
        info = trainer_hooks.restore(bucket, bopt, source=f"s3://shadow/{mode}", scheduler=bsched, job="curve")
        assert info.iteration == r and info.tier == "remote"
        for a, b in zip(states[r], bucket.parameters(), strict=True):
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
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        if mode == "curve":  # a client's key at a worker's data socket (trainers only)
            keys["client"].apply(push)
            push.connect(worker["data"])
            push.send(b"not even a header", zmq.NOBLOCK)
            refusals = {"auth_role_client": 1}
        else:  # in clear, but a peer proves a rank's key at the handshake (issue 53): a stranger's frames,
            # in clear or through the door with a wrong key, never reach a buffer
            wrong = zmq.Context.instance().socket(zmq.PUSH)
            wrong.setsockopt(zmq.LINGER, 0)
            security.Door(b"rank 0", b"0" * 64).apply(wrong)
            job_id, epoch, layout = ident
            runs = ((0, 4, F.checksum(b"\0" * 16)),)
            frame = F.Header(F.Kind.GRAD, F.Field.GRAD, job_id, epoch, 0, 1, layout, 5, 0, runs).pack()
            for s in (push, wrong):
                s.connect(worker["data"])
                s.send_multipart([frame, b"\0" * 16], zmq.NOBLOCK)
            # (a peer in clear tries again as ZeroMQ reconnects: refused each time, as
            # auth_handshake or auth_handshake_mechanism by how far its greeting got)
            refusals = {"auth_handshake": 1, "auth_door_key": 1}
        deadline = time.monotonic() + 30
        while True:
            st = cluster.status()
            refused, w0 = st["security"]["refused"], st["workers"][0]["rejected"]
            if refused.get("unknown_key") and all(_count(w0, r) for r in refusals):
                break
            assert time.monotonic() < deadline, (refused, w0)
            time.sleep(0.2)
        push.close(linger=0)
        if mode == "mac":
            wrong.close(linger=0)
        assert st["security"]["curve"] and st["security"]["accepted"] >= 3
        assert st["security"]["refused_by_role"] == {"client/role": 1}
        assert st["workers"][0]["frames_in"] == worker["frames_in"]  # nothing reached the worker's loop
        assert {r: bool(_count(w0, r)) for r in refusals} == dict.fromkeys(refusals, True)
        assert {k: n for k, n in w0.items() if not k.startswith("auth_")} == {
            k: n for k, n in worker["rejected"].items() if not k.startswith("auth_")
        }  # nothing else: no frame was read
        assert st["job"]["committed"] == 4 and not st["workers"][0]["stale"]
        if mode == "mac":  # the serve sockets are in clear too: a fetch needs a ticket from the coordinator
            mem = restore_info(cluster.address, None, 10.0)["memory"]  # as the read-only client
            assert all(isinstance(w["ticket"], bytes) and len(w["key"]) == 32 for w in mem["workers"])
            assert (
                restore_info(cluster.address, None, 10.0)["memory"]["workers"][0]["ticket"]
                != mem["workers"][0]["ticket"]
            )
            w = mem["workers"][0]
            for door in (None, security.Door(w["ticket"].hex().encode(), b"0" * 64)):  # no door, a wrong key
                intruder_sock = dealer(zmq.Context.instance(), worker["serve"], curve=False, door=door)
                try:
                    intruder_sock.send(M.encode("fetch", epoch=mem["epoch"], iteration=4))
                    assert not intruder_sock.poll(1000), "a peer that proved no ticket was answered"
                finally:
                    intruder_sock.close(linger=0)
            cluster.wait_status(
                lambda st: st["workers"][0]["rejected"].get("auth_door_key") == 2, what="the wrong key refused"
            )
            # a ticket's holder, past the door, still needs a valid ticket on each fetch
            door = security.ticket_door(w["ticket"], w["key"])
            stranger = dealer(zmq.Context.instance(), worker["serve"], curve=False, door=door)
            try:
                stranger.send(M.encode("fetch", epoch=mem["epoch"], iteration=4))
                assert stranger.poll(30_000), "the worker did not answer a fetch without a ticket"
                reply = M.decode(stranger.recv())
                assert reply["t"] == "error" and "no valid ticket" in reply["message"], reply
                forged = {"ticket": bytes(16), "mac": bytes(32)}
                stranger.send(M.encode("fetch", epoch=mem["epoch"], iteration=4, **forged))
                # a connection is told once (issue 53, item 5): a peer that never reads holds one answer
                cluster.wait_status(
                    lambda st: st["workers"][0]["rejected"].get("serve_reply_dropped") == 1,
                    what="the second refusal on one connection dropped",
                )
                assert not stranger.poll(0)
                other = dealer(zmq.Context.instance(), worker["serve"], curve=False, door=door)
                try:
                    other.send(M.encode("fetch", epoch=mem["epoch"], iteration=4, **forged))
                    assert other.poll(30_000) and "no valid ticket" in M.decode(other.recv())["message"]
                finally:
                    other.close(linger=0)
            finally:
                stranger.close(linger=0)
            cluster.wait_status(  # the worker's counters come with its heartbeats
                lambda st: st["workers"][0]["rejected"].get("serve_bad_ticket") == 3, what="three fetches refused"
            )
    finally:
        security.reset_client()
        cluster.stop()
