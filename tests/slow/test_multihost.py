"""A cluster spread over hosts: the coordinator and each worker on an address of their
own, workers joining by the coordinator's address alone, a trainer on yet another.

Two setups: several loopback addresses (always), and real network namespaces joined by
a bridge (separate network stacks, as separate hosts have; needs CAP_NET_ADMIN). Both run
with CURVE role keys laid out as the deployment recipes lay them out (docs/operations.md,
Security): the coordinator and the workers bind with the server pair and admit each allow
directory's keys with its role, each worker connects with a key of its own (one per host),
the trainer with a trainer key, ``status`` with a client key. Across namespaces, a
coordinator without keys on a non-loopback address refuses to start."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow import security
from shadow.testing import free_port, status
from shadow.testing.netns import ClusterKeys
from tests.conftest import ROOT
from tests.helpers.cli import shadow_cli
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow


Keys = ClusterKeys  # the role keys, laid out as the deployment recipes lay them out


def _spawn(cmd: list[str], log) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHADOW_CURVE_")}
    if "coordinator" in cmd and not any(a.startswith("persist.") for a in cmd):
        cmd = [*cmd, "persist.durable=false"]  # these clusters hold what the test configures: memory only
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(env, SHADOW_WORKER_LOST_S="3")
    )


def _wait_workers(address: str, n: int, procs: list, log_path, keys: security.ClientKeys) -> dict:
    deadline = time.monotonic() + 60
    while True:
        try:
            st = status(address, timeout=1.0, keys=keys)
            if sum(1 for w in st["workers"] if w["ready"]) == n:
                return st
        except TimeoutError:
            pass
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"cluster did not form:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)


def _train_and_restore(address: str, job: str, keys: Keys) -> None:
    """Train and restore as a trainer (its key for every socket of this process), then check
    that a client's key reads the status and a connection without keys gets nothing."""
    security.set_client(keys.client("trainer"))
    try:
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
    finally:
        security.reset_client()
    st = status(address, timeout=5.0, keys=keys.client("client"))
    assert st["security"]["curve"] and st["security"]["accepted"] >= 3
    with pytest.raises(TimeoutError):  # a plain socket: the CURVE handshake fails
        status(address, timeout=1.0)


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
    keys = Keys(tmp_path / "keys", workers=2)
    log_path = tmp_path / "cluster.log"
    procs = []
    with open(log_path, "a") as log:
        try:
            procs.append(
                _spawn(
                    [
                        sys.executable,
                        "-m",
                        "shadow",
                        "coordinator",
                        "workers=2",
                        "host=127.0.0.2",
                        f"port={port}",
                        *keys.server(),
                    ],
                    log,
                )
            )
            for i, host in enumerate(("127.0.0.3", "127.0.0.4")):
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
                            *keys.worker(i),
                        ],
                        log,
                    )
                )
            st = _wait_workers(address, 2, procs, log_path, keys.client("client"))
            assert sorted(w["data"].rsplit(":", 1)[0] for w in st["workers"]) == ["tcp://127.0.0.3", "tcp://127.0.0.4"]
            _train_and_restore(address, "loopback", keys)
        finally:
            _stop(procs)


