"""An attachment's waits for the cluster's committed cut, each bounded: the throttle after
every step (policy block: wait while this rank is more than ``SHADOW_MAX_LAG`` iterations
ahead, at most ``SHADOW_BLOCK_TIMEOUT_S``; policy skip: fall behind instead), and the
drain at close (the sender sends what is queued, then the cluster commits the last
iteration queued, each at most ``SHADOW_CLOSE_TIMEOUT_S``)."""

from __future__ import annotations

import logging
import threading
import time

from shadow.config.choices import Policy
from trainer_hooks.session.handshake import Handshake
from trainer_hooks.session.items import FlushItem
from trainer_hooks.session.options import AttachOptions
from trainer_hooks.session.recovery import ErrorLatch, RecoveryController
from trainer_hooks.session.sender import Sender

logger = logging.getLogger(__name__)


def throttle(
    k: int, recovery: RecoveryController, latch: ErrorLatch, answer: Handshake, options: AttachOptions
) -> float:
    """After step ``k``, policy block: wait while this rank is more than ``SHADOW_MAX_LAG``
    iterations ahead of the cluster (bounded; past the bound, ``recovery`` takes the error);
    policy skip: fall behind instead of waiting. Returns the seconds waited."""
    lag = options.tuning.max_lag_iterations
    floor = answer.base - 1  # the bootstrap (iteration base) is in flight like any iteration
    rec = recovery
    if k - max(rec.committed, floor) <= lag or rec.degraded is not None:
        return 0.0
    if options.policy is Policy.skip:
        rec.fall_behind(
            k,
            f"iteration {k} is {k - max(rec.committed, floor)} ahead of the cluster's cut "
            f"{rec.committed} (SHADOW_MAX_LAG={lag})",
        )
        return 0.0
    t0 = time.monotonic()
    limit = options.tuning.block_timeout_s
    with latch.cond:
        ok = latch.cond.wait_for(
            lambda: k - max(rec.committed, floor) <= lag or latch.error is not None or rec.degraded is not None,
            limit,
        )
    waited = time.monotonic() - t0
    if not ok:
        rec.on_error(
            f"the shadow cluster has not committed iteration {k - lag} within {limit:.0f} s "
            f"(SHADOW_BLOCK_TIMEOUT_S; last committed: {rec.committed}); check "
            f"`shadow status address={answer.coordinator}`"
        )
    return waited


def drain(sender: Sender, recovery: RecoveryController, latch: ErrorLatch, last: int, timeout: float) -> None:
    """Before a close: ``sender`` sends everything queued, then the cluster commits
    iteration ``last`` (each bounded by ``timeout``, ``SHADOW_CLOSE_TIMEOUT_S``; a
    degraded attachment or a latched error ends the wait). Warns if it did not."""
    done = threading.Event()
    sender.q.put(FlushItem(done))
    done.wait(timeout)
    with latch.cond:
        latch.cond.wait_for(
            lambda: recovery.committed >= last or recovery.degraded is not None or latch.error is not None,
            timeout,
        )
    if recovery.committed < last:
        logger.warning("closing with iteration %d not yet committed (cluster at %d)", last, recovery.committed)
