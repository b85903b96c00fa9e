"""A real ``shadow cluster`` on 127.0.0.1 for tests, benchmarks and the fault matrix.

:class:`LocalCluster` starts the coordinator and its workers as ``python -m shadow
cluster`` on a free port, waits until every worker is ready, and always stops all of
them: on a failed start, on :meth:`stop` and on leaving a ``with`` block. Workers that a
test stopped (SIGSTOP) are continued first so that they can exit; any worker process of
this cluster still alive after the coordinator stopped is killed. Only processes whose
command line names this cluster's address are ever signalled."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from shadow.testing.faults import ServiceFaults
from shadow.testing.ports import free_port
from shadow.testing.procs import cpu_seconds
from shadow.testing.wait import wait_progressing, wait_until
from shadow.transport import SocketFactory, fetch_limit
from shadow.wire import messages as M

CURRENT = object()  #: keys: this process's (shadow.security.current_client: this user's key set by default)


def status(address: str, timeout: float = 5.0, keys=CURRENT) -> dict:
    """The coordinator's status at ``address``: one bounded request (``keys``: the
    :class:`shadow.security.ClientKeys` of a CURVE client, None for a keyless cluster; by
    default this process's). Raises TimeoutError."""
    s = (SocketFactory() if keys is CURRENT else SocketFactory(keys=keys)).dealer(address, fetch_limit())
    try:
        s.send(M.encode("status"))
        if not s.poll(int(timeout * 1000)):
            raise TimeoutError(f"no status from {address} within {timeout:.1f} s")
        return M.decode(s.recv())["status"]
    finally:
        s.close(linger=0)


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


#: a test cluster keeps what its test configures: no default tier unless asked (durable=True)
_MEMORY_ONLY = ("persist.durable=false",)

#: status fields that change with no work done: clocks, host memory, connections counted
_RESTLESS = frozenset({"uptime_s", "last_seen_s", "memory", "security", "bytes_per_s"})


def _still(value: object) -> object:
    """``value`` (a status or part of one) without its :data:`_RESTLESS` fields, hashable."""
    if isinstance(value, dict):
        return tuple(sorted((k, _still(v)) for k, v in value.items() if k not in _RESTLESS))
    if isinstance(value, list):
        return tuple(_still(v) for v in value)
    return value


