"""Shared fixtures: a real local shadow cluster and a 2-rank gloo launcher."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import zmq

from shadow.wire import messages as M

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "tests" / "helpers" / "tiny_trainer.py"


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """A port ``p`` with ``p .. p + n - 1`` all free now (a cluster's workers serve their
    metrics on the ports after the coordinator's)."""
    for _ in range(200):
        base = free_port()
        held = []
        try:
            for p in range(base + 1, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")


def status(address: str, timeout: float = 5.0, keys=None) -> dict:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:  # a CURVE client (shadow.security.ClientKeys)
        keys.apply(s)
    s.connect(address)
    try:
        s.send(M.encode("status"))
        if not s.poll(timeout * 1000):
            raise TimeoutError(f"no status from {address}")
        return M.decode(s.recv())["status"]
    finally:
        s.close(linger=0)


class Cluster:
    def __init__(self, tmp: Path, workers: int = 2, args: tuple[str, ...] = (), env: dict | None = None,
                 port: int | None = None, keys=None) -> None:
        self.keys = keys
        self.port = port or free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.workers = workers
        self.log = tmp / f"cluster-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shadow", "cluster", f"workers={workers}", f"port={self.port}",
             "threads_per_worker=1", *args],
            stdout=open(self.log, "a"), stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, **(env or {})))
        deadline = time.monotonic() + 60
        while True:
            try:
                st = status(self.address, timeout=1.0, keys=keys)
                if sum(1 for w in st["workers"] if w["ready"]) == workers:
                    break
            except TimeoutError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()  # no test holds it yet: nothing else would stop it (and its workers)
                raise RuntimeError(f"shadow cluster did not start:\n{self.log.read_text()}")
            time.sleep(0.2)

    def status(self) -> dict:
        return status(self.address, keys=self.keys)

    def settled(self, quiet: float = 2.0, limit: float = 60.0) -> dict:
        """Status once the committed cut and every worker's progress stop moving
        (messages a killed trainer sent are still being processed for a moment)."""
        def key(st):
            return (st["job"] and st["job"]["committed"],
                    [(w["prepared"], w["applied"], w["seen"], w["frames_in"]) for w in st["workers"]])
        deadline = time.monotonic() + limit
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            st = self.status()
            if key(st) != last:
                last, since = key(st), time.monotonic()
            elif time.monotonic() - since >= quiet:
                return st
            time.sleep(0.1)
        raise TimeoutError("cluster did not settle")

    def kill_all(self) -> None:
        """SIGKILL the coordinator and every worker process."""
        pids = [w["pid"] for w in self.status()["workers"]]
        self.proc.kill()
        self.proc.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


def run_ranks(tmp: Path, *args: str, world: int = 2, env: dict | None = None, timeout: float = 180) -> list[int]:
    """Run the tiny trainer on ``world`` gloo ranks; return their exit codes."""
    port = free_port()
    procs = []
    for r in range(world):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 PYTHONPATH=str(ROOT), **(env or {}))
        log = open(tmp / f"rank{r}-{port}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(TRAINER), *args], env=e, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=ROOT))
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"trainer ranks hung; logs in {tmp}")
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
