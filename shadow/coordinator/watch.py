"""What the coordinator's loop thread is doing, and for how long: :class:`LoopWatch`.

The loop answers every peer (worker heartbeats, trainer credit, ``status``,
``restore_info``) one message at a time; a handler or periodic step that takes seconds
silences all of them for that long, and a silence past ``SHADOW_WORKER_LOST_S`` /
``SHADOW_COORDINATOR_LOST_S`` looks like a lost coordinator to its peers. The loop marks
each step it runs (:meth:`LoopWatch.begin` / :meth:`LoopWatch.end`, two clock reads); a step
longer than ``slow_s`` is logged with its name when it ends and counted (status ``loop``),
and a thread of its own logs the loop thread's stack while a step is still running after
``stall_s``, so a step that never ends is named too. The watch thread needs the GIL to run:
a step holding it inside C code is named when it ends."""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from typing import Any

logger = logging.getLogger(__name__)

#: a loop step still running after this many times ``slow_s`` has the loop thread's stack logged
STALL_FACTOR = 5.0


class LoopWatch:
    """The step the loop thread runs now (``current``: its name and when it began), the slow
    ones counted.

    Written by the loop thread only; the watch thread (:meth:`start`) and ``status`` read it
    (``current`` is one tuple, replaced whole: a reader never sees one step's name with
    another's start).
    """

    def __init__(self, slow_s: float = 1.0, stall_s: float | None = None) -> None:
        """``slow_s``: a step this long is logged and counted (``tuning.loop_slow_s``; 0: no
        step is timed); ``stall_s``: a step still running this long has its stack logged
        (default :data:`STALL_FACTOR` times ``slow_s``)."""
        self.slow_s = slow_s
        self.stall_s = STALL_FACTOR * slow_s if stall_s is None else stall_s
        self.current: tuple[str, float] | None = None  # (step, monotonic start) running now; None: polling
        self.slow = 0  # steps that took slow_s or longer
        self.longest = (0.0, "")  # (seconds, step) of the longest step so far
        self.last_slow: tuple[float, str, float] | None = None  # (seconds, step, wall time) of the newest slow one
        self._ident: int | None = None  # the loop thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, what: str) -> None:
        self.current = (what, time.monotonic())

    def end(self) -> float:
        """The step begun last has ended; its seconds (logged when slow)."""
        current, self.current = self.current, None
        if current is None:
            return 0.0
        what, took = current[0], time.monotonic() - current[1]
        if self.slow_s and took >= self.slow_s:
            self.slow += 1
            self.last_slow = (round(took, 3), what, time.time())
            if took > self.longest[0]:
                self.longest = (round(took, 3), what)
            logger.warning(
                "coordinator loop: %s took %.1f s; the coordinator answered no peer meanwhile (%d slow steps so far)",
                what,
                took,
                self.slow,
            )
        return took

    def view(self) -> dict[str, Any]:
        """Status ``loop``: the slow steps, the longest, and the one running now if it is late."""
        current = self.current
        late = time.monotonic() - current[1] if current is not None else 0.0
        running = current is not None and bool(self.slow_s) and late >= self.slow_s
        return {
            "slow_steps": self.slow,
            "slow_s": self.slow_s,
            "longest_s": self.longest[0],
            "longest": self.longest[1],
            "last_slow": list(self.last_slow) if self.last_slow else None,
            "running": [current[0], round(late, 3)] if running and current is not None else None,
        }

    def start(self) -> None:
        """Watch the calling thread (the loop's) from a thread of its own (none with ``slow_s`` 0)."""
        self._ident = threading.get_ident()
        if not self.stall_s:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="coordinator-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def _run(self) -> None:
        told: tuple[str, float] | None = None  # the stalled step already logged
        while not self._stop.wait(min(1.0, self.stall_s / 2)):
            current = self.current
            if current is None or time.monotonic() - current[1] < self.stall_s or told == current:
                continue
            told = current
            what, since = current
            frame = sys._current_frames().get(self._ident) if self._ident is not None else None
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
            logger.warning(
                "coordinator loop: %s has run for %.1f s and goes on; the coordinator answers no peer until it "
                "ends; the loop thread is at:\n%s",
                what,
                time.monotonic() - since,
                stack,
            )
