"""What a test can see of the processes it started, from ``/proc`` (Linux): the CPU time a
process and its descendants have used (work moves it; a process blocked on a peer, or hung,
does not), whether a process catches a signal, and whether it sleeps in ``time.sleep``; and
:func:`communicate`, a subprocess's output once it ends, waited for as long as it works."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from typing import Any

from shadow.testing.wait import WaitTimeout, wait_progressing

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _table() -> dict[int, tuple[int, float, float]]:
    """Every process now: pid -> (parent pid, its own CPU seconds, its reaped children's)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:  # ended meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
        ppid, utime, stime, cutime, cstime = int(fields[1]), *(int(x) for x in fields[11:15])
        out[int(name)] = (ppid, (utime + stime) / _TICK, (cutime + cstime) / _TICK)
    return out


def cpu_seconds(root: int, own: bool = True) -> float:
    """CPU seconds (user and system) used by process ``root`` and its descendants alive now,
    and by the children they reaped; ``own`` False leaves out ``root``'s own time (a test
    process measuring what it started, while its polling costs CPU). 0.0 once ``root`` is
    gone."""
    table = _table()
    if root not in table:
        return 0.0
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total = table[root][2] + (table[root][1] if own else 0.0)
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        total += table[pid][1] + table[pid][2]
        stack.extend(children.get(pid, []))
    return total


def cpu_meter(root: int | None = None, own: bool = False, step: float = 1.0) -> Callable[[], int]:
    """A ``progress`` for :func:`~shadow.testing.wait.wait_progressing`: the CPU time of
    ``root`` (default: this process, without its own time: everything it started) and its
    descendants, in whole ``step`` s, so that the few milliseconds idle threads use now and
    then do not count as work."""
    pid = os.getpid() if root is None else root
    return lambda: int(cpu_seconds(pid, own) / step)


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for signal ``sig`` (SigCgt)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


def sleeping(pid: int) -> bool | None:
    """Whether the main thread of process ``pid`` is in a timed sleep (``time.sleep``: the
    kernel's nanosleep), None where the kernel does not say (``/proc/<pid>/wchan``)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip()
    except OSError:
        return None
    if wchan in ("", "0"):
        return None
    return "nanosleep" in wchan


def communicate(
    proc: subprocess.Popen,
    what: str,
    stall: float = 120.0,
    limit: float = 600.0,
    progress: Callable[[], object] | None = None,
) -> tuple[Any, Any]:
    """``proc.communicate()``: its output once it has ended, waited for as long as it works
    (``progress``; default: the CPU time of everything this process started, ``proc`` and a
    cluster it talks to among them, see :func:`cpu_meter`). When that stays put for
    ``stall`` s, or after ``limit`` s, ``proc`` is killed and :class:`WaitTimeout` says so
    with the end of what it wrote."""
    got: list[tuple[Any, Any]] = []

    def ended() -> bool:
        try:
            got.append(proc.communicate(timeout=0.5))  # retried after a timeout, nothing is lost
        except subprocess.TimeoutExpired:
            return False
        return True

    try:
        wait_progressing(ended, progress or cpu_meter(), stall, limit, what, period=0)
    except WaitTimeout as exc:
        proc.kill()
        out, err = proc.communicate()
        said = "\n".join(str(x)[-3000:] for x in (out, err) if x)
        raise WaitTimeout(f"{exc}; killed (pid {proc.pid}); it wrote:\n{said}") from None
    return got[0]
