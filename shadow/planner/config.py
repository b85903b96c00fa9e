"""What ``shadow plan`` takes: the job, its failures, and what each checkpointing strategy
costs. Every field is checked at construction; errors name the key, the value and the fix."""

from __future__ import annotations

from dataclasses import dataclass, field


def optimizer_bytes() -> dict[str, float]:
    """fp32 bytes per parameter the shadow and a checkpoint hold, per optimizer name
    (:func:`shadow.core.optimizers.planner_bytes`; imported when asked: the registry
    imports the wire package, which imports this one)."""
    from shadow.core import optimizers

    return optimizers.planner_bytes()


# Llama 3 405B pre-training: 16,384 GPUs, 419 unexpected interruptions in a 54-day snapshot
LLAMA3_GPU_MTBF_H = 16384 * 54 * 24 / 419


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{key}={value} must be > 0")


@dataclass
class SyncConfig:
    """Periodic synchronous checkpointing: training stops while the state is written."""

    write_GBps: float = 100.0  #: aggregate write bandwidth to durable storage, GB/s
    read_GBps: float = 200.0  #: aggregate read bandwidth at restart, GB/s
    interval_s: float = 0.0  #: checkpoint interval; 0 = the Young/Daly optimum

    def __post_init__(self) -> None:
        _positive("sync.write_GBps", self.write_GBps)
        _positive("sync.read_GBps", self.read_GBps)
        if self.interval_s < 0:
            raise ValueError(f"sync.interval_s={self.interval_s} must be >= 0 (0 = the optimum)")


@dataclass
class AsyncConfig:
    """Asynchronous tiered checkpointing: training stalls only for the copy to host memory;
    the write to storage runs behind it, and a checkpoint is restorable once written."""

    snapshot_GBps_per_gpu: float = 20.0  #: device-to-host copy bandwidth per GPU (the stall), GB/s
    write_GBps: float = 100.0  #: aggregate bandwidth of the persisting tier, GB/s
    read_GBps: float = 400.0  #: aggregate read bandwidth at restart (nearest tier), GB/s
    interval_s: float = 0.0  #: checkpoint interval; 0 = the optimum (never shorter than a write)
    overhead: float = 0.0  #: step-time overhead while a write runs behind training (host CPU, PCIe, memory contention)

    def __post_init__(self) -> None:
        for key in ("snapshot_GBps_per_gpu", "write_GBps", "read_GBps"):
            _positive(f"tiered.{key}", getattr(self, key))
        if self.interval_s < 0:
            raise ValueError(f"tiered.interval_s={self.interval_s} must be >= 0 (0 = the optimum)")
        if not 0 <= self.overhead < 1:
            raise ValueError(f"tiered.overhead={self.overhead} must be a fraction in [0, 1)")


@dataclass
class ShadowPlanConfig:
    """Per-iteration checkpointing through a shadow cluster."""

    #: step-time overhead on the trainers (fraction); -1 = the measured GPU figure: <bench_dir>/gpu.json
    #: (benchmarks/bench_gpu.py), else the last one on record (shadow.planner.sizing.RECORDED_GPU_OVERHEAD)
    overhead: float = -1.0
    lag_iterations: int = 1  #: iterations the shadow's committed state trails the trainers
    restore_GBps: float = (
        0.0  #: aggregate bandwidth from the shadow cluster to the restarting trainers, GB/s; 0 = its hosts' NICs
    )
    replicas: int = 1  #: workers holding each shard
    headroom: float = 2.0  #: sizing margin over the steady-state cores (catching up after a resync)
    cores_per_host: int = 64  #: cores of one shadow host (sizing)
    ram_GB_per_host: float = 512.0  #: memory of one shadow host (sizing)
    nic_GBps_per_host: float = 25.0  #: network bandwidth into one shadow host, GB/s (25 = 200 Gb/s)
    persist_images: int = 2  #: preallocated persistence images per worker (0 = no local tier)
    bench_dir: str = ""  #: folder of the measured figures (scaling.json); empty = this repository's docs/bench

    def __post_init__(self) -> None:
        if not (0 <= self.overhead < 1 or self.overhead == -1):
            raise ValueError(f"shadow.overhead={self.overhead} must be a fraction in [0, 1) (or -1: the measured one)")
        if self.lag_iterations < 0 or self.replicas < 1 or self.persist_images < 0:
            raise ValueError(
                f"shadow.lag_iterations={self.lag_iterations} and shadow.persist_images="
                f"{self.persist_images} must be >= 0, shadow.replicas={self.replicas} >= 1"
            )
        for key in ("ram_GB_per_host", "nic_GBps_per_host"):
            _positive(f"shadow.{key}", getattr(self, key))
        if self.restore_GBps < 0:
            raise ValueError(f"shadow.restore_GBps={self.restore_GBps} must be >= 0 (0 = from the cluster's NICs)")
        if self.headroom < 1:
            raise ValueError(f"shadow.headroom={self.headroom} must be >= 1 (a margin over the steady state)")
        if self.cores_per_host < 1:
            raise ValueError(f"shadow.cores_per_host={self.cores_per_host} must be >= 1")


