"""Human-readable status (rich)."""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import time
from collections.abc import Iterator

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

PIPE_WIDTH = 100_000  # columns when stdout is not a terminal: wide enough that nothing is cut


def stdout_console() -> Console:
    """The console for results on stdout. On a terminal, its width; in a pipe, a file or
    a CI log, wide enough that tables keep whole headers and cells (rich would otherwise
    assume 80 columns and cut them to ``strat…``) and text lines are not wrapped."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=PIPE_WIDTH)


SHOW_AFTER_S = 1.0  # a spinner or bar appears once a step has taken this long: quick ones stay silent


def on_terminal() -> bool:
    """Whether stderr is a terminal (spinners and bars are shown there only)."""
    return sys.stderr.isatty()


@contextlib.contextmanager
def stage(text: str, after_s: float = SHOW_AFTER_S) -> Iterator[None]:
    """A spinner while a long step runs, shown once it has taken ``after_s`` seconds, on a
    terminal only (quiet in logs and pipes)."""
    if not on_terminal():
        yield
        return
    status = Console(stderr=True).status(text)
    timer = threading.Timer(after_s, status.start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        status.stop()


@contextlib.contextmanager
def byte_progress(text: str, after_s: float = SHOW_AFTER_S) -> Iterator:
    """A progress bar fed ``(done_bytes, total_bytes)``, shown from the first update after
    ``after_s`` seconds, on a terminal only."""
    if not on_terminal():
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TransferSpeedColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bar.add_task(text, total=None)
    t0, shown = time.monotonic(), False
    lock = threading.Lock()  # a restore reports from its fetch threads

    def update(done: int, total: int) -> None:
        nonlocal shown
        with lock:
            if not shown and time.monotonic() - t0 >= after_s:
                bar.start()
                shown = True
            bar.update(task, completed=done, total=total)

    try:
        yield update
    finally:
        with lock:
            if shown:
                bar.stop()


def render_checkpoints(rows: list[dict], source: str) -> None:
    t = Table(title=f"checkpoints behind {source}")
    for col in ("job", "iteration", "tier", "time", "size", "state", "path"):
        t.add_column(col)
    for r in sorted(rows, key=lambda r: (r["job"], -1 if r["iteration"] is None else r["iteration"], r["tier"])):
        when = datetime.datetime.fromtimestamp(r["time"]).isoformat(timespec="seconds") if r["time"] else "-"
        size = f"{r['bytes'] / 2**20:.1f} MiB" if r["bytes"] is not None else "-"
        if r.get("raw_bytes") and r["bytes"] and r["raw_bytes"] != r["bytes"]:
            size += f" (zstd, {r['raw_bytes'] / r['bytes']:.2f}x)"
        state = r["state"] + (f" (gen {r['generation']})" if r.get("generation") else "")
        if r.get("bit_exact") is False:
            state += " (not bit-exact: exact=False)"
        t.add_row(escape(r["job"]), str(r["iteration"]), r["tier"], when, size, state, escape(r["path"]))
    console = stdout_console()
    console.print(t)
    for r in rows:
        if r.get("error"):
            console.print(f"[red]{r['state']}[/red] {escape(r['path'])}: {escape(r['error'])}", highlight=False)


def render_jobs(reply: dict, address: str) -> None:
    """``shadow jobs``: one row per job the cluster knows, the held one first, then what to
    run for a held job whose trainers look gone."""
    window = reply["window_s"]
    t = Table(title=f"jobs of the shadow cluster {address}")
    for col in ("job", "status", "epoch", "world", "committed", f"trainers (heard within {window:g} s)", "restorable"):
        t.add_column(col, justify="right" if col in ("epoch", "world", "committed") else "left")
    notes: list[str] = []
    for j in reply["jobs"]:
        status = j["status"] + (" (held)" if j["held"] else "") + (" (dropped)" if j["dropped"] else "")
        if j["status"] == "attaching":
            trainers = f"{j['ranks_heard']}/{j['world']} arrived"
        elif j["ranks_heard"] is not None:
            trainers = f"{j['ranks_heard']}/{j['world']} heard, last {_dur(j['last_heard_s'])} ago"
            if j["trainers_gone"] and j["status"] != "detached":
                trainers = f"[red]gone[/red]: {trainers}"
        else:
            trainers = "-"
        where = ", ".join(f"{tier} {it}" for tier, it in j["restorable"].items() if it is not None) or "none"
        t.add_row(escape(j["name"]), status, *(_cell(j[k]) for k in ("epoch", "world", "committed")), trainers, where)
        if j["reason"]:
            notes.append(f"{escape(j['name'])}: {escape(j['reason'])}")
        if j["held"] and j["trainers_gone"] and j["status"] != "detached":
            notes.append(
                f"{escape(j['name'])}: its trainers look gone; the next job to attach takes its memory over (its "
                "last iteration written to the local tier first), or "
                f"`shadow drop job={escape(j['name'])} address={address}` detaches it now, keeping its checkpoints"
            )
    console = stdout_console()
    if reply["jobs"]:
        console.print(t)
    else:
        console.print(f"the shadow cluster {address} knows no job: nothing attached, no checkpoint in its tiers")
    for n in notes:
        console.print(n, highlight=False)
    if reply.get("left_out"):
        console.print(f"{reply['left_out']} more jobs known from the tiers were left out (the reply would not fit)")


def _cell(v) -> str:
    return "-" if v is None else str(v)


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    d = max(0.0, time.time() - ts)
    return f"{d:.1f} s ago" if d < 120 else (f"{d / 60:.1f} min ago" if d < 7200 else f"{d / 3600:.1f} h ago")


def _rate(bps: float | None) -> str:
    return "-" if not bps else f"{bps / 2**20:.1f}"


def render_status(st: dict, address: str) -> None:
    """The cluster at a glance: one row per worker, then the job, tiers and security."""
    stdout_console().print(status_panel(st, address))


def status_panel(st: dict, address: str) -> Group:
    """What :func:`render_status` prints, as one renderable (``shadow status watch=``
    redraws it in place): the workers' table, then the job, the tiers and security
    (a shared cluster's: :func:`shadow.cli._render_front.any_panel`)."""
    return Group(_workers_table(st, address), *_job_lines(st.get("job")), *_cluster_lines(st))


_WORKER_COLUMNS = (
    "worker",
    "shard",
    "range",
    "applied",
    "lag (it)",
    "health",
    "MiB/s in",
    "replay ms/it",
    "frames in",
    "rejected",
    "pid",
    "data address",
)
_HEALTH_STYLE = {
    "ok": "green",
    "lost": "red",
    "stale": "yellow",
    "joining": "cyan",
    "out": "magenta",
    "starting": "cyan",
}


def _workers_table(st: dict, address: str) -> Table:
    ready = sum(1 for w in st["workers"] if w.get("ready", True))
    t = Table(
        title=f"shadow cluster {address}: {ready}/{st['expected_workers']} workers ready, "
        f"{st.get('shards', '?')} shards x {st.get('replicas', 1)}"
    )
    for col in _WORKER_COLUMNS:
        t.add_column(col, justify="right" if col not in ("health", "range", "data address") else "left")
    for w in st["workers"]:
        rng = f"[{w['start']}, {w['stop']})" if w["start"] is not None else "-"
        health = w["health"] + (f" ({w['stale']})" if w["stale"] else "")
        if w["health"] == "starting" and w.get("starting_s") is not None:
            health += f" (compiling kernels, {w['starting_s']:.0f} s)"
        style = _HEALTH_STYLE.get(w["health"])
        lag = str(max(0, w["seen"] - w["applied"])) if w["applied"] >= 0 else "-"
        per = w.get("replay_s_per_iteration")
        shard = w.get("shard", w["id"])
        t.add_row(
            str(w["id"]),
            "-" if shard is None else str(shard),
            rng,
            str(w["applied"]),
            lag,
            f"[{style}]{health}[/{style}]" if style else health,
            _rate(w.get("bytes_per_s")),
            f"{per * 1e3:.1f}" if per is not None else "-",
            str(w["frames_in"]),
            str(sum(w["rejected"].values())),
            str(w["pid"]),
            w.get("data") or "-",
        )
    return t


def _job_lines(job: dict | None) -> list[str]:
    if not job:
        return ["no job attached"]
    committed = job.get("committed")
    line = (
        f"job {job['name']} epoch {job['epoch']}: [bold]{job['status']}[/bold], world {job['world']}, "
        f"committed iteration {committed if committed is not None else '- (bootstrapping)'}"
    )
    if committed is not None:
        line += f", lag {job['lag_iterations']} it / {job['lag_s']:.2f} s, reached {_ago(job.get('cut_time'))}"
    out = [line + f", resyncs {job.get('resyncs', 0)}"]
    if job.get("reason"):
        out.append(f"[red]DEGRADED[/red]: {job['reason']}")
    optim = job.get("optim") or {}
    if optim.get("impl"):
        out.append(
            f"replay: {optim.get('kind', '?')} {optim['impl']}, "
            + (
                "bit-exact (checked at attach)"
                if optim.get("bit_exact", True)
                else "[yellow]NOT bit-exact[/yellow] (attached with exact=False: restores may differ from the "
                "trainer by a few ulp per step)"
            )
        )
    audit = job.get("audit") or {}
    if audit.get("checked"):
        out.append(f"audit: {audit['checked']} checked, {audit['mismatches']} mismatches")
    if job.get("diverged") is not None:
        out.append(
            f"[red]DIVERGED[/red] after iteration {job['diverged']}: nothing newer is restorable until the job resyncs"
        )
    return out


def _cluster_lines(st: dict) -> list[str]:
    out = []
    if st.get("restorable"):
        where = ", ".join(f"{k} iteration {v}" for k, v in st["restorable"].items() if v is not None)
        out.append(f"newest restorable checkpoint: {where or 'none'}")
    if not st.get("persist"):
        out.append(
            "no persistence tier: checkpoints are in memory only, and a restarted cluster has none "
            "(persist.durable=true or persist.local.dir= keeps them on disk)"
        )
    for name, tier in (st.get("persist") or {}).items():
        last = tier["last_complete"]
        text = (
            f"{name} tier {tier['root']}: last complete "
            + (
                f"iteration {last['iteration']} ({last['bytes'] / 2**20:.1f} MiB, {_ago(last.get('time'))}"
                + (f", took {last['seconds']:.2f} s" if last.get("seconds") is not None else "")
                + ")"
                if last
                else "none"
            )
            + f"; {tier['count']} written, {tier.get('failures', 0)} failed this run"
        )
        if tier["last_error"]:
            text += f" — [red]ERROR[/red]: {tier['last_error']}"
        out.append(text)
    sec = st.get("security") or {}
    if sec.get("curve"):
        out.append(f"CURVE on: {sec['accepted']} clients admitted, refused {sec['refused'] or 'none'}")
    if st.get("rejected"):
        out.append(f"coordinator refused messages: {st['rejected']}")
    return out


def _dur(s: float) -> str:
    return f"{s:.2f} s" if s < 60 else (f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h")
