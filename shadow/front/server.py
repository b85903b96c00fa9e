"""``shadow cluster shared=true``: the front's socket and loop (:class:`~shadow.front.front.Front`
holds what it decides)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile

import zmq

from shadow import security
from shadow.config import ClusterConfig
from shadow.coordinator.outbox import ZmqOutbox
from shadow.core.errors import ShadowError
from shadow.front.admission import Budget, gb, memory_budget
from shadow.front.front import Front
from shadow.transport import SocketFactory
from shadow.wire import messages as M

logger = logging.getLogger(__name__)


def run_front(cfg: ClusterConfig) -> int:
    """Run a shared cluster's front in the foreground until SIGTERM or Ctrl-C, then stop every
    job's processes. ``cfg.security`` is already resolved (:func:`shadow.cli._services.secure`)."""
    tier = cfg.persist.with_default_tier(cfg.port)  # one tree for every job, whatever port each job gets
    if tier:
        logger.warning(
            "no persistence tier configured: every job's checkpoints are kept in %s every %.0f s; "
            "persist.local.dir= sets another place, persist.durable=false keeps them in memory only",
            tier,
            cfg.persist.local.every_s,
        )
    budget = Budget(memory_budget(cfg.memory_gb), os.sched_getaffinity(0))
    guard = security.guard_from_config(cfg.security)
    out = ZmqOutbox()
    workdir = tempfile.mkdtemp(prefix="shadow-front-")  # 0700: the jobs' configs and reports
    from shadow.coordinator.persistence import Persistence
    from shadow.persist import signing

    sign_key = signing.load_key(cfg.security.manifest_key) if cfg.persist.sign else None
    tuning = cfg.tuning.resolve()
    front = Front(cfg, out, budget, workdir, tiers=lambda: Persistence(cfg.persist, tuning, sign_key))
    address = f"tcp://{cfg.host}:{cfg.port}"
    sock = SocketFactory(zmq.Context.instance(), guard=guard).router(M.socket_limit("front", front.max_bytes))
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # an agent's replaced connection keeps its routing id
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        shutil.rmtree(workdir, ignore_errors=True)
        raise ShadowError(f"the shared cluster's front cannot listen on {address}: {exc}") from None
    out.sock = sock
    metrics = None
    if cfg.metrics_port:  # every job's coordinator metrics, labelled shadow_job
        from shadow.front.report import front_metrics, job_samples
        from shadow.metrics import serve

        def read() -> dict:
            return job_samples({job: procs.report() for job, procs in list(front.jobs.items())})

        metrics = serve(cfg.host, cfg.metrics_port, front_metrics(), read)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    logger.info(
        "shared shadow cluster at %s: %s of memory for jobs, %d cores%s, %d workers per job",
        address,
        gb(budget.memory),
        len(budget.cores),
        f" ({cfg.cores_per_job} per job)" if cfg.cores_per_job else "",
        cfg.workers,
    )
    try:
        while not stopping:
            if sock.poll(200):
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(frames) > 2:
                        continue
                    peer = security.peer_of(frames[-1]) if guard is not None else None
                    parts = [f.bytes for f in frames]
                    front.on_message(parts, peer.role if peer else None, peer.jobs if peer else None)
            front.tick()
    finally:
        front.stop_all()
        if metrics is not None:
            metrics.close()
        sock.close(linger=0)
        if guard is not None:
            guard.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0
