"""The long-running commands: ``cluster``, ``coordinator``, ``worker``."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from shadow.config import AgentConfig, ClusterConfig, CoordinatorConfig, WorkerConfig
from shadow.config.logs import setup as setup_logs
from shadow.core.errors import ShadowError

# the module `shadow cluster` runs its workers as (`python -m <it> worker ...`); shadow.testing.faulty
# sets its own, so that its workers carry its fault wrappers
WORKER_ENTRY = "shadow"

logger = logging.getLogger("shadow.cli")


def secure(security, host: str, who: str):
    """The ``security`` a service bound to ``host`` runs with. Keys given: those. None given,
    on loopback: this user's key set (:mod:`shadow.security.keyset`, made on first start), so that no
    other local account and no process squatting a port can take part. Beyond loopback
    without keys: refused. Keyless only with ``security.insecure=true``, warned at every start."""
    from shadow.security import SecurityError, keyset

    if security.server_key:
        keyset.check_given(security.server_key)  # a cluster's worker, given the set's files: checked as the set is
        _check_cluster_key(security.server_key, who)
        return security
    if security.enabled:
        raise SecurityError(
            f"{who}: security.client_key without security.server_key: a service binds with the cluster's "
            "pair; set security.server_key and the allow lists, or neither (this user's key set on loopback)"
        )
    if not security.insecure:
        if keyset.loopback(host):
            keys = keyset.ensure()
            logger.info("%s: keyed with this user's key set in %s (no other account can connect)", who, keys.dir)
            return dataclasses.replace(security, **keys.server_fields())
        raise SecurityError(
            f"{who}: refusing to bind {host} without keys: anyone who can reach it could stop the cluster, "
            "replace a job or plant a checkpoint. Make keys (`shadow keygen role=server`, role=worker, "
            "role=trainer, role=client, role=admin) and set security.server_key and security.allow_workers/"
            "allow_trainers/allow_clients/allow_admins (workers also security.client_key), or bind to "
            "127.0.0.1 (this user's key set is then used), or accept the risk with security.insecure=true"
        )
    logger.warning(
        "%s: INSECURE: bound to %s without keys (security.insecure=true): %s can control this cluster "
        "and read its checkpoints",
        who,
        host,
        "any local account" if keyset.loopback(host) else "anyone who can reach it",
    )
    return security


#: the public key of the pair a cluster started with, handed to its workers: a worker
#: (re)started later refuses a key file that no longer holds it
CLUSTER_KEY_ENV = "SHADOW_CLUSTER_SERVER_PUBLIC"


def _check_cluster_key(server_key: str, who: str) -> None:
    """A worker its cluster started (``CLUSTER_KEY_ENV`` set) refuses a server key file whose
    pair is not the one the cluster runs with: the key set was replaced since (deleted and
    made again), and every handshake would fail without a word."""
    want = os.environ.get(CLUSTER_KEY_ENV)
    if not want:
        return
    from shadow import security
    from shadow.security import SecurityError

    have = security.load_secret(server_key)[0].decode()
    if have != want:
        raise SecurityError(
            f"{who}: {server_key} no longer holds the pair the cluster started with (its public key was {want}, "
            f"now {have}): the key set was replaced since, so this worker could never complete a handshake "
            "with the cluster; restart the cluster (`shadow cluster`) and its trainers"
        )


def _coordinator(cfg: CoordinatorConfig):
    from shadow import security
    from shadow.coordinator.server import Coordinator
    from shadow.persist import signing

    tier = cfg.persist.with_default_tier(cfg.port)
    if tier:
        local = cfg.persist.local
        every = [
            f"every {n}{unit}"
            for n, unit in ((local.every_n, " iterations"), (local.every_s, " s"), (local.every_tokens, " tokens"))
            if n
        ]
        logger.warning(
            "no persistence tier configured: checkpoints are kept in %s %s (keeping %s), so that a restarted "
            "cluster resumes its jobs from disk; persist.local.dir= sets another place, persist.durable=false "
            "keeps them in memory only",
            tier,
            " or ".join(every),
            local.keep or "all",
        )

    return Coordinator(
        f"tcp://{cfg.host}:{cfg.port}",
        cfg.workers,
        cfg.persist,
        guard=security.guard_from_config(cfg.security),
        replicas=cfg.replicas,
        tuning=cfg.tuning.resolve(),
        sign_key=signing.load_key(cfg.security.manifest_key) if cfg.persist.sign else None,
    )


def _coordinator_metrics(cfg: CoordinatorConfig, coord):
    if not cfg.metrics_port:
        return None
    from shadow.coordinator.metrics import samples
    from shadow.metrics import COORDINATOR, serve

    return serve(cfg.host, cfg.metrics_port, COORDINATOR, lambda: samples(coord.state, coord.persist, coord.guard))


def _run(service, metrics) -> int:
    """Run a coordinator or worker in the foreground until SIGTERM or Ctrl-C, then close
    its metrics endpoint."""
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    try:
        service.run()
    except KeyboardInterrupt:
        pass
    finally:
        if metrics is not None:
            metrics.close()
    return 0


def cmd_coordinator(cfg: CoordinatorConfig) -> int:
    setup_logs(cfg.log_level, cfg.log_format, "coordinator")
    cfg.security = secure(cfg.security, cfg.host, "coordinator")
    coord = _coordinator(cfg)
    return _run(coord, _coordinator_metrics(cfg, coord))


def cmd_worker(cfg: WorkerConfig) -> int:
    if cfg.threads:
        os.environ["NUMBA_NUM_THREADS"] = str(cfg.threads)
    from shadow import security
    from shadow.worker.address import bind_and_advertise
    from shadow.worker.server import Worker

    tuning = cfg.tuning.resolve()
    setup_logs(cfg.log_level, cfg.log_format, "worker")
    cfg.security = secure(cfg.security, bind_and_advertise(cfg.host, cfg.coordinator)[0], f"worker {cfg.worker_id}")
    cfg.transport.check(cfg.security)
    if cfg.transport.data == "ucx":
        from shadow.transport import ucx

        ucx.lib()  # not installed: say so now, not when the data channel opens
    worker = Worker(
        cfg.coordinator,
        host=cfg.host,
        worker_id=cfg.worker_id,
        guard=security.guard_from_config(cfg.security),
        keys=security.client_from_config(cfg.security),
        tuning=tuning,
        local_dir=cfg.local_dir,
        data_mode=cfg.security.data_mode(),
        transport=cfg.transport.data,
    )
    metrics = None
    if cfg.metrics_port:
        from shadow.metrics import WORKER, serve
        from shadow.worker.metrics import samples

        metrics = serve(worker.bind_host, cfg.metrics_port, WORKER, lambda: samples(worker))
    return _run(worker, metrics)


def cmd_cluster(cfg: ClusterConfig) -> int:
    setup_logs(cfg.log_level, cfg.log_format, "cluster")
    cfg.security = secure(cfg.security, cfg.host, "cluster")
    if cfg.shared:
        from shadow.front.server import run_front

        return run_front(cfg)
    cfg.transport.check(cfg.security)
    if cfg.transport.data == "ucx":
        from shadow.transport import ucx

        ucx.lib()  # not installed: say so before any worker starts
    if cfg.coordinator:
        return _workers_part(cfg)
    address = f"tcp://{cfg.host}:{cfg.port}"
    coord = _coordinator(cfg)
    metrics = _coordinator_metrics(cfg, coord)
    stop = threading.Event()

    def shutdown(*_):
        stop.set()
        coord.stop()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    failed: list[BaseException] = []

    def run_coordinator() -> None:
        try:
            coord.run()
        except BaseException as exc:  # said by the command once the workers are stopped
            failed.append(exc)

    thread = threading.Thread(target=run_coordinator, name="coordinator", daemon=True)
    thread.start()
    if cfg.report_file:  # a shared cluster's front started it: it reports, and gives its memory back on SIGUSR1
        from shadow.front.report import Reporter

        signal.signal(signal.SIGUSR1, lambda *_: setattr(coord, "keep_last_asked", True))
        Reporter(cfg.report_file, coord, stop).start()
    workers = _Workers(cfg, address, coord.tuning)
    try:
        while not stop.is_set() and thread.is_alive():
            workers.restart_exited(stop)
            time.sleep(0.2)
    finally:
        coord.stop()
        workers.stop()
        thread.join(timeout=5)
        if metrics is not None:
            metrics.close()
    if failed:  # the coordinator could not start (a port in use) or stopped on an error: not a clean exit
        if isinstance(failed[0], ShadowError):
            raise failed[0]
        raise ShadowError(f"the coordinator stopped: {type(failed[0]).__name__}: {failed[0]}") from failed[0]
    return 0


def _workers_part(cfg: ClusterConfig) -> int:
    """A spread job's part: worker slots ``cfg.slots`` for the coordinator at
    ``cfg.coordinator`` on another host, each restarted when it exits, until SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if cfg.report_file:  # its front or agent sees it is up from this
        from shadow.front.report import Reporter

        Reporter(cfg.report_file, None, stop).start()
    workers = _Workers(cfg, cfg.coordinator, cfg.tuning.resolve())
    try:
        while not stop.is_set():
            workers.restart_exited(stop)
            stop.wait(0.2)
    finally:
        workers.stop()
    return 0