@dataclass
class StoragePlanConfig:
    """The shadow's persisted tiers: node-local disks on the shadow hosts (every replica
    writes its copy) and an object store the workers upload to."""

    local_every_n: int = 100  #: iterations between local-tier checkpoints (persist.local.every_n; 0 = none)
    remote_every_n: int = 1000  #: iterations between object-store copies (persist.remote.every_n; 0 = none)
    keep: int = 3  #: complete checkpoints each tier keeps (persist.<tier>.keep)
    disk_GBps_per_host: float = 6.0  #: write (and read) bandwidth of one shadow host's local disks, GB/s
    object_store_GBps: float = 100.0  #: aggregate bandwidth to (and from) the object store, GB/s
    #: stored / plain bytes of the remote tier (persist.remote.compress=zstd); 0 = the measured ratio in
    #: <bench_dir>/compress.json, else 1
    remote_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.local_every_n < 0 or self.remote_every_n < 0 or self.keep < 1:
            raise ValueError(
                f"storage.local_every_n={self.local_every_n} and storage.remote_every_n={self.remote_every_n} "
                f"must be >= 0 (0 = no such tier), storage.keep={self.keep} >= 1"
            )
        for key in ("disk_GBps_per_host", "object_store_GBps"):
            _positive(f"storage.{key}", getattr(self, key))
        if not 0 <= self.remote_ratio <= 2:
            raise ValueError(f"storage.remote_ratio={self.remote_ratio} must be in (0, 2] (0 = the measured one)")


@dataclass
class MixJobConfig:
    """One job of a mix that shares a shadow cluster (``shadow plan mix=[...]``)."""

    name: str = ""  #: a label (default: job<i>)
    params: float = 1e9  #: model parameters
    optimizer: str = "adamw"  #: adamw, adam, adamax or sgd (the state's bytes per parameter)
    iteration_s: float = 1.0  #: seconds per training iteration
    replicas: int = 1  #: workers holding each of its shards
    #: cores it asks for (0 = what its replay needs with the cluster's headroom); a share above the
    #: need keeps its replay from ever waiting on another job's
    cores: float = 0.0

    def check(self, where: str) -> None:
        if self.optimizer not in optimizer_bytes():
            raise ValueError(f"{where}.optimizer={self.optimizer!r} is not one of {tuple(optimizer_bytes())}")
        for key in ("params", "iteration_s"):
            _positive(f"{where}.{key}", getattr(self, key))
        if self.replicas < 1 or self.cores < 0:
            raise ValueError(f"{where}.replicas={self.replicas} must be >= 1 and {where}.cores={self.cores} >= 0")


