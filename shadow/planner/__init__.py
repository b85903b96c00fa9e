"""Planning past one machine: expected lost GPU-hours under each checkpointing strategy
(analytic and simulated) and the size of the shadow cluster a job needs."""

from shadow.planner.config import AsyncConfig, MixJobConfig, PlanConfig, ShadowPlanConfig, SyncConfig
from shadow.planner.model import STRATEGIES, Strategy, analyse, break_even_overhead, daly, strategies, young
from shadow.planner.report import plan
from shadow.planner.simulate import simulate, simulate_many
from shadow.planner.sizing import BenchmarkMissing, size, size_mix

__all__ = [
    "AsyncConfig",
    "BenchmarkMissing",
    "MixJobConfig",
    "PlanConfig",
    "STRATEGIES",
    "ShadowPlanConfig",
    "Strategy",
    "SyncConfig",
    "analyse",
    "break_even_overhead",
    "daly",
    "plan",
    "simulate",
    "simulate_many",
    "size",
    "size_mix",
    "strategies",
    "young",
]
