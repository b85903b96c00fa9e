"""SIGKILL a trainer at a chosen step, once the shadow has caught up to the step before.

On a loaded machine the shadow workers can run several iterations behind the trainer (a
kernel still compiling, another test's cluster busy). A test that kills its ranks at step
``k`` means "the cluster holds about ``k``"; killing before the workers got there would test
the machine's load, not the restore. So the rank waits, following the cluster's progress, for
``k - 1`` committed (the commit of ``k`` itself may still be in flight, as in a real crash),
and gives up waiting only when the session is degraded or nothing moved for a long time."""

from __future__ import annotations

import logging
import os
import signal
import time

logger = logging.getLogger(__name__)

STILL_S = 120.0  # give up waiting after this long without progress


def kill_self(session=None, step: int | None = None) -> None:
    """SIGKILL this process; first wait for ``session`` (a trainer_hooks Session, or None)
    to have committed ``step - 1``."""
    if session is not None and step is not None:
        last, moved = session.committed, time.monotonic()
        while session.committed < step - 1 and session.degraded is None:
            if session.committed != last:
                last, moved = session.committed, time.monotonic()
            elif time.monotonic() - moved > STILL_S:
                logger.warning("killing at step %d with only %d committed: no progress for %.0f s", step, last, STILL_S)
                break
            time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
