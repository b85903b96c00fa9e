"""Trying a failed resync again (``Session._retry``): when, and whether the cluster is
ready for it."""

from __future__ import annotations

import threading
import time

from shadow.config.tuning import Tuning
from shadow.transport.client import ask
from shadow.wire import messages as M

#: after a failed resync, steps between tries again (every rank counts the same steps, so all
#: of them try at the same iteration); a try happens only once the probe finds the cluster ready
RETRY_STEPS = 16
#: the shortest handshake a resync gets, whatever its detach took of the block timeout
RESYNC_MIN_S = 1.0
#: seconds between the probe's asks, from a thread of its own (a step never waits on it)
PROBE_EVERY_S = 1.0
#: the probe must have found the cluster ready for this long before a try: every rank probes
#: on its own, and all of them should see it ready at the same step
READY_FOR_S = 2.0


def resync_budget(tuning: Tuning) -> float:
    """How long a resync (its detach and handshake) may hold the training step:
    SHADOW_CONNECT_TIMEOUT_S, or SHADOW_BLOCK_TIMEOUT_S if that is shorter (a step never
    waits on the shadow past it; a resync that fails is tried again, ``Session._retry``)."""
    return min(tuning.connect_timeout_s, tuning.block_timeout_s)


def cluster_not_ready(coordinator: str, tuning: Tuning, job: str | None = None) -> str | None:
    """Why re-attaching now would only wait (the coordinator does not answer within a
    couple of seconds, or not every worker is ready), or None. ``job``: the job whose
    coordinator is asked (a shared cluster's front sends the request on to it)."""
    try:
        payload = M.encode("status", **({"job": job} if job else {}))
        st = ask(coordinator, payload, 2.0, ("status_reply",), tuning)["status"]
    except Exception as exc:
        return f"the coordinator did not answer ({exc})"
    ready = sum(1 for w in st["workers"] if w.get("ready") and w.get("health") != "starting")
    if ready < st["expected_workers"]:
        return f"{ready} of {st['expected_workers']} workers ready"
    return None


class Prober:
    """Asks, every :data:`PROBE_EVERY_S` from a thread of its own, whether the cluster is
    ready (:func:`cluster_not_ready`) while a failed resync waits to be tried again: a
    partition that heals is seen within seconds, however long it lasted, and no training step
    waits on a coordinator that does not answer."""

    def __init__(self, coordinator: str, tuning: Tuning, job: str | None = None) -> None:
        self.coordinator, self.tuning, self.job = coordinator, tuning, job
        self.why: str | None = "not asked yet"
        self.ready_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shadow-resync-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            why = cluster_not_ready(self.coordinator, self.tuning, self.job)
            if why is not None:
                self.ready_since = None
            elif self.ready_since is None:
                self.ready_since = time.monotonic()
            self.why = why
            self._stop.wait(PROBE_EVERY_S)

    def not_ready(self) -> str | None:
        """Why not to try now, or None: the cluster has been found ready for :data:`READY_FOR_S`."""
        since = self.ready_since
        if since is None:
            return self.why
        if time.monotonic() - since < READY_FOR_S:
            return f"found ready {time.monotonic() - since:.1f} s ago, less than {READY_FOR_S:.0f} s"
        return None

    def stop(self) -> None:
        self._stop.set()
