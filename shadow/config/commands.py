"""The client commands' configs: status, restore, export, ls, verify, jobs, drop."""

from __future__ import annotations

from dataclasses import dataclass, field

from shadow.config.checks import check_endpoint, check_source, check_timeout
from shadow.config.choices import Dtype, Format, WeightFormat
from shadow.config.security import SecurityConfig
from shadow.core.jobs import job_name_problem


@dataclass
class StatusConfig:
    """What the cluster is doing: workers, ranges, committed iteration, lag, tiers."""

    address: str = "tcp://127.0.0.1:5555"  #: the coordinator's address
    job: str = ""  #: a shared cluster: this job's cluster only (empty: every job)
    json: bool = False  #: print the raw status as JSON (also: --json)
    watch: float = 0.0  #: redraw every this many seconds until Ctrl-C (0 = once)
    timeout: float = 5.0  #: seconds to wait for the coordinator
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        check_endpoint("address", self.address)
        check_timeout(self.timeout)
        if self.watch < 0 or (self.watch and self.json):
            raise ValueError(f"watch={self.watch} must be >= 0 seconds, and cannot be combined with json=true")


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
        check_source(self.source)
        self.format = Format.parse(self.format, "format")
        check_timeout(self.timeout)


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
        check_source(self.source)
        self.format = WeightFormat.parse(self.format, "format")
        self.dtype = Dtype.parse(self.dtype, "dtype")
        check_timeout(self.timeout)


@dataclass
class ListConfig:
    """The checkpoints a cluster or a storage root holds."""

    source: str = "tcp://127.0.0.1:5555"  #: coordinator address, checkpoint directory or fsspec URL
    job: str | None = None  #: only this job
    json: bool = False  #: print JSON rows (also: --json)
    timeout: float = 5.0  #: seconds to wait for the coordinator
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        check_source(self.source)
        check_timeout(self.timeout)


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
        check_source(self.source)
        check_timeout(self.timeout)


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
        check_endpoint("address", self.address)
        check_timeout(self.timeout)


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
        check_endpoint("address", self.address)
        check_timeout(self.timeout)
