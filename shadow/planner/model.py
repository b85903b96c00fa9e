"""The failure-cost model: each checkpointing strategy reduced to the same few numbers, and
the expected fraction of wall-clock time that becomes training progress.

A strategy is a cycle: ``work_s`` of training progress taking ``wall_s`` of wall time
(more than ``work_s`` when checkpointing slows every step), then a stall of ``stall_s``
while the checkpoint is taken. A checkpoint becomes restorable ``delay_s`` after its
cycle ends (the write to storage behind an asynchronous snapshot; the shadow's lag). A
failure rolls training back to the newest restorable checkpoint and costs ``restart_s``
(detection, rescheduling, initialisation and loading the state) before work resumes.
Failures arrive as a Poisson process of mean interval ``mtbf_s`` (the job's failures
being the superposition of many independent GPUs' ones), also during restarts.

Expected useful fraction (Daly 2006, exact for exponential failures when
``delay_s = 0``; with a delay, the checkpoint lost to a failure inside it is charged as
``delay_s`` of extra rework at every restart, a first-order term)::

    E[wall per cycle] = M * exp(R'/M) * (exp((wall + stall)/M) - 1),   R' = restart + delay
    useful = work / E[wall per cycle]

Optimal interval of a periodic checkpoint of cost C (Daly's higher-order form of Young's
``sqrt(2 C M)``)::

    tau = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C    for C < 2M, else M
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from shadow.planner.config import PlanConfig
from shadow.planner.sizing import measured_overhead

GB = 1e9
STRATEGIES = ("sync", "async", "shadow")


@dataclass(frozen=True)
class Strategy:
    name: str
    work_s: float  #: training progress per cycle (failure-free, overhead-free seconds)
    wall_s: float  #: wall time the progress takes (> work_s with a per-step overhead)
    stall_s: float  #: training stopped per checkpoint
    delay_s: float  #: a checkpoint becomes restorable this long after its cycle ends
    restart_s: float  #: failure to training again, including loading the state

    def to_dict(self) -> dict:
        return asdict(self)


def young(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimal interval between checkpoints of cost ``cost_s``."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal interval (work between checkpoints)."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def strategies(cfg: PlanConfig, shadow_restore_GBps: float | None = None) -> dict[str, Strategy]:
    """The three strategies of ``cfg`` at their intervals (the optimum where unset). The
    shadow restores at ``cfg.shadow.restore_GBps``, or at ``shadow_restore_GBps`` (its
    hosts' NICs, from the sizing) when that is 0."""
    m, s, it = cfg.mtbf_s, cfg.state_bytes, cfg.iteration_s
    out = {}
    cost = s / (cfg.sync.write_GBps * GB)
    tau = cfg.sync.interval_s or daly(cost, m)
    tau = max(it, round(tau / it) * it)  # checkpoints happen at iteration boundaries
    out["sync"] = Strategy("sync", tau, tau, cost, 0.0, cfg.restart_s + s / (cfg.sync.read_GBps * GB))
    stall = s / (cfg.gpus * cfg.tiered.snapshot_GBps_per_gpu * GB)  # each GPU copies its share of the state
    write = s / (cfg.tiered.write_GBps * GB)
    tau = cfg.tiered.interval_s or max(daly(stall, m), write)  # the next write cannot start before this one ends
    tau = max(it, math.ceil(tau / it) * it)
    wall = tau * (1.0 + cfg.tiered.overhead * min(1.0, write / tau))  # slower steps while a write runs
    out["async"] = Strategy("async", tau, wall, stall, write, cfg.restart_s + s / (cfg.tiered.read_GBps * GB))
    sh = cfg.shadow
    wall = it * (1.0 + shadow_overhead(cfg)[0])
    restore = sh.restore_GBps or shadow_restore_GBps
    if not restore:
        raise ValueError("shadow.restore_GBps=0 needs the cluster's size (its NICs) to know the restore bandwidth")
    out["shadow"] = Strategy("shadow", it, wall, 0.0, sh.lag_iterations * wall, cfg.restart_s + s / (restore * GB))
    return out


def shadow_overhead(cfg: PlanConfig) -> tuple[float, str]:
    """The shadow's step-time overhead the plan uses and where it came from: as given, or
    (``shadow.overhead=-1``) the measured GPU figure."""
    if cfg.shadow.overhead >= 0:
        return cfg.shadow.overhead, "given"
    return measured_overhead(cfg.shadow.bench_dir)


def useful_fraction(st: Strategy, mtbf_s: float) -> float:
    """Expected progress per wall-clock second (1 = no failure, no checkpoint cost)."""
    m = mtbf_s
    try:
        expected = m * math.exp((st.restart_s + st.delay_s) / m) * math.expm1((st.wall_s + st.stall_s) / m)
    except OverflowError:
        return 0.0
    return st.work_s / expected if expected > 0 else 0.0


def breakdown(st: Strategy, mtbf_s: float) -> dict[str, float]:
    """First-order shares of wall time lost to each cause: the checkpoint itself (stalls
    and per-step overhead), rework after failures, and restarts."""
    cycle = st.wall_s + st.stall_s
    return {
        "checkpoint": (cycle - st.work_s) / cycle,
        "rework": (cycle / 2.0 + st.delay_s) / mtbf_s,
        "restart": st.restart_s / mtbf_s,
    }


def lost_gpu_hours_per_day(gpus: int, useful: float) -> float:
    return gpus * 24.0 * (1.0 - useful)


def break_even_overhead(cfg: PlanConfig, shadow_restore_GBps: float | None = None) -> float | None:
    """The shadow's step-time overhead at which it loses as much as the better of the other
    two strategies (below it, the shadow loses less); None if it loses more even at 0."""
    st = strategies(cfg, shadow_restore_GBps)
    best = max(useful_fraction(st["sync"], cfg.mtbf_s), useful_fraction(st["async"], cfg.mtbf_s))

    def shadow_at(o: float) -> float:
        wall = cfg.iteration_s * (1.0 + o)
        s = Strategy("shadow", cfg.iteration_s, wall, 0.0, cfg.shadow.lag_iterations * wall, st["shadow"].restart_s)
        return useful_fraction(s, cfg.mtbf_s)

    if shadow_at(0.0) <= best:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if shadow_at(mid) > best else (lo, mid)
    return lo


def analyse(cfg: PlanConfig, shadow_restore_GBps: float | None = None) -> dict[str, dict]:
    """Per strategy: its parameters, the useful fraction, lost GPU-hours per day, the
    first-order breakdown and which cause dominates."""
    out = {}
    for name, st in strategies(cfg, shadow_restore_GBps).items():
        u = useful_fraction(st, cfg.mtbf_s)
        shares = breakdown(st, cfg.mtbf_s)
        out[name] = {
            "strategy": st.to_dict(),
            "useful": u,
            "lost_gpu_h_per_day": lost_gpu_hours_per_day(cfg.gpus, u),
            "breakdown": shares,
            "dominant": max(shares, key=lambda k: shares[k]),
        }
    return out
