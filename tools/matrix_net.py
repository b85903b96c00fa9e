"""The network fault scenarios of the fault matrix (``tools/fault_matrix.py --scenarios net``):
hosts apart, each fault one of :mod:`netfaults`. Each is registered with ``@net_scenario``."""

from __future__ import annotations

import netfaults  # tools/ is on sys.path when run as a script
from faultlib import (
    Trial,
    net_scenario,
)


@net_scenario
def net_trainer_worker_cut(t: Trial) -> dict:
    """The trainers' host cut off from one worker mid-send for 1-3 s (the worker still talks
    to the coordinator), then healed: the queued stream resumes over the same connection."""
    w = t.rng.choice(["w1", "w2"])
    return netfaults.net_trial("net_trainer_worker_cut", t, netfaults.cut("here", w, t.rng.uniform(1.0, 3.0)))


@net_scenario
def net_trainer_worker_cut_long(t: Trial) -> dict:
    """The same cut held past the trainers' loss timeout (SHADOW_BLOCK_TIMEOUT_S): they train
    on unprotected, and after the heal the cluster resyncs from their state."""
    w = t.rng.choice(["w1", "w2"])
    hold = t.rng.uniform(netfaults.BLOCK_TIMEOUT_S + 1.0, netfaults.BLOCK_TIMEOUT_S + 4.0)
    return netfaults.net_trial("net_trainer_worker_cut_long", t, netfaults.cut("here", w, hold), steps=150)


@net_scenario
def net_split_brain(t: Trial) -> dict:
    """A worker cut off from the coordinator past its loss timeout while the trainers still
    reach it: the coordinator declares it lost, the job goes on without it, and it must never
    serve, persist or report as newest a state the cluster has moved past."""
    w = t.rng.choice(["w1", "w2"])
    hold = t.rng.uniform(netfaults.WORKER_LOST_S + 1.0, netfaults.WORKER_LOST_S + 4.0)
    return netfaults.net_trial("net_split_brain", t, netfaults.cut("coord", w, hold), steps=120)


@net_scenario
def net_one_way_to_worker(t: Trial) -> dict:
    """An asymmetric partition: the coordinator's packets to a worker are lost (its
    commands, and the acknowledgements of what the worker sends), while the worker's still
    reach the coordinator, held past the loss timeout. The coordinator hears the worker for
    a while but cannot command it; nothing may commit that the worker did not apply, and a
    restore must never wait on, or read, an iteration the worker was never told to apply."""
    w = t.rng.choice(["w1", "w2"])
    hold = t.rng.uniform(netfaults.WORKER_LOST_S + 1.0, netfaults.WORKER_LOST_S + 4.0)
    return netfaults.net_trial("net_one_way_to_worker", t, netfaults.one_way("coord", w, hold), steps=120)


@net_scenario
def net_one_way_from_worker(t: Trial) -> dict:
    """The other way: a worker's packets to the coordinator are lost (its heartbeats and
    reports) while the coordinator's commands still arrive: the worker goes on applying what
    it is told while the coordinator hears nothing from it, declares it lost, and must not
    count it, or anything it persists meanwhile, as holding a newer state."""
    w = t.rng.choice(["w1", "w2"])
    hold = t.rng.uniform(netfaults.WORKER_LOST_S + 1.0, netfaults.WORKER_LOST_S + 4.0)
    return netfaults.net_trial("net_one_way_from_worker", t, netfaults.one_way(w, "coord", hold), steps=120)


@net_scenario
def net_coordinator_isolated(t: Trial) -> dict:
    """The coordinator's host isolated from everyone for 1-7 s (shorter and longer than the
    trainers' SHADOW_COORDINATOR_LOST_S and the workers' loss timeout), then healed."""
    hold = t.rng.uniform(1.0, netfaults.COORDINATOR_LOST_S + 4.0)
    return netfaults.net_trial("net_coordinator_isolated", t, netfaults.isolate("coord", hold), steps=150)


@net_scenario
def net_replica_recopy_cut(t: Trial) -> dict:
    """replicas=2 on 4 worker hosts: a worker is SIGKILLed and started again, and its link to
    the peer it recopies its shard from is cut while it does so (2-4 s); then healed."""
    return netfaults.net_trial(
        "net_replica_recopy_cut",
        t,
        netfaults.recopy_cut(t.rng.randrange(4), t.rng.uniform(2.0, 4.0)),
        steps=150,
        rig_kw={"workers": 4, "replicas": 2},
    )


@net_scenario
def net_store_unreachable(t: Trial) -> dict:
    """The object store's host (S3, every 4 iterations) isolated for 3-8 s while the local
    tier (every iteration, keep 3) keeps writing; healed, the remote tier catches up."""
    return netfaults.net_trial(
        "net_store_unreachable",
        t,
        netfaults.isolate("store", t.rng.uniform(3.0, 8.0)),
        steps=120,
        rig_kw={"store": True},
        protected=True,
    )


@net_scenario
def net_flapping_link(t: Trial) -> dict:
    """A link (the trainers' to a worker, or a worker's to the coordinator) cut and healed
    every second for a minute."""
    a, b = t.rng.choice([("here", "w1"), ("coord", "w1"), ("here", "w2"), ("coord", "w2")])
    return netfaults.net_trial("net_flapping_link", t, netfaults.flap(a, b, 60.0, 1.0), steps=340, step_sleep=0.25)


def _capped(t: Trial, policy: str) -> dict:
    w = t.rng.choice(["w1", "w2"])
    return netfaults.net_trial(
        f"net_capped_{policy}",
        t,
        netfaults.cap(w, "1gbit", t.rng.uniform(4.0, 8.0)),
        policy=policy,
        steps=100,
        protected=True,
    )


@net_scenario
def net_capped_block(t: Trial) -> dict:
    """A worker's host capped at 1 Gbit/s for 4-8 s, policy block."""
    return _capped(t, "block")


@net_scenario
def net_capped_skip(t: Trial) -> dict:
    """The same under policy skip."""
    return _capped(t, "skip")


@net_scenario
def net_restore_in_partition(t: Trial) -> dict:
    """A restore started while a worker is cut off from the coordinator: it returns the
    trainer's exact state at the iteration it names, from whichever source still holds one
    complete, or fails saying why; never a wrong state."""
    w = t.rng.choice(["w1", "w2"])
    hold = t.rng.uniform(netfaults.WORKER_LOST_S + 2.0, netfaults.WORKER_LOST_S + 5.0)
    return netfaults.net_trial(
        "net_restore_in_partition", t, netfaults.cut("coord", w, hold), steps=120, during=netfaults.restore_now
    )
