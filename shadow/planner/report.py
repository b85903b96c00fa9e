"""One plan: sizing, the analytic model and the simulation of every strategy, together."""

from __future__ import annotations

from typing import Any

from shadow.planner.config import PlanConfig
from shadow.planner.model import analyse, break_even_overhead, shadow_overhead, strategies
from shadow.planner.simulate import simulate_many
from shadow.planner.sizing import size, size_mix
from shadow.planner.storage import storage


def plan(cfg: PlanConfig, simulate: bool = True) -> dict:
    """Everything ``shadow plan`` reports for ``cfg`` (JSON-serialisable)."""
    sizing = size(cfg)
    restore = sizing["restore_GBps"]
    overhead, overhead_source = shadow_overhead(cfg)
    out: dict[str, Any] = {
        "scenario": {
            "name": cfg.name,
            "gpus": cfg.gpus,
            "job_mtbf_h": cfg.mtbf_s / 3600.0,
            "failures_per_day": 86400.0 / cfg.mtbf_s,
            "params": cfg.params,
            "state_TB": cfg.state_bytes / 1e12,
            "iteration_s": cfg.iteration_s,
            "restart_s": cfg.restart_s,
            "shadow_overhead": overhead,
            "shadow_overhead_source": overhead_source,
        },
        "analytic": analyse(cfg, restore),
        "break_even_shadow_overhead": break_even_overhead(cfg, restore),
        "sizing": sizing,
        "storage": storage(cfg, sizing),
    }
    if cfg.mix:
        out["mix"] = size_mix(cfg)
    if simulate:
        horizon = cfg.days * 86400.0
        out["simulated"] = {}
        for name, st in strategies(cfg, restore).items():
            sim = simulate_many(st, cfg.mtbf_s, horizon, cfg.trials, cfg.seed)
            sim["lost_gpu_h_per_day"] = cfg.gpus * 24.0 * (1.0 - sim["useful"])
            out["simulated"][name] = sim
    return out
