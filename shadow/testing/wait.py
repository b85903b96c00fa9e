"""Bounded waits on an explicit condition, instead of sleeping until things look quiet.

:func:`wait_until` waits a fixed time. :func:`wait_progressing` waits as long as what it waits
for moves (a status changing, processes using CPU time), with a cap only against a hang: a
loaded machine makes the work slower, not the test fail."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition did not hold in time (an AssertionError, so a test reports it as a failure)."""


def _detail(detail: Callable[[], object] | None) -> str:
    if detail is None:
        return ""
    try:
        return f": {detail()}"
    except Exception as exc:  # the detail is for the message only
        return f" (and reading the detail failed: {exc})"


def wait_until(
    pred: Callable[[], T],
    timeout: float = 30.0,
    what: str = "the condition",
    period: float = 0.1,
    detail: Callable[[], object] | None = None,
) -> T:
    """Call ``pred`` every ``period`` s until it returns something truthy, and return that.
    After ``timeout`` s, raise :class:`WaitTimeout` naming ``what`` (and ``detail()``, such
    as the last status, where given). An exception from ``pred`` propagates."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:.1f} s waiting for {what}{_detail(detail)}")
        time.sleep(period)


def wait_progressing(
    pred: Callable[[], T],
    progress: Callable[[], object],
    stall: float = 120.0,
    limit: float = 600.0,
    what: str = "the condition",
    period: float = 0.2,
    detail: Callable[[], object] | None = None,
) -> T:
    """Call ``pred`` every ``period`` s until it returns something truthy, and return that,
    for as long as what it waits for moves: ``progress()`` describes it (a status's counters,
    a log's size, the CPU seconds of the processes doing the work: see
    :func:`shadow.testing.procs.cpu_meter`), and every change of its value restarts the
    clock. Raise :class:`WaitTimeout` naming ``what``, the last ``progress()`` and
    ``detail()`` when it has not changed for ``stall`` s, or after ``limit`` s in all (a hang
    that keeps moving). An exception from ``pred`` or ``progress`` propagates."""
    start = time.monotonic()
    last, moved = progress(), start
    while True:
        got = pred()
        if got:
            return got
        now, seen = time.monotonic(), progress()
        if seen != last:
            last, moved = seen, now
        elif now - moved >= stall:
            raise WaitTimeout(
                f"waited {now - start:.1f} s for {what}, the last {now - moved:.1f} s without progress "
                f"(still {last!r}){_detail(detail)}"
            )
        if now - start >= limit:
            raise WaitTimeout(
                f"waited {limit:.1f} s for {what}, the cap against a hang, though it kept moving "
                f"(last {last!r}){_detail(detail)}"
            )
        if period > 0:
            time.sleep(period)
