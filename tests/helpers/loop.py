"""The tiny model's training loop (``tests.helpers.tiny_trainer.build``) for tests that drive
DDP in this process: :func:`train_step` is one iteration, on batch ``it``; :func:`train` runs
them in a loop, for a number of steps or until a condition holds, with a callback after each.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def train_step(ddp, opt, sched, it: int) -> None:
    """One iteration of the tiny model on batch ``it``."""
    g = torch.Generator().manual_seed(it)
    x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def train(
    ddp,
    opt,
    sched,
    steps: int | None = None,
    *,
    start: int = 0,
    until: Callable[[], bool] | None = None,
    limit_s: float = 60,
    what: str = "the loop's stop condition never held",
    after: Callable[[int], object] | None = None,
    pause_s: float = 0,
) -> int:
    """Train iterations ``start + 1``, ``start + 2``, ... (:func:`train_step`); return the
    last one trained (``start`` if none).

    ``steps`` iterations, or, with ``until``, as long as ``until()`` does not hold: it is
    checked before each iteration, and an iteration begun ``limit_s`` seconds after the
    call fails the test with ``what``. ``after(it)`` runs after each iteration, then the
    loop sleeps ``pause_s`` seconds."""
    if steps is None and until is None:
        raise TypeError("train() needs steps, until, or both")
    deadline = time.monotonic() + limit_s
    it = start
    while steps is None or it < start + steps:
        if until is not None:
            if until():
                break
            assert time.monotonic() < deadline, what
        it += 1
        train_step(ddp, opt, sched, it)
        if after is not None:
            after(it)
        if pause_s:
            time.sleep(pause_s)
    return it


def resynced(session, epoch: int) -> Callable[[], bool]:
    """A stop condition for :func:`train`: the session has re-attached (an epoch other than
    ``epoch``, the one it trained in when the cluster began to heal)."""
    return lambda: session.epoch != epoch
