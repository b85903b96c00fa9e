"""Bounded waits on an explicit condition, instead of sleeping until things look quiet."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition did not hold in time (an AssertionError, so a test reports it as a failure)."""


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
            more = ""
            if detail is not None:
                try:
                    more = f": {detail()}"
                except Exception as exc:  # the detail is for the message only
                    more = f" (and reading the detail failed: {exc})"
            raise WaitTimeout(f"timed out after {timeout:.1f} s waiting for {what}{more}")
        time.sleep(period)