NS = ("shc", "shw1", "shw2")  # coordinator host, two worker hosts
SUBNET = "10.250.77"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _shadow_in(ns: str, *args: str) -> list[str]:
    """The command running ``python -m shadow *args`` in network namespace ``ns``."""
    return ["ip", "netns", "exec", ns, sys.executable, "-m", "shadow", *args]


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
    (host=auto) and their keys bind and advertise their own host's address, and a trainer
    on a fourth host trains and restores through them. Without keys, a coordinator on a
    non-loopback address refuses to start."""
    port = 5555  # a namespace of its own: no other process can hold it
    address = f"tcp://{SUBNET}.1:{port}"
    keys = Keys(tmp_path / "keys", workers=2)
    log_path = tmp_path / "cluster.log"
    procs = []
    with _namespaces(), open(log_path, "a") as log:
        try:
            bare = _spawn(
                _shadow_in(
                    "shc",
                    "coordinator",
                    f"host={SUBNET}.1",
                    "port=5556",
                ),
                log,
            )
            try:
                refused = bare.wait(timeout=60) != 0
            except subprocess.TimeoutExpired:
                refused = False
            finally:
                _stop([bare])
            assert refused, "a coordinator without keys started on a non-loopback address"
            log.flush()
            assert "without keys" in log_path.read_text()
            procs.append(
                _spawn(
                    _shadow_in(
                        "shc",
                        "coordinator",
                        "workers=2",
                        f"host={SUBNET}.1",
                        f"port={port}",
                        *keys.server(),
                    ),
                    log,
                )
            )
            for i, ns in enumerate(("shw1", "shw2")):
                procs.append(
                    _spawn(
                        _shadow_in(
                            ns,
                            "worker",
                            f"coordinator={address}",
                            "threads=1",
                            *keys.worker(i),
                        ),
                        log,
                    )
                )
            st = _wait_workers(address, 2, procs, log_path, keys.client("client"))
            assert sorted(w["data"].rsplit(":", 1)[0] for w in st["workers"]) == [
                f"tcp://{SUBNET}.2",
                f"tcp://{SUBNET}.3",
            ]
            _train_and_restore(address, "netns", keys)
        finally:
            _stop(procs)


def _worker_on_own_disk(ns: str, store: Path, disk: Path, *args: str) -> list[str]:
    """A worker in network namespace ``ns`` whose ``local_dir`` is ``disk``: in a mount
    namespace of its own, ``store`` (this host's disk) is mounted there, so every worker
    sees its own disk at the same path and no other process sees any of them there."""
    mount = f'mount --bind "{store}" "{disk}" && exec "$0" "$@"'
    return ["ip", "netns", "exec", ns, "unshare", "-m", "--propagation", "private", "sh", "-c", mount,
            sys.executable, "-m", "shadow", "worker", f"local_dir={disk}", *args]  # fmt: skip


def _restore_as_trainer(address: str, keys: Keys, iteration: int | None = None):
    security.set_client(keys.client("trainer"))
    try:
        fresh, fopt, fsched = build(seed=7)
        info = trainer_hooks.restore(fresh, fopt, source=address, scheduler=fsched, job="nodes", iteration=iteration)
        return info, fresh
    finally:
        security.reset_client()


def test_node_local_disks(world1, tmp_path):
    """Each worker writes its shard to its own disk (replicas=2: both copies), the coordinator
    keeps the manifests on its own, and nobody else can see a worker's disk: a restore of a
    persisted iteration is served by the workers over the network; after the host of one
    replica is lost with its disk, by the other; after the whole cluster restarts on the
    same disks, from the disk that is left; after every disk is lost too, from the object
    store. Every restore equals the trained state."""
    port = 5555
    address = f"tcp://{SUBNET}.1:{port}"
    keys = Keys(tmp_path / "keys", workers=2)
    log_path = tmp_path / "cluster.log"
    coord_dir, disk = tmp_path / "coordinator", tmp_path / "disk"
    stores = [tmp_path / "store0", tmp_path / "store1"]
    for d in (coord_dir, disk, *stores):
        d.mkdir()
    remote = tmp_path / "object-store"  # every host sees it, as an object store
    persist = [
        f"persist.local.dir={coord_dir}",
        "persist.local.every_n=2",
        "persist.local.keep=0",
        f"persist.remote.url={remote}",
        "persist.remote.every_n=2",
    ]

    def start(log, workers=(0, 1)) -> list:
        procs = [
            _spawn(
                _shadow_in(
                    "shc",
                    "coordinator",
                    "workers=2",
                    "replicas=2",
                    f"host={SUBNET}.1",
                    f"port={port}",
                    *persist,
                    *keys.server(),
                ),  # fmt: skip
                log,
            )
        ]
        for i in workers:
            procs.append(
                _spawn(
                    _worker_on_own_disk(
                        f"shw{i + 1}",
                        stores[i],
                        disk,
                        f"coordinator={address}",
                        "threads=1",
                        f"worker_id={i}",
                        *keys.worker(i),
                    ),
                    log,
                )  # fmt: skip
            )
        _wait_workers(address, len(workers), procs, log_path, keys.client("client"))
        return procs

    procs: list = []
    with _namespaces(), open(log_path, "a") as log:
        try:
            procs = start(log)
            security.set_client(keys.client("trainer"))
            try:
                model, opt, sched = build()
                ddp = DDP(model)
                session = trainer_hooks.attach(ddp, opt, coordinator=address, scheduler=sched, job="nodes")
                snaps = {}
                for it in range(1, 8):
                    train_step(ddp, opt, sched, it)
                    snaps[it] = [p.detach().clone() for p in model.parameters()]
                assert session.close() == 7
            finally:
                security.reset_client()
            deadline = time.monotonic() + 30
            while not sorted(coord_dir.glob("nodes/iteration-*/manifest.json")):
                assert time.monotonic() < deadline, log_path.read_text()[-4000:]
                time.sleep(0.2)
            manifests = sorted(coord_dir.glob("nodes/iteration-*/manifest.json"))
            m = json.loads(manifests[0].read_text())
            persisted = m["iteration"]
            (shard,) = m["shards"]
            assert len({h["disk"] for h in shard["holders"]}) == 2 and {h["dir"] for h in shard["holders"]} == {
                str(disk)
            }
            for store in stores:  # each worker's own disk has its copy; the coordinator's and this host's view none
                assert (store / "nodes" / manifests[0].parent.name / shard["file"]).stat().st_size == shard["bytes"]
            assert not list(disk.iterdir()) and not list(manifests[0].parent.glob("shard-*"))

            info, fresh = _restore_as_trainer(address, keys, persisted)  # memory holds 7: a tier serves it
            assert (info.iteration, info.tier) == (persisted, "local")
            assert all(torch.equal(a, b) for a, b in zip(snaps[persisted], fresh.parameters(), strict=True))
            log.flush()
            assert "to a restore" in log_path.read_text()
            client = [f"security.server_public={keys.root / 'server.key'}"] + [
                f"security.client_key={keys.root / 'clients' / 'client.key_secret'}"
            ]
            res = shadow_cli("verify", f"source={address}", "job=nodes", *client)  # every copy, through the workers
            committed = len(list(coord_dir.glob("nodes/iteration-*/manifest.json")))
            assert res.returncode == 0 and res.stdout.count("(local tier): OK") == committed, res.stdout

            # one replica's host is lost with its disk: the other serves the checkpoint
            procs[2].kill()
            procs[2].wait()
            shutil.rmtree(stores[1] / "nodes")
            deadline = time.monotonic() + 30
            while status(address, timeout=5.0, keys=keys.client("client"))["workers"][1]["health"] != "lost":
                assert time.monotonic() < deadline
                time.sleep(0.3)
            info, fresh = _restore_as_trainer(address, keys, persisted)
            assert (info.iteration, info.tier) == (persisted, "local")
            assert all(torch.equal(a, b) for a, b in zip(snaps[persisted], fresh.parameters(), strict=True))
            res = shadow_cli("verify", f"source={address}", "job=nodes", f"iteration={persisted}", *client)
            lost = shard["holders"][[h["worker"] for h in shard["holders"]].index(1)]["disk"]
            # its copy is gone, the other still serves it: degraded, not corrupt (exit 0)
            assert res.returncode == 0 and f"on disk {lost} (worker 1" in res.stdout, res.stdout
            assert "DEGRADED: lost replica, still restorable" in res.stdout, res.stdout

            # the whole cluster restarts on the same disks (the lost one comes back empty)
            _stop(procs)
            procs = start(log)
            newest = json.loads(sorted(coord_dir.glob("nodes/iteration-*/manifest.json"))[-1].read_text())
            info, fresh = _restore_as_trainer(address, keys)
            assert (info.iteration, info.tier) == (newest["iteration"], "local")
            assert all(torch.equal(a, b) for a, b in zip(snaps[info.iteration], fresh.parameters(), strict=True))

            # the whole cluster again, and every worker's disk with it: the object store serves
            _stop(procs)
            for store in stores:
                shutil.rmtree(store / "nodes", ignore_errors=True)
            procs = start(log)
            uploaded = json.loads(sorted(remote.glob("nodes/iteration-*/manifest.json"))[-1].read_text())
            info, fresh = _restore_as_trainer(address, keys)
            assert (info.iteration, info.tier) == (uploaded["iteration"], "remote")
            assert all(torch.equal(a, b) for a, b in zip(snaps[info.iteration], fresh.parameters(), strict=True))
        finally:
            _stop(procs)
