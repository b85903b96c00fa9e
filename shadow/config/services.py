"""The services' configs: the coordinator, a cluster of workers, a worker, the data transport."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from shadow.config.checks import check_endpoint, check_log, check_metrics_port, check_port, check_shape
from shadow.config.choices import LogFormat, LogLevel
from shadow.config.security import SecurityConfig
from shadow.config.tiers import PersistConfig
from shadow.config.tuning import TuningConfig, check_section

DATA_TRANSPORTS = ("zmq", "ucx")


@dataclass
class TransportConfig:
    """How gradients travel from the trainers to the workers (the control plane is ZeroMQ)."""

    #: zmq (the default) or ucx (RDMA fabrics through UCX; needs the extra shadow-checkpoint[ucx])
    data: str = "zmq"

    def __post_init__(self) -> None:
        if self.data not in DATA_TRANSPORTS:
            raise ValueError(
                f"transport.data={self.data!r} is not one of {DATA_TRANSPORTS}: zmq (ZeroMQ over TCP, the "
                "default) or ucx (UCX: InfiniBand, RoCE, EFA or TCP; pip install 'shadow-checkpoint[ucx]')"
            )

    def check(self, security: SecurityConfig) -> None:
        """UCX carries no CURVE: a keyed cluster streams over UCX with per-rank MACs."""
        if self.data == "ucx" and security.server_key and security.data == "curve":
            raise ValueError(
                "transport.data=ucx cannot go with security.data=curve: UCX carries no CURVE encryption. "
                "Use security.data=mac (every frame under its rank's MAC) or transport.data=zmq"
            )


@dataclass
class CoordinatorConfig:
    """The coordinator alone (workers join by its address)."""

    workers: int = 2  #: worker slots (workers / replicas shards)
    replicas: int = 1  #: workers holding each shard (2: losing one loses nothing; it recopies from its peer)
    host: str = "127.0.0.1"  #: interface to bind (127.0.0.1 keeps the cluster local; 0.0.0.0 = every interface)
    port: int = 5555  #: coordinator port
    metrics_port: int = 0  #: Prometheus /metrics port (0 = off)
    log_level: LogLevel = LogLevel.INFO  #: DEBUG, INFO, WARNING or ERROR
    log_format: LogFormat = LogFormat.text  #: text (one line per event) or json (one JSON object per line)
    persist: PersistConfig = field(default_factory=PersistConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tuning: Any = field(default_factory=TuningConfig)  #: knobs (shadow.config.tuning.Tuning); the workers get them too

    def __post_init__(self) -> None:
        check_shape(self.workers, self.replicas)
        check_section(self.tuning)
        check_port(self.port)
        check_metrics_port(self.metrics_port)
        check_log(self)
        if self.persist.sign and not self.security.manifest_key:
            raise ValueError(
                "persist.sign=true needs security.manifest_key: a file holding the signing key "
                "(make one with `head -c 32 /dev/urandom > manifest.key && chmod 600 manifest.key`)"
            )


@dataclass
class ClusterConfig(CoordinatorConfig):
    """A coordinator plus ``workers`` worker processes on this host (foreground). With
    ``metrics_port`` set, worker ``i`` serves its metrics on ``metrics_port + 1 + i``."""

    threads_per_worker: int = 0  #: numba threads per worker; 0 = cores / workers
    max_restarts: int = 10  #: times a dead worker process is restarted (it then resyncs)
    transport: TransportConfig = field(default_factory=TransportConfig)
    #: several jobs at once: port= is a front that admits each job and runs a coordinator and
    #: ``workers`` workers for it alone (docs/operations.md, "A cluster for several jobs")
    shared: bool = False
    memory_gb: float = 0.0  #: shared: memory the jobs may hold on this host (0 = 80% of what is free at start)
    cores_per_job: int = 0  #: shared: cores each job's workers are pinned to, apart from other jobs' (0 = not pinned)
    #: shared: the ports the jobs' coordinators listen on, ``LO-HI`` (a firewall or a
    #: Kubernetes Service opens that range); empty = any free port
    job_ports: str = ""
    #: a file the coordinator rewrites each second with its status and jobs (JSON): set by a
    #: shared cluster's front for the coordinators it starts
    report_file: str = ""
    #: the worker slots this host runs (``0-3``, ``4,6``; empty = all ``workers``): a job spread
    #: over several hosts runs some of its slots on each (a shared cluster's front sets it)
    slots: str = ""
    #: a coordinator on another host whose workers (``slots``) this runs, with no coordinator
    #: here: a spread job's part (a shared cluster's front or agent sets it); empty = its own
    coordinator: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.transport.check(self.security)
        self.slot_list()
        if self.coordinator:
            check_endpoint("coordinator", self.coordinator)
        if self.shared and (self.slots or self.coordinator):
            raise ValueError("slots= and coordinator= are a spread job's part, which the front sets; not shared=true's")
        if self.threads_per_worker < 0:
            raise ValueError(f"threads_per_worker={self.threads_per_worker} must be >= 0 (0 = automatic)")
        if self.memory_gb < 0:
            raise ValueError(f"memory_gb={self.memory_gb} must be >= 0 (0 = 80% of the memory free at start)")
        if self.job_ports:
            self.port_range()
        cores = len(os.sched_getaffinity(0))
        if not 0 <= self.cores_per_job <= cores:
            raise ValueError(
                f"cores_per_job={self.cores_per_job} must be between 0 (not pinned) and {cores}, the cores here"
            )
        self.security.check_workers_key("shadow cluster")
        if self.metrics_port and self.metrics_port + self.workers >= 65536:
            raise ValueError(
                f"metrics_port={self.metrics_port} leaves no port for worker {self.workers - 1} "
                f"(metrics_port + 1 + i); use a port below {65535 - self.workers}"
            )

    def port_range(self) -> range:
        """``job_ports`` as a range (ValueError naming the key when it is not ``LO-HI``)."""
        lo, _, hi = self.job_ports.partition("-")
        if not (lo.isdigit() and hi.isdigit() and 0 < int(lo) <= int(hi) < 65536):
            raise ValueError(f"job_ports={self.job_ports!r} must be a range of ports LO-HI, such as 6000-6015")
        if self.port in range(int(lo), int(hi) + 1):
            raise ValueError(f"job_ports={self.job_ports} holds port={self.port}, the front's own; move one of them")
        return range(int(lo), int(hi) + 1)

    def slot_list(self) -> list[int]:
        """``slots`` as worker slots, every one of ``range(workers)`` when empty (ValueError
        naming the key when it is not a list of slots below ``workers``)."""
        if not self.slots:
            return list(range(self.workers))
        out: list[int] = []
        for item in self.slots.split(","):
            lo, dash, hi = item.strip().partition("-")
            if not (lo.isdigit() and (hi.isdigit() or not dash)) or int(hi or lo) < int(lo):
                raise ValueError(f"slots={self.slots!r} must be worker slots such as 0-3 or 4,6 (empty = all)")
            out += range(int(lo), int(hi or lo) + 1)
        if len(set(out)) != len(out) or not out or not all(0 <= s < self.workers for s in out):
            raise ValueError(f"slots={self.slots!r} must name each worker slot once, each below workers={self.workers}")
        return out

    def threads(self) -> int:
        n = len(self.slot_list())
        return self.threads_per_worker or max(1, (os.cpu_count() or 1) // n)


@dataclass
class AgentConfig(ClusterConfig):
    """A host that runs jobs for a shared cluster's front (``shadow cluster shared=true`` on
    another host): the front places each job it admits on the host with the most memory free
    (its own or an agent's), and the agent runs that job's coordinator and workers here, as
    the front runs them on its own host. The cluster's keys apply to those jobs: ``host``
    (the interface they bind; ``auto``, the default, binds the one that routes to the
    front, and ``0.0.0.0`` binds every one and advertises that route), ``memory_gb``,
    ``cores_per_job``, ``job_ports``, ``persist`` (this host's local tier), ``security``
    (the cluster's pair and allow lists, and a worker key to reach the front); ``workers``
    and ``replicas`` per job are the front's."""

    #: the shared cluster's front this host serves (tcp://HOST:PORT)
    front: str = ""
    host: str = "auto"  #: interface the jobs here bind (auto = the one that routes to the front; 0.0.0.0 = every one)
    #: this host's name in the front's status and refusals (empty = its hostname)
    name: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.front:
            raise ValueError("front= is required: the shared cluster's front to serve (tcp://HOST:PORT)")
        check_endpoint("front", self.front)
        if self.shared:
            raise ValueError("shared=true is the front's setting; an agent serves a front (front=tcp://HOST:PORT)")
        if self.slots or self.coordinator:
            raise ValueError("slots= and coordinator= are set by the front for each job's part; not an agent's")
        if self.name and not _NAME.fullmatch(self.name):
            raise ValueError(
                f"name={self.name!r} must be 1-64 letters, digits, '.', '_' or '-' (or empty: this host's name)"
            )

    def cluster(self, workers: int, replicas: int) -> ClusterConfig:
        """The config of one job's cluster on this host: these keys but for the front's job shape."""
        own = {f.name: getattr(self, f.name) for f in fields(ClusterConfig)}
        return ClusterConfig(**{**own, "workers": workers, "replicas": replicas, "shared": False})


#: an agent's name
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass
class WorkerConfig:
    """One worker joining a coordinator: the coordinator address is all it needs."""

    coordinator: str = "tcp://127.0.0.1:5555"  #: the coordinator's address
    host: str = (
        "auto"  #: interface for this worker's data and serve sockets; auto = the one that routes to the coordinator
    )
    threads: int = 0  #: numba threads; 0 = all cores
    metrics_port: int = 0  #: Prometheus /metrics port (0 = off)
    log_level: LogLevel = LogLevel.INFO  #: DEBUG, INFO, WARNING or ERROR
    log_format: LogFormat = LogFormat.text  #: text or json
    worker_id: int = -1  #: the shard slot this worker (re)takes; -1 = the next free one
    #: this worker's own directory for the local tier, on its host's disk (node-local); empty = the
    #: cluster's persist.local.dir. Manifests record which disk holds each shard
    local_dir: str = ""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tuning: Any = field(default_factory=TuningConfig)  #: knobs (shadow.config.tuning.Tuning)
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        check_endpoint("coordinator", self.coordinator)
        self.transport.check(self.security)
        check_section(self.tuning)
        if self.threads < 0:
            raise ValueError(f"threads={self.threads} must be >= 0 (0 = all cores)")
        if not self.host:
            raise ValueError("host= is empty; give an interface address or host=auto")
        check_metrics_port(self.metrics_port)
        check_log(self)
        self.security.check_workers_key("shadow worker")
