"""Fixtures: a real local shadow cluster per test (shadow.testing.LocalCluster), a one-rank
process group in this process, and a 2-rank gloo launcher of the tiny trainer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shadow.testing import LocalCluster, free_port

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "tests" / "helpers" / "tiny_trainer.py"


def capture_commits(monkeypatch) -> list:
    """Record the commit bodies this process's trainer sends: ``(iteration, [body per worker])``."""
    from trainer_hooks.session import sender as _sender

    seen = []
    real = _sender.Sender._send_commit

    def spy(self, item):
        seen.append((item.iteration, list(item.bodies)))
        return real(self, item)

    monkeypatch.setattr(_sender.Sender, "_send_commit", spy)
    return seen


def pytest_collection_modifyitems(items):
    """A test that starts a cluster through the ``cluster`` fixture is ``slow`` (the fast
    lane, ``-m "not slow"``, starts no services)."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def cluster(tmp_path):
    with LocalCluster(tmp_path) as c:
        yield c


def run_ranks(tmp: Path, *args: str, world: int = 2, env: dict | None = None, timeout: float = 180) -> list[int]:
    """Run the tiny trainer on ``world`` gloo ranks; return their exit codes."""
    port = free_port()
    procs = []
    for r in range(world):
        e = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
            **(env or {}),
        )
        log = open(tmp / f"rank{r}-{port}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(TRAINER), *args], env=e, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
            )
        )
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"trainer ranks hung; logs in {tmp}") from None
    return codes


def rank_logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("rank*.log")))


@pytest.fixture(scope="session")
def world1(tmp_path_factory):
    """A one-rank gloo process group in the test process (DDP needs one)."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def train_step(ddp, opt, sched, it: int) -> None:
    """One iteration of the tiny model on batch ``it``."""
    g = torch.Generator().manual_seed(it)
    x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    sched.step()
    opt.zero_grad()
