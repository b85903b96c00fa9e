"""Human-readable status (rich)."""
from __future__ import annotations

import contextlib
import datetime
import sys
from typing import Iterator

from rich.console import Console
from rich.table import Table


@contextlib.contextmanager
def stage(text: str) -> Iterator[None]:
    """A spinner while a long step runs, on a terminal only (quiet in logs and pipes)."""
    if not sys.stderr.isatty():
        yield
        return
    with Console(stderr=True).status(text):
        yield


@contextlib.contextmanager
def byte_progress(text: str) -> Iterator:
    """A progress bar fed ``(done_bytes, total_bytes)``, on a terminal only."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(text, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def render_checkpoints(rows: list[dict], source: str) -> None:
    t = Table(title=f"checkpoints behind {source}")
    for col in ("job", "iteration", "tier", "time", "size", "state", "path"):
        t.add_column(col)
    for r in sorted(rows, key=lambda r: (r["job"], r["iteration"], r["tier"])):
        when = datetime.datetime.fromtimestamp(r["time"]).isoformat(timespec="seconds") if r["time"] else "-"
        size = f"{r['bytes'] / 2**20:.1f} MiB" if r["bytes"] is not None else "-"
        t.add_row(r["job"], str(r["iteration"]), r["tier"], when, size, r["state"], r["path"])
    Console().print(t)


def render_status(st: dict, address: str) -> None:
    console = Console()
    job = st.get("job")
    title = f"shadow cluster {address}: {len(st['workers'])}/{st['expected_workers']} workers"
    if job:
        title += (f" — job {job['name']} epoch {job['epoch']} {job['status']}, committed iteration "
                  f"{job['committed']}, lag {job['lag_iterations']} it / {job['lag_s']} s")
    else:
        title += " — no job attached"
    t = Table(title=title)
    for col in ("worker", "shard", "pid", "range", "applied", "seen", "health", "frames in", "MiB in", "rejected"):
        t.add_column(col)
    for w in st["workers"]:
        rng = f"[{w['start']}, {w['stop']})" if w["start"] is not None else "-"
        health = w["health"] + (f" ({w['stale']})" if w["stale"] else "")
        t.add_row(str(w["id"]), str(w.get("shard", w["id"])), str(w["pid"]), rng, str(w["applied"]), str(w["seen"]),
                  health, str(w["frames_in"]), f"{w['bytes_in'] / 2**20:.1f}", str(sum(w["rejected"].values())))
    console.print(t)
    if job and job.get("reason"):
        console.print(f"DEGRADED: {job['reason']}")
    if st.get("restorable"):
        where = ", ".join(f"{k} iteration {v}" for k, v in st["restorable"].items() if v is not None)
        console.print(f"newest restorable checkpoint: {where or 'none'}")
    sec = st.get("security") or {}
    if sec.get("curve"):
        console.print(f"CURVE on: {sec['accepted']} clients admitted, refused {sec['refused'] or 'none'}")
    for name, tier in (st.get("persist") or {}).items():
        last = tier["last_complete"]
        text = (f"{name} tier {tier['root']}: last complete "
                + (f"iteration {last['iteration']} ({last['bytes'] / 2**20:.1f} MiB)" if last else "none")
                + f", {tier['count']} written this run")
        if tier["last_error"]:
            text += f" — ERROR: {tier['last_error']}"
        console.print(text)
