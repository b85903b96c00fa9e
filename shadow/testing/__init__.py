"""What tests, benchmarks and the fault matrix share: a local cluster that always stops
(:class:`LocalCluster`), bounded waits on explicit conditions (:func:`wait_until`), free
ports on 127.0.0.1, the bit-for-bit comparison of trainer state
(:func:`assert_same_state`, imported lazily: it needs torch, the rest does not), and a
tier's retention contract (:func:`retention_problems`, imported lazily too).

Nothing in the service imports this package; it starts real processes and is meant for
127.0.0.1 only."""

from __future__ import annotations

from shadow.testing.cluster import LocalCluster, pid_alive, rss_bytes, status
from shadow.testing.faults import ServiceFaults
from shadow.testing.ports import free_port, free_port_run
from shadow.testing.wait import wait_until

__all__ = [
    "LocalCluster",
    "ServiceFaults",
    "assert_same_state",
    "free_port",
    "free_port_run",
    "pid_alive",
    "retention_problems",
    "rss_bytes",
    "live_state",
    "state_differences",
    "status",
    "ulp_report",
    "wait_until",
]


def __getattr__(name: str):
    if name in ("assert_same_state", "live_state", "state_differences", "ulp_report"):
        from shadow.testing import state

        return getattr(state, name)
    if name == "retention_problems":
        from shadow.testing.retention import retention_problems

        return retention_problems
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