class LocalCluster:
    """``shadow cluster`` with ``workers`` workers of one numba thread each, on a free port
    (or ``port``), logging to ``<tmp>/cluster-<port>.log``. ``args`` are extra config
    overrides (``persist.local.dir=...``), ``env`` extra environment (``SHADOW_*`` knobs),
    ``faults`` the :class:`~shadow.testing.faults.ServiceFaults` its services carry, ``keys``
    the client keys it is asked with (default: this process's, which for a cluster without
    keys of its own is this user's key set; none with ``security.insecure=true``).
    ``durable``: keep the default local tier a ``shadow cluster`` without persistence
    settings keeps (``persist.durable``; under ``<tmp>/data``); off by default here, so
    that a test's cluster holds what the test configures.
    Its start is waited for as long as it moves (workers registering and getting ready, its
    processes using CPU time: importing, compiling kernels); RuntimeError, with the log's last
    error line, when it has not moved for ``start_timeout`` s, or is not up after
    ``start_limit`` s (against a hang). Use it as a context manager, or call :meth:`stop`."""

    def __init__(
        self,
        tmp: Path,
        workers: int = 2,
        args: tuple[str, ...] = (),
        env: dict | None = None,
        port: int | None = None,
        keys=CURRENT,
        threads_per_worker: int = 1,
        start_timeout: float = 60.0,
        faults: ServiceFaults | None = None,
        durable: bool = False,
        start_limit: float = 600.0,
    ) -> None:
        insecure = "security.insecure=true" in args
        self.keys = None if insecure and keys is CURRENT else keys  # a keyless cluster answers keyless clients
        self.port = port or free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.workers = workers
        self.log = Path(tmp) / f"cluster-{self.port}.log"
        self._pids: set[int] = set()
        self._last: dict | None = None  # the last status heard
        self.asked_at = 0.0  # wall time just before the last status request (heard_after_cut)
        entry = "shadow.testing.faulty" if faults else "shadow"
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    entry,
                    "cluster",
                    f"workers={workers}",
                    f"port={self.port}",
                    f"threads_per_worker={threads_per_worker}",
                    *(() if durable or any(a.startswith("persist.durable=") for a in args) else _MEMORY_ONLY),
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                # the default tier (persist.durable) goes under tmp, never this user's data directory
                env=dict(
                    os.environ,
                    XDG_DATA_HOME=str(Path(tmp) / "data"),
                    **(env or {}),
                    **(faults.env() if faults else {}),
                ),
            )
        try:
            wait_progressing(
                self._started,
                self._moves,
                start_timeout,
                start_limit,
                f"{workers} ready workers at {self.address}",
                detail=lambda: self._last,
            )
        except BaseException as exc:
            self.stop()  # no caller holds it yet: nothing else would stop it (and its workers)
            text = self.log.read_text(errors="replace")
            errors = [ln for ln in text.splitlines() if "Error" in ln]
            raise RuntimeError(
                f"shadow cluster did not start ({errors[-1] if errors else exc}); log {self.log}:\n{text[-3000:]}"
            ) from None

    def _started(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"shadow cluster exited with status {self.proc.returncode}")
        try:
            st = status(self.address, timeout=1.0, keys=self.keys)
        except TimeoutError:
            return False
        self._note(st)
        if "front" in st:  # a shared cluster (shared=true): its front answers; each job starts its own workers
            return True
        return sum(1 for w in st["workers"] if w["ready"]) == self.workers

    def _moves(self) -> tuple:
        """What changes while the cluster works: its last status (less what changes by itself)
        and the CPU time of its processes, in whole seconds."""
        return _still(self._last), int(cpu_seconds(self.proc.pid))

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def status(self, timeout: float = 5.0) -> dict:
        self.asked_at = time.time()
        st = status(self.address, timeout=timeout, keys=self.keys)
        self._note(st)
        return st

    def wait_status(self, pred: Callable[[dict], object], timeout: float = 30.0, what: str = "the status") -> dict:
        """The first status for which ``pred(status)`` is truthy (WaitTimeout, with the last
        status, after ``timeout`` s)."""
        last: list[dict] = []

        def check():
            last[:] = [self.status()]
            return last[0] if pred(last[0]) else None

        return wait_until(check, timeout, what, detail=lambda: last[0] if last else None)

    def wait_progress(
        self, pred: Callable[[dict], object], what: str = "the status", stall: float = 120.0, limit: float = 600.0
    ) -> dict:
        """The first status for which ``pred(status)`` is truthy, waited for as long as the
        cluster moves: its status changes (other than clocks and counters of requests) or its
        processes use CPU time. WaitTimeout, with the last status, after ``stall`` s without
        either, or after ``limit`` s."""

        def check():
            if self.proc.poll() is not None:
                raise RuntimeError(f"shadow cluster exited with status {self.proc.returncode}; log {self.log}")
            try:
                st = self.status()
            except TimeoutError:  # busy: its CPU time says whether it works
                return None
            return st if pred(st) else None

        return wait_progressing(check, self._moves, stall, limit, what, detail=lambda: self._last)

    def heard_after_cut(self, st: dict) -> bool:
        """Whether every worker's last heartbeat in ``st``, the status :meth:`status` returned
        last, came after the job's last cut. A worker's ``applied``, ``seen``, ``frames_in``
        and ``rejected`` are what its last heartbeat said: on a cluster that held another job
        before, a heartbeat from before this job's first cut may still speak of that job."""
        job = st["job"]
        if not job or job["cut_time"] is None:
            return False
        # asked_at - last_seen_s is no later than the heartbeat (last_seen_s is in ms)
        return all(self.asked_at - w["last_seen_s"] > job["cut_time"] + 0.001 for w in st["workers"])

    def wait_caught_up(self, iteration: int, timeout: float = 30.0, healthy: bool = True) -> dict:
        """The first status in which the job's committed cut is ``iteration``, every worker
        has applied it, as a heartbeat after the cut says (heartbeats lag the cut a little)
        and, with ``healthy``, every worker is healthy."""

        def ok(st):
            return (
                st["job"]
                and st["job"]["committed"] == iteration
                and all(w["applied"] == iteration and (w["health"] == "ok" or not healthy) for w in st["workers"])
                and self.heard_after_cut(st)
            )

        return self.wait_status(ok, timeout, f"iteration {iteration} committed and applied by every worker")

    def wait_quiet(self, quiet: float = 2.0, limit: float = 60.0) -> dict:
        """Status once the committed cut and every worker's progress have not moved for
        ``quiet`` s. Only for an end state that cannot be known in advance (what a trainer
        killed at a random point had sent is still being processed for a moment); where the
        end state is known, wait for it with :meth:`wait_status` or :meth:`wait_caught_up`."""

        def key(st):
            return (
                st["job"] and st["job"]["committed"],
                [(w["prepared"], w["applied"], w["seen"], w["frames_in"]) for w in st["workers"]],
            )

        deadline = time.monotonic() + limit
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            st = self.status()
            if key(st) != last:
                last, since = key(st), time.monotonic()
            elif time.monotonic() - since >= quiet:
                return st
            time.sleep(0.1)
        raise TimeoutError(f"the cluster at {self.address} did not go quiet within {limit:.0f} s")

    def _note(self, st: dict) -> None:
        self._last = st
        self._pids.update(w["pid"] for w in st.get("workers", []) if w.get("pid"))

    def _signal_workers(self, sig: int) -> None:
        for pid in self._pids:  # only a worker process of this cluster (its command line names the address)
            with contextlib.suppress(OSError):
                if f"coordinator={self.address}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, sig)

    def kill_all(self) -> None:
        """SIGKILL the coordinator and every worker process."""
        with contextlib.suppress(Exception):
            self.status(timeout=2.0)
        self.proc.kill()
        self.proc.wait()
        self._signal_workers(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM the cluster (its workers stop with it), SIGKILL after 15 s, then kill any
        worker of this cluster still alive. Idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.status(timeout=1.0)
        self._signal_workers(signal.SIGCONT)  # a SIGSTOPped worker would not exit on SIGTERM
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._signal_workers(signal.SIGKILL)
