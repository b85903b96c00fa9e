"""Trying a failed resync again (``Session._retry``): when, and whether the cluster is
ready for it."""

from __future__ import annotations

from shadow.config.tuning import Tuning
from shadow.transport.client import ask
from shadow.wire import messages as M

#: after a failed resync, steps until the first try again; each failed try doubles it, up to
#: RETRY_MAX_STEPS
RETRY_FIRST_STEPS = 16
RETRY_MAX_STEPS = 1024


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
