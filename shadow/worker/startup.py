"""A worker's start-up: its replay kernels are compiled (or loaded from the cache) on a
background thread, one process per host at a time (:func:`shadow.kernels._cache.compile_lock`,
waited for :data:`~shadow.kernels._cache.WORKER_COMPILE_LOCK_WAIT_S` at most), while the
worker tells the coordinator it is starting."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def compile_kernels(tick: Callable[[float], bool], period: float) -> bool:
    """Compile the replay kernels, calling ``tick(seconds so far)`` every ``period``
    seconds meanwhile (it says "starting" and reads the control socket); returns False as
    soon as ``tick`` does (the worker was told to stop). A compile error is raised here."""
    from shadow.kernels import _cache
    from shadow.kernels.replay import warm_up

    t0 = time.monotonic()
    failed: list[BaseException] = []
    compiled: list[int] = []

    def run() -> None:
        try:
            with _cache.compile_lock(_cache.WORKER_COMPILE_LOCK_WAIT_S):
                compiled.append(warm_up())
        except BaseException as exc:  # raised on the worker's own thread below
            failed.append(exc)

    th = threading.Thread(target=run, name="shadow-kernel-warm-up", daemon=True)
    th.start()
    while th.is_alive():
        if not tick(time.monotonic() - t0):
            return False
        th.join(period)
    if failed:
        raise failed[0]
    logger.info(
        "replay kernels %s in %.1f s (cache %s)",
        f"compiled ({compiled[0]})" if compiled[0] else "loaded from the cache",
        time.monotonic() - t0,
        _cache.cache_dir(),
    )
    return True
