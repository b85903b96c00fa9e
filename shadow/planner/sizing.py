"""How big a shadow cluster a job needs, from what this project measured.

Cores come from the whole worker path (receive, checksum, replay, snapshot) in CPU-seconds
per iteration per billion parameters, as ``benchmarks/bench_scaling.py`` measured it
(``<bench_dir>/scaling.json``); memory from the worker's bytes per parameter; network from
the 4 bytes per parameter per iteration the trainers send (each gradient byte once, to
every replica).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from shadow.planner.config import PlanConfig, optimizer_bytes

GB = 1e9

#: memory of one job worker beyond its shard (the interpreter, numba's kernels, sockets,
#: buffers): 200 MB resident for a worker holding a tiny model, measured with ``ps`` on the
#: workers of ``tools/fault_matrix.py --scenarios net`` (2-core Intel Xeon); rounded up
JOB_WORKER_FIXED_GB = 0.25


class BenchmarkMissing(ValueError):
    pass


#: The shadow's step-time overhead last measured on a GPU, for plans made where no
#: ``gpu.json`` exists: one H200, GPT-124M, bf16, fused AdamW, gradient accumulation 8
#: (1.3 GB/s of fp32 gradients), 1.048-1.057x the step time without a checkpoint, before the
#: GPU data path took the hook's synchronous copies out (at accumulation 2: 1.186x).
RECORDED_GPU_OVERHEAD = (0.053, "H200, GPT-124M, accumulation 8: 1.048-1.057x (before the GPU data path)")


def _bench_dir(bench_dir: str) -> str:
    return bench_dir or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "bench"
    )


def measured_overhead(bench_dir: str) -> tuple[float, str]:
    """``(the shadow's step-time overhead on a GPU, where it came from)``: from
    ``<bench_dir>/gpu.json`` (``benchmarks/bench_gpu.py --json``; fused AdamW, the largest
    accumulation measured, the protocol's main row), else :data:`RECORDED_GPU_OVERHEAD`."""
    path = os.path.join(_bench_dir(bench_dir), "gpu.json")
    try:
        with open(path) as f:
            doc = json.load(f)
        rows = [r for r in doc["results"] if r.get("mode") == "shadow" and r.get("vs_none")]
        row = max(rows, key=lambda r: r["accum"])
        return max(0.0, float(row["vs_none"]) - 1.0), f"{path} ({doc.get('gpu', 'GPU')}, accumulation {row['accum']})"
    except (OSError, ValueError, KeyError, TypeError):
        return RECORDED_GPU_OVERHEAD


def measured_ratio(bench_dir: str) -> tuple[float, str]:
    """``(stored / plain bytes of a zstd tier, where it came from)``: a whole shard at level
    1 in ``<bench_dir>/compress.json`` (``benchmarks/bench_compress.py``), else 1 (plain)."""
    path = os.path.join(_bench_dir(bench_dir), "compress.json")
    try:
        with open(path) as f:
            ratio = float(json.load(f)["shard"]["planes-1"]["ratio"])
        return 1.0 / ratio, f"{path} (a shard, zstd level 1 on byte planes)"
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return 1.0, "not measured (stored as plain)"


def measured_cpu(bench_dir: str) -> tuple[float, str]:
    """``(CPU-seconds per iteration per B params, where it came from)`` from the
    benchmark JSON."""
    path = os.path.join(_bench_dir(bench_dir), "scaling.json")
    try:
        with open(path) as f:
            sizing = json.load(f)["sizing"]
    except FileNotFoundError:
        raise BenchmarkMissing(
            f"no measured figures at {path}: run `python benchmarks/bench_all.py --only apply,scaling` "
            "or set shadow.bench_dir= to a folder holding scaling.json"
        ) from None
    except (ValueError, KeyError) as exc:
        raise BenchmarkMissing(f"{path} is not a bench_scaling.py result ({exc}); run it again") from None
    value = sizing.get("worker_path_cpu_s_per_iter_per_Bparams") or sizing.get("replay_cpu_s_per_iter_per_Bparams")
    if not value or value <= 0:
        raise BenchmarkMissing(f"{path} holds no CPU-seconds per iteration per B params")
    return float(value), path


def worker_bytes_per_param(cfg: PlanConfig) -> float:
    """Memory a worker needs per parameter of its shard: the optimizer state, gradients
    received and not yet applied (the lag plus the iteration arriving), and the
    persistence images."""
    state = cfg.bytes_per_param or optimizer_bytes()[cfg.optimizer]
    inflight = 4.0 * (cfg.shadow.lag_iterations + 1)
    return state + inflight + state * cfg.shadow.persist_images


def size(cfg: PlanConfig, cpu_s_per_iter_per_b: float | None = None) -> dict:
    """Cores, memory, network and hosts of the shadow cluster for ``cfg``."""
    sh = cfg.shadow
    source = "given"
    if cpu_s_per_iter_per_b is None:
        cpu_s_per_iter_per_b, source = measured_cpu(sh.bench_dir)
    b = cfg.params / 1e9
    cores = b * cpu_s_per_iter_per_b / cfg.iteration_s * sh.replicas * sh.headroom
    ram = cfg.params * worker_bytes_per_param(cfg) * sh.replicas
    net = 4.0 * cfg.params / cfg.iteration_s * sh.replicas
    need = {
        "cores": cores / sh.cores_per_host,
        "memory": ram / (sh.ram_GB_per_host * GB),
        "network": net / (sh.nic_GBps_per_host * GB),
    }
    hosts = max(1, math.ceil(max(need.values())))
    return {
        "cpu_s_per_iter_per_Bparams": cpu_s_per_iter_per_b,
        "measured_in": source,
        "cores": cores,
        "memory_GB": ram / GB,
        "network_GBps": net / GB,
        "hosts": hosts,
        "limited_by": max(need, key=lambda k: need[k]),
        "hosts_by": need,
        "restore_GBps": hosts * sh.nic_GBps_per_host,
        "trainer_egress_MBps_per_gpu": 4.0 * cfg.params / cfg.gpus / cfg.iteration_s * sh.replicas / 1e6,
        "worker_bytes_per_param": worker_bytes_per_param(cfg),
        "parallelism": parallelism(cfg),
    }


def size_mix(cfg: PlanConfig, cpu_s_per_iter_per_b: float | None = None) -> dict:
    """The shadow cluster for the jobs of ``cfg.mix`` at once: each job's cores (what it asks,
    or what its replay needs with the headroom), memory (its shards on every host, its job
    worker's fixed cost on each) and network in; the hosts the sum needs; and each job's share
    of the cluster's cores. Every job is spread over every host (a job worker per host)."""
    sh = cfg.shadow
    source = "given"
    if cpu_s_per_iter_per_b is None:
        cpu_s_per_iter_per_b, source = measured_cpu(sh.bench_dir)
    rows: list[dict[str, Any]] = []
    for i, job in enumerate(cfg.mix):
        alone = PlanConfig(params=job.params, optimizer=job.optimizer, iteration_s=job.iteration_s, shadow=sh)
        needed = job.params / 1e9 * cpu_s_per_iter_per_b / job.iteration_s * job.replicas * sh.headroom
        rows.append(
            {
                "name": job.name or f"job{i}",
                "params": job.params,
                "cores_needed": needed,
                "cores": max(job.cores, needed),
                "memory_GB": job.params * worker_bytes_per_param(alone) * job.replicas / GB,
                "network_GBps": 4.0 * job.params / job.iteration_s * job.replicas / GB,
            }
        )
    cores = sum(r["cores"] for r in rows)
    memory = sum(r["memory_GB"] for r in rows)
    net = sum(r["network_GBps"] for r in rows)

    def hosts_for(n: int) -> dict[str, float]:
        return {
            "cores": cores / sh.cores_per_host,
            "memory": (memory + n * len(rows) * JOB_WORKER_FIXED_GB) / sh.ram_GB_per_host,
            "network": net / sh.nic_GBps_per_host,
        }

    hosts = 1
    while max(hosts_for(hosts).values()) > hosts:  # each host adds a job worker per job
        hosts += 1
    for r in rows:
        r["share"] = r["cores"] / cores if cores else 0.0
        r["cores_per_host"] = r["cores"] / hosts
        r["memory_GB_per_host"] = r["memory_GB"] / hosts + JOB_WORKER_FIXED_GB
    need = hosts_for(hosts)
    return {
        "cpu_s_per_iter_per_Bparams": cpu_s_per_iter_per_b,
        "measured_in": source,
        "jobs": rows,
        "cores": cores,
        "memory_GB": memory + hosts * len(rows) * JOB_WORKER_FIXED_GB,
        "network_GBps": net,
        "hosts": hosts,
        "limited_by": max(need, key=lambda k: need[k]),
        "hosts_by": need,
        "job_worker_fixed_GB": JOB_WORKER_FIXED_GB,
    }


def parallelism(cfg: PlanConfig) -> dict:
    """What a rank streams under ``dp x tp x pp``: its unique share of the model, 4 bytes
    per parameter / ranks (replicated elements striped among their holders), to every
    cluster replica; a pipeline stage's ranks hold ``params / pp`` between them. A DDP
    job's stream starts during the backward, a sharded one's (FSDP2, tensor or pipeline
    parallel) at the step: either way the cluster has one iteration to take it."""
    per_rank = 4.0 * cfg.params / cfg.gpus * cfg.shadow.replicas
    sharded = cfg.tp > 1 or cfg.pp > 1
    return {
        "dp": cfg.dp,
        "tp": cfg.tp,
        "pp": cfg.pp,
        "stage_params": cfg.params / cfg.pp,
        "ranks_per_stage": cfg.gpus // cfg.pp,
        "bytes_per_rank_per_iter": per_rank,
        "bootstrap_bytes_per_rank": (cfg.bytes_per_param or optimizer_bytes()[cfg.optimizer]) * cfg.params / cfg.gpus,
        "stream_starts": "at the step" if sharded else "during the backward (DDP) or at the step (FSDP2)",
    }
