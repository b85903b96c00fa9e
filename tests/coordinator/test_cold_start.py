"""A new user's first run: a cluster whose workers are still compiling their kernels.

Attach waits for it (bounded by SHADOW_CONNECT_TIMEOUT_S) instead of being refused;
status shows each worker's readiness; the kernel cache lives in a user cache directory;
the workers of one host compile once; the demo works from an empty cache.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
import zmq

from shadow.coordinator.server import Coordinator
from shadow.core.errors import ShadowConnectionError
from shadow.core.layout import Layout
from shadow.testing import free_port, status
from shadow.transport.client import LogWaiting, dealer, request
from shadow.wire import messages as M
from tests.conftest import ROOT

LAYOUT = Layout.build([("w", (8, 4), 0, True)], 1)


def _attach_msg(world: int = 1, rank: int = 0) -> bytes:
    return M.encode(
        "attach",
        job="cold",
        rank=rank,
        world=world,
        layout_hash=LAYOUT.hash,
        layout=LAYOUT.to_dict(),
        optim={"kind": "adam"},
        iteration=0,
        overwrite=False,
        restored=None,
    )


@pytest.fixture
def coordinator(keyless):
    port = free_port()
    coord = Coordinator(f"tcp://127.0.0.1:{port}", workers=1)
    th = threading.Thread(target=coord.run, daemon=True)
    th.start()
    yield coord, f"tcp://127.0.0.1:{port}"
    coord.stop()
    th.join(5)


def _recv(sock: zmq.Socket, timeout: float = 5.0) -> dict:
    assert sock.poll(timeout * 1000), "no message"
    return M.decode(sock.recv())


def _say_starting(worker: zmq.Socket, address: str, pid: int, seconds: float) -> dict:
    """A worker still compiling says so; returns the first status that lists it."""
    worker.send(M.encode("starting", pid=pid, worker_id=0, seconds=seconds))
    deadline = time.monotonic() + 5
    while not (st := status(address))["workers"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return st


def test_attach_waits_for_a_worker_still_compiling(coordinator, caplog):
    coord, address = coordinator
    ctx = zmq.Context.instance()
    worker = dealer(ctx, address)
    trainer = dealer(ctx, address)
    try:
        st = _say_starting(worker, address, pid=4242, seconds=1.5)
        assert [(w["id"], w["pid"], w["ready"], w["health"]) for w in st["workers"]] == [(0, 4242, False, "starting")]

        # the attach is held, not refused: the trainer hears how many workers are ready
        trainer.send(_attach_msg())
        msg = _recv(trainer)
        assert msg["t"] == "waiting" and (msg["ready"], msg["expected"], msg["starting"]) == (0, 1, 1)

        # the worker finishes compiling and registers: the attach goes ahead
        worker.send(
            M.encode("register", data="tcp://127.0.0.1:1", serve="tcp://127.0.0.1:2", pid=4242, worker_id=0, memory=-1)
        )
        assert _recv(worker)["t"] == "registered"
        configure = _recv(worker)
        assert configure["t"] == "configure" and configure["job"] == "cold"
        worker.send(M.encode("configured", epoch=configure["epoch"]))
        attached = _recv(trainer)
        assert attached["t"] == "attached" and [w["id"] for w in attached["workers"]] == [0]
        st = status(address)
        assert [(w["id"], w["ready"], w["health"]) for w in st["workers"]] == [(0, True, "ok")]
    finally:
        worker.close(linger=0)
        trainer.close(linger=0)


def test_attach_wait_is_bounded_and_logged(coordinator, caplog):
    """A cluster that never gets ready: the trainer's wait ends after SHADOW_CONNECT_TIMEOUT_S
    with an error naming the count, and it said it was waiting meanwhile."""
    coord, address = coordinator
    ctx = zmq.Context.instance()
    worker = dealer(ctx, address)
    trainer = dealer(ctx, address)
    caplog.set_level("INFO", logger="shadow.transport.client")
    try:
        worker.send(M.encode("starting", pid=4343, worker_id=0, seconds=0.0))
        waiting = LogWaiting("rank 0", address)
        waiting.EVERY_S = 0.5
        t0 = time.monotonic()
        with pytest.raises(ShadowConnectionError) as err:
            request(trainer, address, _attach_msg(), 2.5, ("attached",), interim=waiting)
        took = time.monotonic() - t0
        assert 2.0 < took < 6.0
        assert re.search(r"0 of 1 workers", str(err.value)) and "SHADOW_CONNECT_TIMEOUT_S" in str(err.value)
        lines = [r.getMessage() for r in caplog.records if "waiting for 1 of 1 workers" in r.getMessage()]
        assert len(lines) >= 2, lines
    finally:
        worker.close(linger=0)
        trainer.close(linger=0)


def _cache_dir_in(env: dict) -> str:
    code = (
        "from shadow.kernels import _cache; import numba.core.config as c; "
        "print(_cache.cache_dir()); print(c.CACHE_DIR)"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "SHADOW_CACHE_DIR", "XDG_CACHE_HOME")
    } | env
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    chosen, numba_dir = out.stdout.split()
    assert chosen == numba_dir, out.stdout
    return chosen


def test_kernel_cache_directory(tmp_path):
    assert _cache_dir_in({"SHADOW_CACHE_DIR": str(tmp_path / "s")}) == str(tmp_path / "s" / "numba")
    assert _cache_dir_in({"XDG_CACHE_HOME": str(tmp_path / "x")}) == str(tmp_path / "x" / "shadow" / "numba")
    assert _cache_dir_in({"HOME": str(tmp_path / "h")}) == str(tmp_path / "h" / ".cache" / "shadow" / "numba")
    # numba's own setting wins
    assert _cache_dir_in({"SHADOW_CACHE_DIR": str(tmp_path / "s"), "NUMBA_CACHE_DIR": str(tmp_path / "n")}) == str(
        tmp_path / "n"
    )
    # a directory nobody may write (a read-only install's home) falls back to a temporary one
    blocked = tmp_path / "ro"
    blocked.write_text("a file where a directory should be")
    assert _cache_dir_in({"SHADOW_CACHE_DIR": str(blocked)}).startswith("/") and not _cache_dir_in(
        {"SHADOW_CACHE_DIR": str(blocked)}
    ).startswith(str(blocked))


@pytest.mark.slow
def test_demo_from_an_empty_kernel_cache(tmp_path):
    """The README's first command on a fresh machine: an empty kernel cache, so the cluster
    compiles while the demo waits for it; the workers of the cluster compile once."""
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    res = subprocess.run(
        [sys.executable, "examples/demo.py", "--steps", "8", "--seed", "3", "--keep"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "RESULT: the resumed run equals the uninterrupted run bit for bit" in res.stdout
    work = re.search(r"shadow demo in (\S+)", res.stdout).group(1)
    log = open(os.path.join(work, "cluster.log")).read()
    compiled = re.findall(r"replay kernels compiled", log)
    loaded = re.findall(r"replay kernels loaded from the cache", log)
    assert (len(compiled), len(loaded)) == (1, 1), log[-3000:]
    assert any(cache.rglob("*.nbi")), "the kernels were not cached in NUMBA_CACHE_DIR"
    shutil.rmtree(work, ignore_errors=True)


def test_status_table_shows_starting_workers(coordinator):
    """The rendered table counts ready workers and shows a starting one as such."""
    from rich.console import Console

    from shadow.cli._render import status_panel

    coord, address = coordinator
    ctx = zmq.Context.instance()
    worker = dealer(ctx, address)
    try:
        st = _say_starting(worker, address, pid=4444, seconds=3.0)
    finally:
        worker.close(linger=0)
    console = Console(record=True, width=300)
    console.print(status_panel(st, address))
    text = console.export_text()
    assert "0/1 workers ready" in text and "starting (compiling kernels, 3 s)" in text and "None" not in text
