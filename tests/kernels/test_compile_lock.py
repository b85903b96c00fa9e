"""The host-wide kernel compile lock is waited for a bounded time (issue 52): a process of
another job holding it (hung, stopped, a forked child that inherited it) delays a trainer
rank's calibration at attach by :data:`~shadow.kernels._cache.COMPILE_LOCK_WAIT_S` at most,
and the rank then goes on without it, writing nothing to the shared kernel cache."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shadow.kernels import _cache

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, b"pid %d (the other job)" % os.getpid())
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The lock file lives in ``tmp_path`` (numba's own cache stays where it is)."""
    monkeypatch.setattr(_cache, "cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(_cache, "_stuck", set(), raising=False)
    return tmp_path


@pytest.fixture
def holder(lock_dir: Path) -> Iterator[Callable[[float], subprocess.Popen]]:
    """Start a process that holds the compile lock for the given seconds."""
    procs: list[subprocess.Popen] = []

    def start(seconds: float) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(lock_dir / ".compile.lock"), str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _in_thread(fn: Callable[[], object], limit: float) -> tuple[bool, float, list]:
    """Run ``fn`` on a daemon thread: (whether it returned within ``limit`` seconds, how
    long it took, what it returned or raised)."""
    out: list = []
    t0 = time.monotonic()

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    return not th.is_alive(), time.monotonic() - t0, out


def _saves_enabled() -> bool:
    from numba.core import caching

    return caching.IndexDataCacheFile.save is not _cache._skip_save


def test_a_held_lock_is_waited_for_a_bounded_time_then_the_kernels_go_on_without_it(holder, monkeypatch, caplog):
    other = holder(600)
    monkeypatch.setattr(_cache, "COMPILE_LOCK_WAIT_S", 1.0, raising=False)
    caplog.set_level(logging.INFO, logger=_cache.__name__)

    def body() -> bool:
        with _cache.compile_lock():
            return _saves_enabled()

    done, took, out = _in_thread(body, 20)
    assert done, "compile_lock waited without bound for a lock another process holds"
    assert out == [False], out  # ran without the lock: numba writes nothing to the shared cache
    assert 1.0 <= took < 10, took
    assert _saves_enabled()  # and writes again afterwards
    text = caplog.text
    assert f"pid {os.getpid()} waits for the kernel cache lock" in text and "1 s at most" in text
    assert f"pid {os.getpid()} waited" in text and f"pid {other.pid} (the other job)" in text
    assert "going on without it" in text

    caplog.clear()  # the same process does not wait again for a lock it gave up on
    done, took, out = _in_thread(body, 20)
    assert done and out == [False] and took < 0.9, (done, took, out)
    assert "still cannot take" in caplog.text


def test_a_lock_released_within_the_bound_is_taken(holder, lock_dir, monkeypatch, caplog):
    holder(0.5)
    monkeypatch.setattr(_cache, "COMPILE_LOCK_WAIT_S", 30.0, raising=False)
    caplog.set_level(logging.INFO, logger=_cache.__name__)

    def body() -> tuple[bool, bool]:
        with _cache.compile_lock():
            probe = os.open(lock_dir / ".compile.lock", os.O_RDWR)
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = False
            except BlockingIOError:
                held = True
            finally:
                os.close(probe)
            return held, _saves_enabled()

    done, took, out = _in_thread(body, 25)
    assert done and out == [(True, True)], out  # held by this process, the cache written as before
    assert took < 20
    assert f"pid {os.getpid()} got the kernel cache lock" in caplog.text
    assert (lock_dir / ".compile.lock").read_text().startswith(f"pid {os.getpid()} ")  # named for the next waiter


def test_a_ranks_calibration_at_attach_is_not_held_up_by_another_jobs_lock(holder, monkeypatch, caplog):
    """What a rank runs at attach (the optimizer's description: the fused kernels' widths,
    then the device calibration, each under the lock) finishes while the lock stays held,
    waiting once: so it reaches the coordinator, where the job's other ranks wait for it."""
    import torch

    from trainer_hooks.optim import describe as _optim

    holder(600)
    monkeypatch.setattr(_cache, "COMPILE_LOCK_WAIT_S", 1.0, raising=False)
    caplog.set_level(logging.INFO, logger=_cache.__name__)
    _optim.calibrate.cache_clear()
    opt = torch.optim.Adam([torch.nn.Parameter(torch.randn(10))], lr=1e-3, fused=True)

    done, took, out = _in_thread(lambda: _optim.describe(opt), 120)
    assert done, "the rank's calibration waited without bound for another job's compile lock"
    assert isinstance(out[0], dict) and out[0]["bit_exact"], out
    gave_up = [r.getMessage() for r in caplog.records if "going on without it" in r.getMessage()]
    assert len(gave_up) == 2 and "waited" in gave_up[0] and "still cannot take" in gave_up[1], gave_up


def test_a_starting_worker_is_not_held_up_without_bound(holder, monkeypatch, caplog):
    """Two jobs of one user starting on one host: a worker of the second one compiles (or
    loads) its kernels while the first one's process keeps the lock, after its own bound."""
    from shadow.worker.startup import compile_kernels

    holder(600)
    monkeypatch.setattr(_cache, "WORKER_COMPILE_LOCK_WAIT_S", 1.0, raising=False)
    monkeypatch.setattr(_cache, "COMPILE_LOCK_WAIT_S", 600.0, raising=False)  # the worker's own bound applies
    caplog.set_level(logging.INFO, logger=_cache.__name__)
    ticks: list[float] = []

    def tick(seconds: float) -> bool:
        ticks.append(seconds)
        return True

    done, _, out = _in_thread(lambda: compile_kernels(tick, 0.2), 240)
    assert done, "a starting worker waited without bound for another job's compile lock"
    assert out == [True], out
    assert "going on without it" in caplog.text and "s at most" in caplog.text, caplog.text


def test_the_bound_leaves_room_within_the_attach_timeout():
    """The job's other ranks wait ``connect_timeout_s`` at the coordinator for a rank that is
    still calibrating: the lock's wait leaves most of it for the compilation itself."""
    from shadow.config.tuning import Tuning

    assert 0 < _cache.COMPILE_LOCK_WAIT_S <= Tuning().connect_timeout_s / 2
    assert _cache.WORKER_COMPILE_LOCK_WAIT_S >= _cache.COMPILE_LOCK_WAIT_S  # a cold compile of every kernel
