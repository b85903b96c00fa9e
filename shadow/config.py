"""Typed configuration for every command, validated at construction.

The CLI merges ``key=value`` overrides onto these dataclasses with OmegaConf (the
engine under Hydra), so a wrong type or value is an error that names the key.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from shadow.choices import Compression, Dtype, Format, LogFormat, LogLevel, WeightFormat
from shadow.config_security import KeygenConfig, SecurityConfig
from shadow.jobs import job_name_problem
from shadow.planner.config import PlanConfig
from shadow.tuning import TuningConfig, check_section


def _check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise ValueError(f"port={port} is not a TCP port; use 1-65535")


def _check_endpoint(key: str, value: str) -> None:
    if not value.startswith(("tcp://", "ipc://")):
        raise ValueError(f"{key}={value!r} is not a ZeroMQ endpoint; use e.g. tcp://127.0.0.1:5555")


DEFAULT_TIER_EVERY_S = 60.0  #: the default local tier's schedule (PersistConfig.durable)


def default_tier_dir(port: int) -> str:
    """Where a cluster on ``port`` keeps its checkpoints when no tier is configured: this
    user's data directory (``$XDG_DATA_HOME``, else ``~/.local/share``), ``shadow/cluster-<port>``;
    one directory per port, so that two clusters of one user never share a tree, and the
    same cluster restarted finds its own."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "shadow", f"cluster-{port}")


@dataclass
class TierConfig:
    """When a persistence tier takes a checkpoint (any due schedule triggers) and how many
    it keeps."""

    every_n: int = 100  #: iterations between checkpoints (0 = not by iterations)
    every_s: float = 0.0  #: seconds between checkpoints (0 = not by time)
    every_tokens: int = 0  #: tokens between checkpoints, as reported by the trainer (0 = not by tokens)
    keep: int = 3  #: complete checkpoints to retain (0 = keep all)
    compress: Compression = Compression.none  #: none or zstd (lossless: float bytes split into planes, then zstd)
    compress_level: int = 1  #: zstd level, 1 (fastest; on float planes also the smallest measured) to 19

    KEY: ClassVar[str] = "persist.TIER"  # where the tier sits in a config, for error messages

    @property
    def location(self) -> str:
        raise NotImplementedError

    def __post_init__(self) -> None:
        k = self.KEY
        for key in ("every_n", "every_s", "every_tokens", "keep"):
            if getattr(self, key) < 0:
                raise ValueError(f"{k}.{key}={getattr(self, key)} must be >= 0")
        self.compress = Compression.parse(self.compress, f"{k}.compress")
        if not 1 <= self.compress_level <= 19:
            raise ValueError(f"{k}.compress_level={self.compress_level} must be 1 (fastest) to 19 (smallest)")
        if self.location and not (self.every_n or self.every_s or self.every_tokens):
            raise ValueError(
                f"{k} at {self.location!r} has no schedule: set {k}.every_n, {k}.every_s or {k}.every_tokens"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.location)


@dataclass
class LocalTierConfig(TierConfig):
    dir: str = ""  #: directory on the workers' local disk (empty = tier off)
    KEY: ClassVar[str] = "persist.local"

    @property
    def location(self) -> str:
        return self.dir


@dataclass
class RemoteTierConfig(TierConfig):
    url: str = ""  #: shared-file-system path or fsspec URL, filled from the local tier (empty = off)
    #: fsspec storage options for the URL's back end (persist.remote.options.endpoint_url=...; s3fs:
    #: key, secret, endpoint_url, client_kwargs, ...). Credentials are better left to the AWS_* environment
    options: dict[str, Any] = field(default_factory=dict)
    every_n: int = 1000
    KEY: ClassVar[str] = "persist.remote"

    @property
    def location(self) -> str:
        return self.url


