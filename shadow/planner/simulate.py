"""Discrete-event simulation of a job under one checkpointing strategy (seeded).

Events are failures (exponential inter-arrival times, mean ``mtbf_s``; also during a
restart, which then starts over) and the end of the horizon. Between two events the
timeline is deterministic -- cycles of ``wall_s`` work then ``stall_s`` checkpoint, each
checkpoint restorable ``delay_s`` after its cycle ends -- so the simulation jumps from
event to event and counts the cycles in between: its cost grows with the number of
failures, not of iterations, and a 100k-GPU month runs in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shadow.planner.model import Strategy


@dataclass
class Outcome:
    useful: float  #: progress / wall time
    failures: int
    restarts_s: float  #: wall time spent restarting
    rework_s: float  #: progress lost to rollbacks (wall seconds of work redone)

    def to_dict(self) -> dict:
        return {
            "useful": self.useful,
            "failures": self.failures,
            "restarts_s": self.restarts_s,
            "rework_s": self.rework_s,
        }


def _progress_at(st: Strategy, since: float) -> float:
    """Progress made ``since`` seconds after work (re)started from a checkpoint."""
    cycle = st.wall_s + st.stall_s
    n = math.floor(since / cycle)
    into = since - n * cycle
    return n * st.work_s + min(into, st.wall_s) / st.wall_s * st.work_s


def _restorable_at(st: Strategy, since: float) -> float:
    """Progress of the newest checkpoint restorable ``since`` seconds after work
    (re)started (the one it started from counts as 0)."""
    cycle = st.wall_s + st.stall_s
    return max(0, math.floor((since - st.delay_s) / cycle)) * st.work_s


def simulate(st: Strategy, mtbf_s: float, horizon_s: float, seed: int) -> Outcome:
    """One trial of ``horizon_s`` wall seconds."""
    rng = np.random.default_rng(seed)
    t, base = 0.0, 0.0  # wall time; progress of the checkpoint work restarted from
    failures, restarts, rework = 0, 0.0, 0.0
    while True:
        fail = t + rng.exponential(mtbf_s)
        if fail >= horizon_s:
            progress = base + _progress_at(st, horizon_s - t)
            return Outcome(progress / horizon_s, failures, restarts, rework)
        failures += 1
        done = _progress_at(st, fail - t)
        kept = _restorable_at(st, fail - t)
        rework += (done - kept) * st.wall_s / st.work_s
        base += kept
        t = fail
        while True:  # restart; a failure during it starts it over
            nxt = t + rng.exponential(mtbf_s)
            end = t + st.restart_s
            if nxt >= end or nxt >= horizon_s:
                break
            failures += 1
            restarts += nxt - t
            t = nxt
        if end >= horizon_s:
            restarts += horizon_s - t
            return Outcome(base / horizon_s, failures, restarts, rework)
        restarts += st.restart_s
        t = end


def simulate_many(st: Strategy, mtbf_s: float, horizon_s: float, trials: int, seed: int) -> dict:
    """Mean and spread of ``trials`` seeded trials."""
    runs = [simulate(st, mtbf_s, horizon_s, seed + i) for i in range(trials)]
    u = np.array([r.useful for r in runs])
    return {
        "useful": float(u.mean()),
        "useful_std": float(u.std(ddof=1)) if trials > 1 else 0.0,
        "failures_per_trial": float(np.mean([r.failures for r in runs])),
        "restart_share": float(np.mean([r.restarts_s for r in runs]) / horizon_s),
        "rework_share": float(np.mean([r.rework_s for r in runs]) / horizon_s),
        "trials": trials,
    }
