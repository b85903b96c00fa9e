"""What the restore benchmark needs around its measurement: a shadow cluster and helper
processes (127.0.0.1, a free port, every process stopped at the end), page-cache eviction
of checkpoint files, and a bit-for-bit comparison of restored state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shadow.testing import free_port, state_differences, status  # noqa: F401 (free_port: for bench_restore)
from shadow.testing.cluster import CURRENT

ROOT = Path(__file__).resolve().parents[1]


class Services:
    """Every process this script starts; all stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, work: Path, script: str) -> None:
        self.work, self.script = work, script
        self.procs: list[subprocess.Popen] = []
        self.worker_pids: list[int] = []  # of every cluster started
        self.cluster: subprocess.Popen | None = None
        self.logs: list = []

    def start_cluster(
        self, port: int, steps: int, extra: list[str] | None = None, local: Path | None = None, keys=CURRENT
    ) -> str:
        """A ``shadow cluster`` of 2 workers on ``port``, its local tier in ``local`` (default
        ``work/local``); ``keys``: the admin's :class:`~shadow.security.ClientKeys` to ask a
        cluster with keys of its own (its ``security.*`` in ``extra``) whether it is up
        (default: this process's, this user's key set for a default cluster)."""
        address = f"tcp://127.0.0.1:{port}"
        log = open(self.work / f"cluster-{port}.log", "w")  # noqa: SIM115 (closed in stop())
        self.logs.append(log)
        self.cluster = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shadow",
                "cluster",
                "workers=2",
                f"port={port}",
                "host=127.0.0.1",
                "threads_per_worker=1",
                f"persist.local.dir={local or self.work / 'local'}",
                f"persist.local.every_n={steps}",
                "persist.local.keep=1",
                *(extra or []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env=dict(os.environ),
        )
        self.procs.append(self.cluster)
        deadline = time.monotonic() + 90
        while True:
            try:
                st = status(address, 1.0, keys=keys)
                if sum(1 for w in st["workers"] if w.get("ready")) == 2:
                    self.worker_pids += [w["pid"] for w in st["workers"]]
                    return address
            except TimeoutError:
                pass
            if self.cluster.poll() is not None or time.monotonic() > deadline:
                tail = (self.work / f"cluster-{port}.log").read_text()[-3000:]
                raise RuntimeError(f"shadow cluster did not start:\n{tail}")
            time.sleep(0.2)

    def run(self, role: str, argv: list[str], timeout: float, env_extra: dict | None = None) -> None:
        log = self.work / f"{role}.log"
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", ""), TORCH_CPP_LOG_LEVEL="ERROR")
        env.update(env_extra or {})
        if not env["OMP_NUM_THREADS"]:
            del env["OMP_NUM_THREADS"]
        if os.path.exists("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets on loopback
        out = subprocess.PIPE
        if role != "restore":
            out = open(log, "w")  # noqa: SIM115 (closed in stop())
            self.logs.append(out)
        p = subprocess.Popen(
            [sys.executable, self.script, "--role", role, *argv],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )
        self.procs.append(p)
        deadline = time.monotonic() + timeout
        if p.stdout is not None:  # stream the restorer's progress lines
            with open(log, "w") as f:
                for line in p.stdout:
                    f.write(line)
                    print(line, end="", flush=True)
                    if time.monotonic() > deadline:
                        break
        try:
            code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{role} did not finish in {timeout:.0f} s; log: {log}") from None
        if code != 0:
            raise RuntimeError(f"{role} exited with {code}:\n{log.read_text()[-4000:]}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the group: the cluster's workers too
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
        for pid in self.worker_pids:  # in case a worker left the cluster's process group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for f in self.logs:
            f.close()


def wait_persisted(
    address: str, steps: int, limit: float = 120, tiers: tuple[str, ...] = ("local",), keys=CURRENT
) -> dict:
    """The cluster's status once iteration ``steps`` is committed and complete on ``tiers``."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        st = status(address, 5.0, keys=keys)
        done = [((st.get("persist") or {}).get(t) or {}).get("last_complete") for t in tiers]
        if st.get("job") and st["job"]["committed"] == steps and all(lc and lc["iteration"] == steps for lc in done):
            return st
        time.sleep(0.2)
    raise RuntimeError(f"iteration {steps} was not committed and persisted on {tiers} within {limit:.0f} s: {st}")


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def evict(path: Path) -> None:
    """fsync each file under ``path`` and drop its pages from this machine's page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def compare(model, opt, ref: dict) -> list[str]:
    """What differs, bit for bit, between a restored model and optimizer and ``ref``."""
    return state_differences({"model": model.state_dict(), "optimizer": opt.state_dict()}, ref)
