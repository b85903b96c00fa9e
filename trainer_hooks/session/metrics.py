"""A trainer rank's Prometheus endpoint: hook time per step, staging ring occupancy,
blocked time, bytes sent (read from the rank's current session at scrape time).

On when ``SHADOW_METRICS_PORT`` is set (each rank serves on that port plus its
``LOCAL_RANK``, on ``SHADOW_METRICS_HOST``, default 127.0.0.1), or by calling
:func:`serve_metrics`. One endpoint per process; it follows the newest session, so it
survives re-attaches.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

from shadow.metrics import TRAINER, MetricsServer, Samples, serve

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_server: MetricsServer | None = None
_session: weakref.ref | None = None


def _samples() -> Samples:
    s = _session() if _session is not None else None
    if s is None:
        return {}
    rank = (str(s.rank),)
    st = s.stats()
    return {
        "shadow_trainer_iteration": [(rank, st["iteration"])],
        "shadow_trainer_committed_iteration": [(rank, st["committed"])],
        "shadow_trainer_hook": [(rank, (st["hook_s"], st["steps"]))],
        "shadow_trainer_blocked_seconds": [(rank, st["blocked_s"])],
        "shadow_trainer_staging_ring_occupancy": [(rank, st["ring_occupancy"])],
        "shadow_trainer_staging_ring_high_water": [(rank, st["ring_high_water"])],
        "shadow_trainer_bytes_sent": [(rank, st["bytes_out"])],
        "shadow_trainer_messages_sent": [(rank, st["messages_out"])],
        "shadow_trainer_degraded": [(rank, 1 if st["degraded"] else 0)],
        "shadow_trainer_unprotected_steps": [(rank, st["unprotected_steps"])],
    }


def serve_metrics(port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve this process's trainer metrics on ``host:port`` (once per process; later
    calls return the running endpoint)."""
    global _server
    with _lock:
        if _server is None:
            _server = serve(host, port, TRAINER, _samples)
        return _server


def publish(session, port: int = 0) -> None:
    """Make ``session`` the one this process's endpoint reports; start the endpoint on
    ``port`` + ``LOCAL_RANK`` if ``port`` (``Tuning.metrics_port``) asks for one."""
    global _session
    _session = weakref.ref(session)
    if port and _server is None:
        port += int(os.environ.get("LOCAL_RANK", "0"))
        try:
            serve_metrics(port, os.environ.get("SHADOW_METRICS_HOST", "127.0.0.1"))
        except OSError as exc:  # metrics are not worth failing an attach over
            logger.error("rank %d: no metrics endpoint (%s); training and checkpointing go on", session.rank, exc)
