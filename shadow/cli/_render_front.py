"""``shadow status`` of a shared cluster (``shadow cluster shared=true``): its budget and
jobs, then each job's cluster as ``shadow status`` shows a cluster of one job."""

from __future__ import annotations

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from shadow.cli._render import _dur, status_panel, stdout_console


def any_panel(st: dict, address: str) -> Group:
    """A shared cluster's :func:`front_panel`, or a cluster's ``status_panel``."""
    return front_panel(st, address) if "front" in st else status_panel(st, address)


def render_any(st: dict, address: str) -> None:
    stdout_console().print(any_panel(st, address))


def front_panel(st: dict, address: str) -> Group:
    f = st["front"]
    t = Table(
        title=f"shared shadow cluster {address}: {len(st['jobs'])} jobs, "
        f"{f['used_bytes'] / 1e9:.2f} of {f['memory_bytes'] / 1e9:.2f} GB and "
        f"{f['cores'] - f['free_cores']} of {f['cores']} cores held"
    )
    for col in ("job", "coordinator", "memory GB", "cores", "up", "trainers"):
        t.add_column(col, justify="right" if col in ("memory GB", "up") else "left")
    parts: list = [t]
    for j in st["jobs"]:
        cores = ",".join(map(str, j["cores"])) or "shared"
        trainers = f"[yellow]ended[/yellow]: {escape(j['ended'])}" if j["ended"] else "running"
        where = f"{j['address']} ({escape(j['host'])})" if j.get("host") else j["address"]
        if j.get("parts"):  # spread over hosts: which slots each runs
            where += "; workers " + ", ".join(
                f"{_slots(p['slots'])} on {escape(p['host']) or 'the front'}" for p in j["parts"]
            )
        t.add_row(escape(j["name"]), where, f"{j['memory_bytes'] / 1e9:.2f}", cores, _dur(j["up_s"]), trainers)
        if j["status"] is not None:
            parts += [Text(""), status_panel(j["status"], f"{j['address']} (job {j['name']})")]
        else:
            parts.append(Text(f"job {j['name']}: its coordinator at {j['address']} has not reported yet"))
    agents = f.get("agents") or []
    if agents:
        a = Table(title=f"{len(agents)} other hosts (shadow agent)")
        for col in ("host", "address", "memory GB", "cores", "jobs", "heard"):
            a.add_column(col, justify="right" if col in ("memory GB", "heard") else "left")
        for h in agents:
            heard = _dur(h["heard_s"]) + (" ago" if h["alive"] else " ago: [red]lost[/red]")
            a.add_row(
                escape(h["name"]),
                escape(h["host"]),
                f"{h['used_bytes'] / 1e9:.2f} of {h['memory_bytes'] / 1e9:.2f}",
                f"{h['cores'] - h['free_cores']} of {h['cores']}",
                escape(", ".join(h["jobs"])) or "-",
                heard,
            )
        parts.insert(1, a)
    if f["refused"]:
        parts.append(Text(f"attaches refused by the front: {f['refused']}"))
    return Group(*parts)


def _slots(slots: list) -> str:
    if len(slots) > 1 and slots[-1] - slots[0] == len(slots) - 1:
        return f"{slots[0]}-{slots[-1]}"
    return ",".join(map(str, slots))
