"""Typed configuration for every command, validated at construction.

The CLI merges ``key=value`` overrides onto these dataclasses with OmegaConf (the
engine under Hydra), so a wrong type or value is an error that names the key.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Optional

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("torch", "dcp", "safetensors")
COMPRESSIONS = ("none", "zstd")


def _check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise ValueError(f"port={port} is not a TCP port; use 1-65535")


def _check_level(level: str) -> None:
    if level.upper() not in LOG_LEVELS:
        raise ValueError(f"log_level={level!r} is not one of {LOG_LEVELS}")


def _check_endpoint(key: str, value: str) -> None:
    if not value.startswith(("tcp://", "ipc://")):
        raise ValueError(f"{key}={value!r} is not a ZeroMQ endpoint; use e.g. tcp://127.0.0.1:5555")


@dataclass
class TierConfig:
    """When a persistence tier takes a checkpoint (any due schedule triggers) and how many
    it keeps."""

    every_n: int = 100  #: iterations between checkpoints (0 = not by iterations)
    every_s: float = 0.0  #: seconds between checkpoints (0 = not by time)
    every_tokens: int = 0  #: tokens between checkpoints, as reported by the trainer (0 = not by tokens)
    keep: int = 3  #: complete checkpoints to retain (0 = keep all)
    compress: str = "none"  #: "none" or "zstd" (lossless: float bytes split into planes, then zstd)
    compress_level: int = 3  #: zstd level, 1 (fastest) to 19

    @property
    def location(self) -> str:
        raise NotImplementedError

    def __post_init__(self) -> None:
        for key in ("every_n", "every_s", "every_tokens", "keep"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 0")
        if self.compress not in COMPRESSIONS:
            raise ValueError(f"compress={self.compress!r} is not supported; choose one of {COMPRESSIONS}")
        if not 1 <= self.compress_level <= 19:
            raise ValueError(f"compress_level={self.compress_level} must be 1 (fastest) to 19 (smallest)")
        if self.location and not (self.every_n or self.every_s or self.every_tokens):
            raise ValueError(f"tier at {self.location!r} has no schedule: set every_n, every_s or every_tokens")

    @property
    def enabled(self) -> bool:
        return bool(self.location)


@dataclass
class LocalTierConfig(TierConfig):
    dir: str = ""  #: directory on the workers' local disk (empty = tier off)

    @property
    def location(self) -> str:
        return self.dir


@dataclass
class RemoteTierConfig(TierConfig):
    url: str = ""  #: shared-file-system path or fsspec URL, filled from the local tier (empty = off)
    every_n: int = 1000

    @property
    def location(self) -> str:
        return self.url


@dataclass
class PersistConfig:
    """Persistence tiers: ``local`` (a directory the workers write) and ``remote`` (copied
    from the local tier by the workers, any fsspec URL)."""

    local: LocalTierConfig = field(default_factory=LocalTierConfig)
    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)

    def __post_init__(self) -> None:
        if self.remote.enabled and not self.local.enabled:
            raise ValueError("persist.remote.url needs persist.local.dir: the remote tier is copied from the local one")
        if "://" in self.local.dir and not self.local.dir.startswith("file://"):
            raise ValueError(f"persist.local.dir={self.local.dir!r} must be a local directory")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SecurityConfig:
    """ZeroMQ CURVE authentication and encryption (all empty = off). Make keys with
    ``shadow keygen``; servers (cluster, coordinator, worker) set ``server_key`` and ``allow``,
    clients (status, restore, ls) set ``server_public`` and ``client_key``."""

    server_key: str = ""  #: the cluster's secret key file (name.key_secret), for coordinator and workers
    allow: str = ""  #: directory of allowed client public keys (*.key); required with server_key
    server_public: str = ""  #: the cluster's public key file (name.key), for clients
    client_key: str = ""  #: this client's secret key file (name.key_secret)

    def __post_init__(self) -> None:
        if self.server_key and not self.allow:
            raise ValueError(f"security.server_key={self.server_key!r} needs security.allow: a directory of the "
                             "clients' public .key files (e.g. security.allow=keys/clients)")
        if self.allow and not self.server_key:
            raise ValueError(f"security.allow={self.allow!r} needs security.server_key: the cluster's "
                             ".key_secret file (make one with `shadow keygen dir=keys name=server`)")
        if self.client_key and not self.server_public:
            raise ValueError(f"security.client_key={self.client_key!r} needs security.server_public: the "
                             "cluster's public .key file (e.g. security.server_public=keys/server.key)")
        if self.server_public and not (self.client_key or self.server_key):
            raise ValueError(f"security.server_public={self.server_public!r} needs security.client_key: this "
                             "client's .key_secret file (make one with `shadow keygen dir=keys name=CLIENT`)")

    @property
    def enabled(self) -> bool:
        return bool(self.server_key or self.client_key)


@dataclass
class KeygenConfig:
    """Where ``shadow keygen`` writes a CURVE key pair."""

    dir: str = "keys"  #: directory for name.key and name.key_secret (created if missing)
    name: str = "server"  #: file stem: "server" for the cluster pair, a client's name otherwise
    overwrite: bool = False  #: replace an existing pair (holders of the old key stop working)

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("dir= is empty; give the directory for the key files, e.g. dir=keys")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"name={self.name!r} is not a file stem; use e.g. name=server or name=trainer0")


@dataclass
class ClusterConfig:
    """A coordinator plus ``workers`` worker processes on this host (foreground)."""

    workers: int = 2  #: number of shadow worker processes (workers / replicas shards)
    replicas: int = 1  #: workers holding each shard (2: losing one loses nothing; it recopies from its peer)
    host: str = "127.0.0.1"  #: interface to bind (127.0.0.1 keeps the cluster local)
    port: int = 5555  #: coordinator port
    threads_per_worker: int = 0  #: numba threads per worker; 0 = cores / workers
    log_level: str = "INFO"
    max_restarts: int = 10  #: times a dead worker process is restarted (it then resyncs)
    persist: PersistConfig = field(default_factory=PersistConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}: a cluster needs at least 1 worker")
        if self.replicas < 1 or self.workers % self.replicas:
            raise ValueError(f"replicas={self.replicas} must be >= 1 and divide workers={self.workers}; "
                             f"e.g. workers={2 * self.workers} replicas=2")
        _check_port(self.port)
        if self.threads_per_worker < 0:
            raise ValueError(f"threads_per_worker={self.threads_per_worker} must be >= 0 (0 = automatic)")
        _check_level(self.log_level)

    def threads(self) -> int:
        return self.threads_per_worker or max(1, (os.cpu_count() or 1) // self.workers)


@dataclass
class CoordinatorConfig:
    """The coordinator alone (workers join by its address)."""

    workers: int = 2
    replicas: int = 1  #: workers holding each shard (must divide workers)
    host: str = "127.0.0.1"
    port: int = 5555
    log_level: str = "INFO"
    persist: PersistConfig = field(default_factory=PersistConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}: a cluster needs at least 1 worker")
        if self.replicas < 1 or self.workers % self.replicas:
            raise ValueError(f"replicas={self.replicas} must be >= 1 and divide workers={self.workers}; "
                             f"e.g. workers={2 * self.workers} replicas=2")
        _check_port(self.port)
        _check_level(self.log_level)


@dataclass
class WorkerConfig:
    """One worker joining a coordinator."""

    coordinator: str = "tcp://127.0.0.1:5555"
    host: str = "127.0.0.1"  #: interface this worker binds its data and serve sockets on
    threads: int = 0  #: numba threads; 0 = all cores
    log_level: str = "INFO"
    worker_id: int = -1  #: the shard slot this worker (re)takes; -1 = the next free one
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        _check_endpoint("coordinator", self.coordinator)
        if self.threads < 0:
            raise ValueError(f"threads={self.threads} must be >= 0 (0 = all cores)")
        _check_level(self.log_level)


@dataclass
class StatusConfig:
    address: str = "tcp://127.0.0.1:5555"
    json: bool = False
    timeout: float = 5.0
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        _check_endpoint("address", self.address)
        if self.timeout <= 0:
            raise ValueError(f"timeout={self.timeout} must be positive (seconds)")


def _check_source(value: str) -> None:
    if not value:
        raise ValueError("source= is required: a coordinator address (tcp://host:port), a checkpoint "
                         "directory or an fsspec URL")


@dataclass
class RestoreConfig:
    source: str = "tcp://127.0.0.1:5555"  #: coordinator address, checkpoint directory or fsspec URL
    out: str = "checkpoint.pt"
    format: str = "torch"  #: torch | dcp | safetensors
    job: Optional[str] = None
    iteration: Optional[int] = None  #: a specific iteration (default: newest complete)
    timeout: float = 30.0
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        _check_source(self.source)
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r} is not supported; choose one of {FORMATS}")
        if self.timeout <= 0:
            raise ValueError(f"timeout={self.timeout} must be positive (seconds)")


@dataclass
class ListConfig:
    source: str = "tcp://127.0.0.1:5555"  #: coordinator address, checkpoint directory or fsspec URL
    job: Optional[str] = None
    json: bool = False
    timeout: float = 5.0
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        _check_source(self.source)


@dataclass
class VerifyConfig:
    source: str = ""  #: checkpoint directory or fsspec URL
    job: Optional[str] = None
    iteration: Optional[int] = None  #: verify only this iteration (default: all complete ones)

    def __post_init__(self) -> None:
        _check_source(self.source)
