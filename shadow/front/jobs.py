"""The processes of one admitted job on a shared cluster: a ``shadow cluster`` of its own (a
coordinator on a port of its own and ``workers`` worker processes), pinned to the job's
cores, configured as the shared cluster is but for its port, its threads and its report."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from shadow.config import ClusterConfig
from shadow.core.errors import ShadowError
from shadow.front import report
from shadow.front.admission import Need

logger = logging.getLogger(__name__)

#: the module a job's cluster runs as (``python -m <it> cluster ...``)
CLUSTER_ENTRY = "shadow"
#: times a job's cluster that exits before its first report is started again on a new port
#: (another program took the port between its choice and the bind)
START_TRIES = 3
_numbers = itertools.count()


def free_port(host: str, ports: range | None = None) -> int:
    """A port of ``host`` nothing holds now: any, or the first free one of ``ports``
    (``ShadowError`` when every one is taken)."""
    for port in ports if ports is not None else (0,):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    assert ports is not None  # (port 0 always binds)
    raise ShadowError(
        f"every port of job_ports={ports.start}-{ports.stop - 1} is taken (by this cluster's jobs or other "
        "programs): widen the range, or drop an ended job"
    )


def _child_setup(cores: tuple[int, ...]) -> None:
    """In a job's cluster process before it runs: pinned to ``cores`` (if any), and sent
    SIGTERM when the process that started it (a front, an agent) dies, even by SIGKILL, so
    that its jobs stop with it (they stop their workers) instead of holding memory that
    nothing admits any more."""
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the job outlives a killed front
        pass


#: prctl(2): the signal a process gets when its parent dies
PR_SET_PDEATHSIG = 1


class JobProcs:
    """Job ``name``'s cluster process, started at once (:meth:`start`). ``slots``: the worker
    slots it runs (empty: all); ``join``: the coordinator on another host they join (a spread
    job's part, with no coordinator here; empty: its own)."""

    def __init__(
        self,
        name: str,
        cfg: ClusterConfig,
        need: Need,
        cores: tuple[int, ...],
        workdir: str,
        slots: tuple[int, ...] = (),
        join: str = "",
    ) -> None:
        self.name, self.cfg, self.need, self.cores, self.workdir = name, cfg, need, cores, workdir
        self.slots, self.join = slots, join
        self.index = next(_numbers)  # its files' names (a job name may be any string)
        self.report_path = os.path.join(workdir, f"job-{self.index}.report.json")
        self.since = time.monotonic()
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.tries = 0
        self.reported = False  # a report came: the coordinator is up (a later exit is a crash, not a bind)
        self.ended_why = ""  # why its trainers count as gone ("" while they run)

    @property
    def address(self) -> str:
        return f"tcp://{self.cfg.host}:{self.port}"

    def start(self) -> None:
        self.tries += 1
        self.port = free_port(self.cfg.host, self.cfg.port_range() if self.cfg.job_ports else None)
        cfg = self.cfg
        here = len(self.slots) or cfg.workers
        threads = max(1, len(self.cores) // here) if self.cores else cfg.threads_per_worker
        child = dataclasses.replace(
            cfg,
            shared=False,
            port=self.port,
            metrics_port=0,
            report_file=self.report_path,
            threads_per_worker=threads,
            slots=",".join(map(str, self.slots)),
            coordinator=self.join,
        )
        from omegaconf import OmegaConf

        name = f"job-{self.index}-{self.tries}"
        path = os.path.join(self.workdir, name + ".yaml")
        with open(path, "w") as f:
            f.write("defaults:\n  - shadow_cluster\n  - _self_\n\n" + OmegaConf.to_yaml(OmegaConf.structured(child)))
        cores = self.cores
        self.proc = subprocess.Popen(
            [sys.executable, "-m", CLUSTER_ENTRY, "cluster", "--config-dir", self.workdir, "--config-name", name],
            preexec_fn=lambda: _child_setup(cores),
            start_new_session=True,  # a Ctrl-C at the front's terminal reaches the front, which stops it
        )
        logger.info(
            "job %r: %s and %d workers (pid %d)%s",
            self.name,
            f"workers for its coordinator at {self.join}," if self.join else f"its coordinator at {self.address}",
            here,
            self.proc.pid,
            f", pinned to cores {list(cores)}" if cores else "",
        )

    def report(self) -> dict[str, Any] | None:
        rep = report.read(self.report_path)
        if rep is not None and self.proc is not None and rep.get("pid") == self.proc.pid:
            self.reported = True
            return rep
        return None

    def ask_last(self) -> None:
        """Ask its coordinator to write its last iteration to the local tier (SIGUSR1): its
        memory is wanted; the report's ``last_kept`` says when it is done."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGUSR1)

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def stop(self, wait_s: float = 10.0) -> None:
        """Stop its coordinator and workers (SIGTERM, then SIGKILL after ``wait_s``)."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            logger.warning("job %r: its cluster (pid %d) did not stop in %.0f s; killed", self.name, p.pid, wait_s)
            self.kill()

    def kill(self) -> None:
        """Kill its cluster process and its workers (the process group it leads)."""
        p = self.proc
        if p is None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()
