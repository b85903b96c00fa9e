"""Human-readable status (rich)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


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
    for col in ("worker", "pid", "range", "applied", "seen", "health", "frames in", "MiB in", "rejected"):
        t.add_column(col)
    for w in st["workers"]:
        rng = f"[{w['start']}, {w['stop']})" if w["start"] is not None else "-"
        health = w["health"] + (f" ({w['stale']})" if w["stale"] else "")
        t.add_row(str(w["id"]), str(w["pid"]), rng, str(w["applied"]), str(w["seen"]), health,
                  str(w["frames_in"]), f"{w['bytes_in'] / 2**20:.1f}", str(sum(w["rejected"].values())))
    console.print(t)