def cmd_agent(cfg: AgentConfig) -> int:
    from shadow.front.agent import run_agent
    from shadow.worker.address import bind_and_advertise

    setup_logs(cfg.log_level, cfg.log_format, "agent")
    cfg.security = secure(cfg.security, bind_and_advertise(cfg.host, cfg.front)[0], "agent")
    cfg.transport.check(cfg.security)
    return run_agent(cfg)


class _Workers:
    """The cluster's worker processes: started with the cluster's tuning, keys and roles,
    and each restarted when it exits, up to ``max_restarts`` times."""

    def __init__(self, cfg: ClusterConfig, address: str, tuning) -> None:
        from shadow.worker import malloc

        self.cfg, self.address = cfg, address
        self.env = {**malloc.environ(), **tuning.environ()}  # the workers run with the cluster's tuning
        sec = cfg.security
        if sec.server_key:  # a worker restarted later checks its key file still holds this pair
            from shadow import security

            self.env[CLUSTER_KEY_ENV] = security.load_secret(sec.server_key)[0].decode()
        # the workers bind with the cluster's pair and admit the same roles; they connect with their own key
        self.security = (
            [
                f"security.{k}={getattr(sec, k)}"
                for k in (
                    "server_key",
                    "client_key",
                    "allow_workers",
                    "allow_trainers",
                    "allow_clients",
                    "allow_admins",
                )
                if getattr(sec, k)
            ]
            + (["security.insecure=true"] if sec.insecure else [])
            + [f"security.data={sec.data}"]
        )
        self.slots = cfg.slot_list()
        self.procs = {slot: self._spawn(slot) for slot in self.slots}
        self.restarts = dict.fromkeys(self.slots, 0)
        logger.info(
            "shadow cluster at %s: %d workers (slots %s, pids %s), %d numba threads each",
            address,
            len(self.slots),
            cfg.slots or f"0-{cfg.workers - 1}",
            [p.pid for p in self.procs.values()],
            cfg.threads(),
        )

    def _spawn(self, slot: int) -> subprocess.Popen:
        cfg = self.cfg
        return subprocess.Popen(
            env=self.env,
            args=[
                sys.executable,
                "-m",
                WORKER_ENTRY,
                "worker",
                f"coordinator={self.address}",
                f"host={cfg.host}",
                f"threads={cfg.threads()}",
                f"log_level={cfg.log_level}",
                f"log_format={cfg.log_format}",
                f"worker_id={slot}",
                f"metrics_port={cfg.metrics_port + 1 + slot if cfg.metrics_port else 0}",
                f"transport.data={cfg.transport.data}",
                *self.security,
            ],
        )

    def restart_exited(self, stop: threading.Event) -> None:
        for slot, p in self.procs.items():
            if p.poll() is None or stop.is_set() or self.restarts[slot] >= self.cfg.max_restarts:
                continue
            self.restarts[slot] += 1
            logger.error(
                "worker %d (pid %d) exited with status %s; restarting it (%d/%d)",
                slot,
                p.pid,
                p.returncode,
                self.restarts[slot],
                self.cfg.max_restarts,
            )
            self.procs[slot] = self._spawn(slot)

    def stop(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