@dataclass
class PersistConfig:
    """Persistence tiers: ``local`` (a directory the workers write) and ``remote`` (copied
    from the local tier by the workers, any fsspec URL)."""

    local: LocalTierConfig = field(default_factory=LocalTierConfig)
    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)
    #: permissions of checkpoint files, an octal string ("0640"); directories get the same
    #: plus search where read is allowed ("0750"). Empty: 0600 files, 0700 directories
    mode: str = ""
    sign: bool = False  #: sign each manifest (HMAC-SHA256) with the key in security.manifest_key
    # a restarted cluster resumes its jobs from this tier (with_default_tier, default_tier_dir)
    durable: bool = True  #: no tier set: a local one in the user's data dir, every 60 s, keep 3; false = memory only

    def __post_init__(self) -> None:
        if not isinstance(self.sign, bool):
            raise ValueError(f"persist.sign={self.sign!r} must be true or false")
        if not isinstance(self.durable, bool):
            raise ValueError(f"persist.durable={self.durable!r} must be true (the default local tier) or false")
        if self.mode:
            try:
                bits = int(self.mode, 8)
            except ValueError:
                bits = -1
            if not 0 <= bits <= 0o777 or bits & 0o600 != 0o600 or bits & 0o117:
                raise ValueError(
                    f"persist.mode={self.mode!r} is not a checkpoint file mode: the owner must read and write, "
                    "its group may read (and write), no one else may do anything, nothing is executable; give an "
                    "octal string such as 0600 (the default: the owner only) or 0640 (and its group)"
                )
        if self.remote.enabled and not self.local.enabled:
            raise ValueError("persist.remote.url needs persist.local.dir: the remote tier is copied from the local one")
        if "://" in self.local.dir and not self.local.dir.startswith("file://"):
            raise ValueError(f"persist.local.dir={self.local.dir!r} must be a local directory")

    def with_default_tier(self, port: int) -> str:
        """Durable by default: with no local tier configured and ``durable`` on, the local
        tier becomes :func:`default_tier_dir` for the cluster at ``port``, on a time
        schedule (every 60 s unless a local schedule was given; keeping ``keep``). Returns
        the directory chosen, or "" when the config is left as it is."""
        if self.local.enabled or not self.durable:
            return ""
        local = self.local
        if (local.every_n, local.every_s, local.every_tokens) == (TierConfig.every_n, 0.0, 0):
            local.every_n, local.every_s = 0, DEFAULT_TIER_EVERY_S  # a time schedule, whatever the step time
        local.dir = default_tier_dir(port)
        return local.dir

    @property
    def file_mode(self) -> int:
        """The permission bits of a checkpoint file."""
        return int(self.mode, 8) if self.mode else 0o600

    @property
    def dir_mode(self) -> int:
        """The permission bits of a checkpoint directory: the file mode, searchable wherever readable."""
        m = self.file_mode
        return m | ((m & 0o444) >> 2)

    def to_dict(self) -> dict:
        """The plain form the coordinator sends its workers (rebuilt there by :meth:`from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PersistConfig:
        """The config back from :meth:`to_dict` (a missing field takes its default), validated
        again; only the ``local`` and ``remote`` sections are read (a message may carry more)."""
        try:
            return cls(
                LocalTierConfig(**d.get("local", {})),
                RemoteTierConfig(**d.get("remote", {})),
                mode=d.get("mode", ""),
                sign=d.get("sign", False),
                durable=d.get("durable", True),
            )
        except TypeError as exc:  # an unknown field
            raise ValueError(f"persist: {exc}; the tier fields are those of {LocalTierConfig.__name__}") from None


def _check_log(cfg: Any) -> None:
    cfg.log_level = LogLevel.parse(cfg.log_level, "log_level")
    cfg.log_format = LogFormat.parse(cfg.log_format, "log_format")


def _check_metrics_port(port: int) -> None:
    if port:
        _check_port(port)


def check_shape(workers: int, replicas: int) -> None:
    """A cluster of ``workers`` slots, each shard held by ``replicas`` of them, or a
    ``ValueError`` saying what to change."""
    if workers < 1:
        raise ValueError(f"workers={workers}: a cluster needs at least 1 worker")
    if replicas < 1 or workers % replicas:
        raise ValueError(
            f"replicas={replicas} must be >= 1 and divide workers={workers}; e.g. workers={2 * workers} replicas=2"
        )


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
    tuning: Any = field(default_factory=TuningConfig)  #: knobs (shadow.tuning.Tuning); the workers get them too

    def __post_init__(self) -> None:
        check_shape(self.workers, self.replicas)
        check_section(self.tuning)
        _check_port(self.port)
        _check_metrics_port(self.metrics_port)
        _check_log(self)
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

    def __post_init__(self) -> None:
        super().__post_init__()
        self.transport.check(self.security)
        if self.threads_per_worker < 0:
            raise ValueError(f"threads_per_worker={self.threads_per_worker} must be >= 0 (0 = automatic)")
        self.security.check_workers_key("shadow cluster")
        if self.metrics_port and self.metrics_port + self.workers >= 65536:
            raise ValueError(
                f"metrics_port={self.metrics_port} leaves no port for worker {self.workers - 1} "
                f"(metrics_port + 1 + i); use a port below {65535 - self.workers}"
            )

    def threads(self) -> int:
        return self.threads_per_worker or max(1, (os.cpu_count() or 1) // self.workers)


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
    tuning: Any = field(default_factory=TuningConfig)  #: knobs (shadow.tuning.Tuning)
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        _check_endpoint("coordinator", self.coordinator)
        self.transport.check(self.security)
        check_section(self.tuning)
        if self.threads < 0:
            raise ValueError(f"threads={self.threads} must be >= 0 (0 = all cores)")
        if not self.host:
            raise ValueError("host= is empty; give an interface address or host=auto")
        _check_metrics_port(self.metrics_port)
        _check_log(self)
        self.security.check_workers_key("shadow worker")


@dataclass
class StatusConfig:
    """What the cluster is doing: workers, ranges, committed iteration, lag, tiers."""

    address: str = "tcp://127.0.0.1:5555"  #: the coordinator's address
    json: bool = False  #: print the raw status as JSON (also: --json)
    watch: float = 0.0  #: redraw every this many seconds until Ctrl-C (0 = once)
    timeout: float = 5.0  #: seconds to wait for the coordinator
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        _check_endpoint("address", self.address)
        _check_timeout(self.timeout)
        if self.watch < 0 or (self.watch and self.json):
            raise ValueError(f"watch={self.watch} must be >= 0 seconds, and cannot be combined with json=true")


def _check_timeout(timeout: float) -> None:
    if timeout <= 0:
        raise ValueError(f"timeout={timeout} must be positive (seconds)")


def _check_source(value: str) -> None:
    if not value:
        raise ValueError(
            "source= is required: a coordinator address (tcp://host:port), a checkpoint directory or an fsspec URL"
        )


@dataclass
class RestoreConfig:
    """Write a whole checkpoint (model, optimizer, scheduler, RNG, extra state) out."""

    source: str = "tcp://127.0.0.1:5555"  #: coordinator address, checkpoint directory or fsspec URL
    out: str = "checkpoint.pt"  #: file (torch, safetensors, lightning) or directory (dcp, hf_trainer) to write
    format: Format = Format.torch  #: torch (torch.load-able), dcp, safetensors (weights), hf_trainer, lightning
    job: str | None = None  #: the job to restore (default: the only or newest one)
    iteration: int | None = None  #: a specific iteration (default: newest complete)
    timeout: float = 30.0  #: seconds to wait for the coordinator and workers
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        _check_source(self.source)
        self.format = Format.parse(self.format, "format")
        _check_timeout(self.timeout)


@dataclass
class ExportConfig:
    """Write the model weights of a checkpoint for use outside training (inference,
    evaluation, sharing): no optimizer state, optionally cast to a smaller dtype."""

    source: str = "tcp://127.0.0.1:5555"  #: coordinator address, checkpoint directory or fsspec URL
    out: str = "model.safetensors"  #: file to write
    format: WeightFormat = WeightFormat.safetensors  #: safetensors or torch (a model state dict for torch.load)
    dtype: Dtype = Dtype.float32  #: float32, bfloat16 or float16 (the shadow holds fp32)
    job: str | None = None  #: the job to export (default: the only or newest one)
    iteration: int | None = None  #: a specific iteration (default: newest complete)
    timeout: float = 30.0  #: seconds to wait for the coordinator and workers
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        _check_source(self.source)
        self.format = WeightFormat.parse(self.format, "format")
        self.dtype = Dtype.parse(self.dtype, "dtype")
        _check_timeout(self.timeout)


@dataclass
class ListConfig:
    """The checkpoints a cluster or a storage root holds."""

    source: str = "tcp://127.0.0.1:5555"  #: coordinator address, checkpoint directory or fsspec URL
    job: str | None = None  #: only this job
    json: bool = False  #: print JSON rows (also: --json)
    timeout: float = 5.0  #: seconds to wait for the coordinator
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        _check_source(self.source)
        _check_timeout(self.timeout)


@dataclass
class VerifyConfig:
    """Re-read persisted checkpoints and check every checksum."""

    #: checkpoint directory or fsspec URL, or a coordinator address: its tiers, every copy of every
    #: shard on the workers' disks read through the workers (required)
    source: str = ""
    job: str | None = None  #: only this job
    iteration: int | None = None  #: verify only this iteration (default: all complete ones)
    deep: bool = False  #: also decode every shard and check the tensors it holds (slower)
    json: bool = False  #: print JSON results (also: --json)
    manifest_key: str = ""  #: file holding the manifest key: check signatures (default: $SHADOW_MANIFEST_KEY)
    timeout: float = 5.0  #: seconds to wait for the coordinator (a coordinator address)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        _check_source(self.source)
        _check_timeout(self.timeout)


@dataclass
class JobsConfig:
    """The jobs the cluster knows: the one it holds (status, epoch, world, committed iteration,
    how many ranks are still heard from and when one was last heard, whether its trainers look
    gone), an attach waiting for its ranks, and the jobs known only from the tiers' checkpoints.
    A client or admin key on a cluster with CURVE keys."""

    address: str = "tcp://127.0.0.1:5555"  #: the coordinator's address
    json: bool = False  #: print the jobs as JSON (also: --json)
    timeout: float = 5.0  #: seconds to wait for the coordinator
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        _check_endpoint("address", self.address)
        _check_timeout(self.timeout)


@dataclass
class DropConfig:
    """Detach a job whose trainers are gone (crashed, killed, or a session never closed), so
    that another job can attach without restarting the cluster and without overwrite=True.
    Its checkpoints are kept: shadow memory serves its committed iteration until another job
    attaches, and the tiers are not touched. Refused while its trainers are still heard from
    (heartbeats within SHADOW_WORKER_LOST_S), unless force=true. Needs an admin key on a
    cluster with CURVE keys."""

    job: str = ""  #: the job to detach (required; `shadow jobs` lists them)
    address: str = "tcp://127.0.0.1:5555"  #: the coordinator's address
    force: bool = False  #: detach it even while its trainers are heard from (they then train on unprotected)
    json: bool = False  #: print the result as JSON (also: --json)
    timeout: float = 5.0  #: seconds to wait for the coordinator
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        if not self.job:
            raise ValueError("job= is required: the name of the job to detach (`shadow jobs` lists them)")
        problem = job_name_problem(self.job)
        if problem is not None:
            raise ValueError(problem)
        _check_endpoint("address", self.address)
        _check_timeout(self.timeout)


CONFIGS: dict[str, type] = {
    "cluster": ClusterConfig,
    "coordinator": CoordinatorConfig,
    "worker": WorkerConfig,
    "status": StatusConfig,
    "restore": RestoreConfig,
    "export": ExportConfig,
    "ls": ListConfig,
    "verify": VerifyConfig,
    "jobs": JobsConfig,
    "drop": DropConfig,
    "keygen": KeygenConfig,
    "plan": PlanConfig,
}


def register() -> None:
    """Register every command's schema in Hydra's ConfigStore as ``shadow_<command>``, the
    name a YAML config in ``configs/`` extends (``defaults: [shadow_cluster, _self_]``)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, cls in CONFIGS.items():
        cs.store(name=f"shadow_{name}", node=cls)
