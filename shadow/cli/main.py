"""The ``shadow`` command line (also ``python -m shadow``)."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from shadow.cli._args import UsageError, parse
from shadow.config import (
    ClusterConfig,
    CoordinatorConfig,
    KeygenConfig,
    ListConfig,
    RestoreConfig,
    StatusConfig,
    VerifyConfig,
    WorkerConfig,
)

USAGE = """usage: shadow COMMAND [key=value ...]

commands:
  cluster      coordinator + N workers on this host, foreground
               e.g.  shadow cluster workers=2 port=5555
  coordinator  the coordinator alone         e.g.  shadow coordinator workers=2 port=5555
  worker       one worker joining a cluster  e.g.  shadow worker coordinator=tcp://10.0.0.5:5555 host=10.0.0.7
  status       workers, ranges, committed iteration, lag
               e.g.  shadow status address=tcp://127.0.0.1:5555 [json=true]
  restore      write the newest complete checkpoint (or iteration=k) out
               e.g.  shadow restore source=tcp://127.0.0.1:5555 out=ckpt.pt format=torch
                     shadow restore source=/data/ckpt out=ckpt_dcp format=dcp iteration=400
                     (formats: torch, dcp, safetensors; sources: coordinator, directory, fsspec URL)
  ls           list checkpoints (memory and every tier) e.g.  shadow ls source=tcp://127.0.0.1:5555
  verify       re-read and check every checksum         e.g.  shadow verify source=/data/ckpt [iteration=k]
  keygen       write a CURVE key pair (name.key, name.key_secret)
               e.g.  shadow keygen dir=keys name=server      (the cluster's pair)
                     shadow keygen dir=keys/clients name=trainer0 [overwrite=true]

fault tolerance and security, e.g.:
  shadow cluster workers=4 replicas=2          (every shard on 2 workers: a lost one recopies from its peer)
  shadow cluster workers=2 host=10.0.0.5 security.server_key=keys/server.key_secret security.allow=keys/clients
  shadow status address=tcp://10.0.0.5:5555 security.server_public=keys/server.key \\
                security.client_key=keys/clients/trainer0.key_secret
  (trainers: SHADOW_CURVE_SERVER_KEY=keys/server.key SHADOW_CURVE_CLIENT_KEY=keys/clients/trainer0.key_secret)

cluster persistence keys, e.g.:
  shadow cluster workers=2 persist.local.dir=/nvme/shadow persist.local.every_n=50 persist.local.keep=3 \\
                 persist.remote.url=/mnt/shared/shadow persist.remote.every_n=500
"""


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s pid=%(process)d %(message)s")


def _warn_public(host: str, security) -> None:
    if host not in ("127.0.0.1", "localhost", "::1") and not security.server_key:
        logging.getLogger("shadow").warning(
            "binding to %s exposes the cluster beyond this host without authentication or encryption; "
            "make keys with `shadow keygen` and set security.server_key= and security.allow=", host)


def cmd_coordinator(cfg: CoordinatorConfig) -> int:
    from shadow import security
    from shadow.coordinator.server import Coordinator

    _logging(cfg.log_level)
    _warn_public(cfg.host, cfg.security)
    coord = Coordinator(f"tcp://{cfg.host}:{cfg.port}", cfg.workers, cfg.persist.to_dict(),
                        guard=security.guard_from_config(cfg.security), replicas=cfg.replicas)
    signal.signal(signal.SIGTERM, lambda *_: coord.stop())
    try:
        coord.run()
    except KeyboardInterrupt:
        pass
    return 0


def cmd_worker(cfg: WorkerConfig) -> int:
    if cfg.threads:
        os.environ["NUMBA_NUM_THREADS"] = str(cfg.threads)
    from shadow import security
    from shadow.worker.server import Worker

    _logging(cfg.log_level)
    _warn_public(cfg.host, cfg.security)
    worker = Worker(cfg.coordinator, host=cfg.host, worker_id=cfg.worker_id,
                    guard=security.guard_from_config(cfg.security), keys=security.client_from_config(cfg.security))
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    return 0


def cmd_cluster(cfg: ClusterConfig) -> int:
    from shadow import security
    from shadow.coordinator.server import Coordinator

    _logging(cfg.log_level)
    _warn_public(cfg.host, cfg.security)
    log = logging.getLogger("shadow.cluster")
    address = f"tcp://{cfg.host}:{cfg.port}"
    coord = Coordinator(address, cfg.workers, cfg.persist.to_dict(), guard=security.guard_from_config(cfg.security),
                        replicas=cfg.replicas)
    curve = [f"security.server_key={cfg.security.server_key}", f"security.allow={cfg.security.allow}"] \
        if cfg.security.server_key else []
    procs: list[subprocess.Popen] = []
    stop = threading.Event()

    def shutdown(*_):
        stop.set()
        coord.stop()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    thread = threading.Thread(target=coord.run, name="coordinator", daemon=True)
    thread.start()
    def spawn(slot: int) -> subprocess.Popen:
        return subprocess.Popen([
            sys.executable, "-m", "shadow", "worker", f"coordinator={address}", f"host={cfg.host}",
            f"threads={cfg.threads()}", f"log_level={cfg.log_level}", f"worker_id={slot}", *curve,
        ])

    procs = [spawn(i) for i in range(cfg.workers)]
    restarts = [0] * cfg.workers
    log.info("shadow cluster at %s: %d workers (pids %s), %d numba threads each",
             address, cfg.workers, [p.pid for p in procs], cfg.threads())
    try:
        while not stop.is_set() and thread.is_alive():
            for slot, p in enumerate(procs):
                if p.poll() is None or stop.is_set():
                    continue
                if restarts[slot] >= cfg.max_restarts:
                    continue
                restarts[slot] += 1
                log.error("worker %d (pid %d) exited with status %s; restarting it (%d/%d)", slot, p.pid,
                          p.returncode, restarts[slot], cfg.max_restarts)
                procs[slot] = spawn(slot)
            time.sleep(0.2)
    finally:
        coord.stop()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        thread.join(timeout=5)
    return 0


def cmd_status(cfg: StatusConfig) -> int:
    import zmq

    from shadow.client import dealer, request
    from shadow.wire import messages as M

    sock = dealer(zmq.Context.instance(), cfg.address)
    try:
        st = request(sock, cfg.address, M.encode("status"), cfg.timeout, ("status_reply",))["status"]
    finally:
        sock.close(linger=0)
    if cfg.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    from shadow.cli._render import render_status

    render_status(st, cfg.address)
    return 0


def cmd_restore(cfg: RestoreConfig) -> int:
    from shadow.cli._render import byte_progress, stage
    from shadow.restore import resolve

    t0 = time.monotonic()
    with byte_progress(f"reading the checkpoint behind {cfg.source}") as progress:
        snap = resolve(cfg.source, job=cfg.job, iteration=cfg.iteration, timeout=cfg.timeout, progress=progress)
    with stage(f"writing {cfg.out} ({cfg.format})"):
        from trainer_hooks import export

        export(snap, cfg.out, cfg.format)
    size = _size(cfg.out)
    print(f"wrote {cfg.out} ({cfg.format}): job {snap.job} iteration {snap.iteration}, {len(snap.layout.params)} "
          f"parameters, {size / 2**20:.1f} MiB, from {snap.tier} ({snap.source}) in {time.monotonic() - t0:.2f} s")
    return 0


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)


def cmd_ls(cfg: ListConfig) -> int:
    from shadow.cli._render import render_checkpoints
    from shadow.persist import catalog
    from shadow.restore.resolve import is_endpoint, restore_info

    rows = []
    roots = [(cfg.source, "local" if catalog.is_local(cfg.source) else "remote")]
    if is_endpoint(cfg.source):
        info = restore_info(cfg.source, cfg.job, cfg.timeout)
        if info["memory"]:
            m = info["memory"]
            rows.append({"job": m["job"], "iteration": m["iteration"], "tier": "memory", "time": None,
                         "bytes": None, "state": "complete", "path": cfg.source})
        roots = [(s["root"], s["tier"]) for s in info["storage"]]
    for root, tier in roots:
        for c in catalog.list_checkpoints(root, tier, cfg.job):
            rows.append({"job": c.job, "iteration": c.iteration, "tier": tier, "time": c.manifest.get("created"),
                         "bytes": c.bytes, "state": "complete", "path": c.path})
        for d in catalog.list_torn(root, cfg.job):
            rows.append({"job": d.rstrip("/").split("/")[-2], "iteration": int(d.rsplit("-", 1)[1]), "tier": tier,
                         "time": None, "bytes": None, "state": "incomplete", "path": d})
    if cfg.json:
        print(json.dumps(rows, indent=2))
    else:
        render_checkpoints(rows, cfg.source)
    return 0


def cmd_verify(cfg: VerifyConfig) -> int:
    from shadow.persist import catalog

    tier = "local" if catalog.is_local(cfg.source) else "remote"
    found = catalog.list_checkpoints(cfg.source, tier, cfg.job)
    if cfg.iteration is not None:
        found = [c for c in found if c.iteration == cfg.iteration]
    if not found:
        what = f"iteration {cfg.iteration}" if cfg.iteration is not None else "any complete checkpoint"
        print(f"shadow verify: no {what} under {cfg.source}", file=sys.stderr)
        return 1
    bad = 0
    for c in found:
        problems = catalog.verify(c)
        bad += bool(problems)
        status = "OK" if not problems else "CORRUPT"
        print(f"{c.job} iteration {c.iteration}: {status} ({len(c.manifest['shards'])} shards, {c.bytes / 2**20:.1f} MiB)")
        for p in problems:
            print(f"  {p}")
    return 1 if bad else 0


def cmd_keygen(cfg: KeygenConfig) -> int:
    from shadow.security import generate

    public, secret = generate(cfg.dir, cfg.name, overwrite=cfg.overwrite)
    print(f"public key: {public}")
    print(f"secret key: {secret} (mode 0600; keep it private)")
    if cfg.name == "server":
        print(f"on the cluster, coordinator and workers: security.server_key={secret} security.allow=DIR")
        print(f"give clients the public key: security.server_public={public} "
              f"(trainers: SHADOW_CURVE_SERVER_KEY={public})")
    else:
        print(f"allow this client: copy {public} into the cluster's security.allow directory")
        print(f"on this client: security.client_key={secret} (trainers: SHADOW_CURVE_CLIENT_KEY={secret})")
    return 0


COMMANDS = {
    "cluster": (ClusterConfig, cmd_cluster),
    "coordinator": (CoordinatorConfig, cmd_coordinator),
    "worker": (WorkerConfig, cmd_worker),
    "status": (StatusConfig, cmd_status),
    "restore": (RestoreConfig, cmd_restore),
    "ls": (ListConfig, cmd_ls),
    "verify": (VerifyConfig, cmd_verify),
    "keygen": (KeygenConfig, cmd_keygen),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"shadow: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    cls, fn = COMMANDS[name]
    if any(a in ("-h", "--help") for a in rest):
        print(USAGE)
        print(f"{name} keys: " + ", ".join(f"{k}={v!r}" for k, v in vars(cls()).items()))
        return 0
    try:
        cfg = parse(cls, rest)
    except UsageError as exc:
        print(f"shadow {name}: {exc}", file=sys.stderr)
        return 2
    from shadow.errors import ShadowError

    try:
        sec = getattr(cfg, "security", None)
        if name in ("status", "restore", "ls") and sec is not None and sec.enabled:
            from shadow import security

            security.set_client(security.client_from_config(sec))
        return fn(cfg)
    except (ShadowError, OSError) as exc:
        print(f"shadow {name}: {exc}", file=sys.stderr)
        return 1