@dataclass
class PlanConfig:
    """Expected lost GPU-hours per day of a data-parallel job under periodic synchronous,
    asynchronous tiered and shadow per-iteration checkpointing (analytic and simulated),
    and the shadow cluster it needs."""

    gpus: int = 16384  #: GPUs in the job
    tp: int = 1  #: tensor-parallel degree (ranks splitting each layer)
    pp: int = 1  #: pipeline stages (data parallelism is gpus / (tp * pp))
    gpu_mtbf_h: float = (
        LLAMA3_GPU_MTBF_H  #: mean time between failures of one GPU (with its share of host and network), hours
    )
    job_mtbf_h: float = 0.0  #: the job's MTBF, hours; when > 0 it replaces gpus / gpu_mtbf_h
    params: float = 405e9  #: model parameters
    optimizer: str = "adamw"  #: adamw, adam, adamax or sgd (sets the state's bytes per parameter)
    bytes_per_param: float = 0.0  #: checkpoint bytes per parameter; 0 = from the optimizer (12 for Adam)
    iteration_s: float = 6.0  #: seconds per training iteration
    restart_s: float = (
        600.0  #: seconds from a failure to training again, before loading state (detect, reschedule, init)
    )
    days: float = 30.0  #: simulated wall-clock days per trial
    trials: int = 4  #: simulated trials (seeds seed, seed+1, ...)
    seed: int = 0
    json: bool = False  #: print JSON (also: --json)
    sync: SyncConfig = field(default_factory=SyncConfig)
    tiered: AsyncConfig = field(default_factory=AsyncConfig)
    shadow: ShadowPlanConfig = field(default_factory=ShadowPlanConfig)
    storage: StoragePlanConfig = field(default_factory=StoragePlanConfig)
    name: str | None = None  #: a label for the scenario
    #: jobs sharing one shadow cluster at once, each a job worker per host with its own memory
    #: and cores (docs/shared-cluster.md): the plan sizes the cluster for all of them
    mix: list[MixJobConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"gpus={self.gpus} must be >= 1")
        for key in ("tp", "pp"):
            if (
                isinstance(getattr(self, key), bool)
                or not isinstance(getattr(self, key), int)
                or getattr(self, key) < 1
            ):
                raise ValueError(f"{key}={getattr(self, key)!r} must be an integer >= 1")
        if self.gpus % (self.tp * self.pp):
            raise ValueError(
                f"gpus={self.gpus} is not a multiple of tp x pp = {self.tp * self.pp}: the data-parallel degree "
                "is gpus / (tp * pp); set gpus, tp and pp so it divides"
            )
        if self.job_mtbf_h < 0:
            raise ValueError(f"job_mtbf_h={self.job_mtbf_h} must be >= 0 (0 = from gpus / gpu_mtbf_h)")
        if self.job_mtbf_h == 0 and not self.gpu_mtbf_h > 0:
            raise ValueError(
                f"gpu_mtbf_h={self.gpu_mtbf_h} must be > 0 (or set job_mtbf_h > 0, hours), e.g. "
                f"gpu_mtbf_h={LLAMA3_GPU_MTBF_H:.0f} (Llama 3's 16k-GPU run) or job_mtbf_h=1"
            )
        if self.optimizer not in optimizer_bytes():
            raise ValueError(f"optimizer={self.optimizer!r} is not one of {tuple(optimizer_bytes())}")
        if self.bytes_per_param < 0:
            raise ValueError(f"bytes_per_param={self.bytes_per_param} must be >= 0 (0 = from the optimizer)")
        for key in ("params", "iteration_s", "days"):
            _positive(key, getattr(self, key))
        if self.restart_s < 0:
            raise ValueError(f"restart_s={self.restart_s} must be >= 0")
        if self.trials < 1:
            raise ValueError(f"trials={self.trials} must be >= 1")
        for i, job in enumerate(self.mix):
            if isinstance(job, dict):  # given as plain mappings (not through the CLI's schema)
                self.mix[i] = job = MixJobConfig(**job)
            job.check(f"mix[{i}]")

    @property
    def dp(self) -> int:
        """The data-parallel degree: ``gpus / (tp * pp)``."""
        return self.gpus // (self.tp * self.pp)

    @property
    def mtbf_s(self) -> float:
        """The job's mean time between failures, seconds."""
        return 3600.0 * (self.job_mtbf_h if self.job_mtbf_h > 0 else self.gpu_mtbf_h / self.gpus)

    @property
    def state_bytes(self) -> float:
        return self.params * (self.bytes_per_param or optimizer_bytes()[self.optimizer])
