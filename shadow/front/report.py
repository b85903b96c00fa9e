"""What a job's coordinator tells its shared cluster's front: a JSON file it rewrites each
second (its status and its jobs, as ``shadow status`` and ``shadow jobs`` show them), in the
front's own directory. A file, not a message: the front needs no key of a role to read it,
and a coordinator that stalls shows as an old file, not as a hung request."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

#: seconds between two reports
EVERY_S = 1.0
#: a report older than this many seconds is stale: its coordinator is stalled or gone
STALE_S = 15.0


class Reporter(threading.Thread):
    """Rewrites ``path`` every :data:`EVERY_S` with ``coord``'s status and jobs (None: a
    spread job's part, :func:`part_report`) until ``stop`` is set. Reads the coordinator's
    state without a lock, as its metrics endpoint does; a read that meets a change under way
    is tried at the next beat."""

    def __init__(self, path: str, coord: Any, stop: threading.Event) -> None:
        super().__init__(name="front-report", daemon=True)
        self.path, self.coord, self.stop = path, coord, stop

    def run(self) -> None:
        from shadow.coordinator.jobs import jobs_view
        from shadow.coordinator.metrics import samples

        while not self.stop.wait(EVERY_S):
            try:
                if self.coord is None:  # a spread job's workers on another host: that they are up
                    write(self.path, part_report())
                    continue
                rows, _ = jobs_view(self.coord.state, self.coord.persist)
                report = {
                    "time": time.time(),
                    "pid": os.getpid(),
                    "status": self.coord.status(),
                    "jobs": rows,
                    "last_kept": self.coord.last_kept,  # its last iteration is on the local tier, as asked
                    # its metrics' samples, which the front serves with a shadow_job label
                    "samples": samples(self.coord.state, self.coord.persist, self.coord.guard),
                }
                write(self.path, report)
            except (RuntimeError, ValueError, TypeError):  # a dict changed while read: the next beat
                logger.debug("report skipped", exc_info=True)
            except OSError as exc:
                logger.warning("cannot write the report for the shared cluster's front to %s: %s", self.path, exc)


def part_report() -> dict[str, Any]:
    """The report of a spread job's part with no coordinator (its workers only)."""
    return {"time": time.time(), "pid": os.getpid(), "status": {}, "jobs": [], "last_kept": False, "samples": {}}


def write(path: str, report: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, default=repr)
    os.replace(tmp, path)


def read(path: str) -> dict[str, Any] | None:
    """The newest report at ``path``, or None (none yet, unreadable, or stale)."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or time.time() - float(report.get("time", 0)) > STALE_S:
        return None
    return report


def checked(rep: Any) -> dict[str, Any] | None:
    """A report of a job's coordinator as an agent forwards it, kept to what the front
    reads of one and checked (None when it is not one): an agent holds a worker key, and no
    message it sends may stop the front's loop."""
    if not isinstance(rep, dict):
        return None
    if not (_num(rep.get("time")) and isinstance(rep.get("pid"), int) and isinstance(rep.get("status"), dict)):
        return None
    rows = rep.get("jobs")
    if not isinstance(rows, list) or not all(_row(r) for r in rows):
        return None
    samples = rep.get("samples")
    if not (
        isinstance(samples, dict)
        and all(
            isinstance(k, str)
            and isinstance(v, list)
            and all(
                isinstance(x, list)
                and len(x) == 2
                and isinstance(x[0], list)
                and all(isinstance(label, str) for label in x[0])
                and (_num(x[1]) or (isinstance(x[1], list) and all(_num(y) for y in x[1])))
                for x in v
            )
            for k, v in samples.items()
        )
    ):
        samples = {}
    return {
        "time": float(rep["time"]),
        "pid": rep["pid"],
        "status": rep["status"],
        "jobs": rows,
        "last_kept": bool(rep.get("last_kept")),
        "samples": samples,
    }


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _row(r: Any) -> bool:
    return (
        isinstance(r, dict)
        and isinstance(r.get("name"), str)
        and isinstance(r.get("status"), str)
        and all(r.get(k) is None or _num(r[k]) for k in ("last_heard_s", "epoch", "committed"))
    )


def ended(procs: Any) -> str:
    """Why the trainers of the job ``procs`` runs (:class:`~shadow.front.jobs.JobProcs`) count as gone
    ("" while they run), from its report."""
    rep = procs.report()
    row = next((r for r in (rep["jobs"] if rep else []) if r["name"] == procs.name and r.get("held")), None)
    if row is None:
        return procs.ended_why
    if row["status"] == "detached":
        return "detached"
    if row.get("trainers_gone"):
        return f"no rank heard for {row.get('last_heard_s') or 0:.0f} s"
    return ""


def starting_row(job: str, address: str) -> dict[str, Any]:
    """A ``jobs_reply`` row for a job whose coordinator has not reported yet."""
    return {
        "name": job,
        "held": True,
        "status": "starting",
        "epoch": None,
        "world": None,
        "committed": None,
        "base": None,
        "generation": None,
        "ranks_heard": None,
        "last_heard_s": None,
        "trainers_gone": None,
        "dropped": "",
        "reason": f"its coordinator at {address} is starting",
        "restorable": {"memory": None},
    }


#: the label the front's metrics add to each job's coordinator metrics ("job" is Prometheus's
#: own, the scrape job's)
JOB_LABEL = "shadow_job"


def front_metrics() -> tuple:
    """The coordinator's metrics, each with :data:`JOB_LABEL` first: what a shared
    cluster's front serves for all of its jobs."""
    from dataclasses import replace

    from shadow.metrics import COORDINATOR

    return tuple(replace(m, labels=(JOB_LABEL, *m.labels)) for m in COORDINATOR)


def job_samples(reports: dict[str, dict[str, Any] | None]) -> dict[str, list]:
    """Every job's reported samples (job name -> its report), each labelled with its job."""
    out: dict[str, list] = {}
    for job, rep in reports.items():
        for name, rows in ((rep or {}).get("samples") or {}).items():
            out.setdefault(name, []).extend(
                ((job, *labels), tuple(v) if isinstance(v, list) else v) for labels, v in rows
            )
    return out
