"""The storage side of a plan: what the shadow's persisted tiers hold, the bandwidth their
cadence needs, how long uploads and restores take, and which tier a restore reads after
each kind of failure.

The tiers are the ones the deployment recipes set up: shadow memory (every iteration,
``replicas`` copies), node-local disks on the shadow hosts (every ``local_every_n``
iterations; every replica writes its copy to its own host's disk), and an object store
(every ``remote_every_n`` iterations, one copy, compressed by ``remote_ratio``). A restore
from memory or from the disks travels over the shadow hosts' NICs; one from the object store
at the store's bandwidth. First-order figures: bandwidths are shared evenly and nothing
else competes for them."""

from __future__ import annotations

from typing import Any

from shadow.planner.config import PlanConfig
from shadow.planner.sizing import GB, measured_ratio


def _tier(every_n: int, nbytes: float, hosts_or_store_GBps: float, iteration_s: float, keep: int) -> dict:
    interval = every_n * iteration_s
    write_s = nbytes / (hosts_or_store_GBps * GB)
    return {
        "every_n": every_n,
        "interval_s": interval,
        "bytes": nbytes,
        "held_bytes": nbytes * (keep + 1),  # kept ones plus one being written
        "write_s": write_s,
        "needed_GBps": nbytes / interval / GB,
        "busy": write_s / interval,  # the share of the interval the write takes; above 1, checkpoints are skipped
        "fits": write_s <= interval,
    }


def storage(cfg: PlanConfig, sizing: dict) -> dict[str, Any]:
    """The storage figures of ``cfg`` on the shadow cluster ``sizing`` describes
    (:func:`shadow.planner.sizing.size`)."""
    st, sh = cfg.storage, cfg.shadow
    state, hosts, it = cfg.state_bytes, sizing["hosts"], cfg.iteration_s
    nic = hosts * sh.nic_GBps_per_host  # the shadow hosts' aggregate network, GB/s
    ratio, ratio_source = (st.remote_ratio, "given") if st.remote_ratio else measured_ratio(sh.bench_dir)
    out: dict[str, Any] = {
        "memory": {"bytes": state * sh.replicas, "restore_s": state / (sizing["restore_GBps"] * GB)},
        "remote_ratio": ratio,
        "remote_ratio_source": ratio_source,
    }
    if st.local_every_n:
        local = _tier(st.local_every_n, state * sh.replicas, hosts * st.disk_GBps_per_host, it, st.keep)
        local["bytes_per_host"] = local["bytes"] / hosts
        local["needed_GBps_per_host"] = local["needed_GBps"] / hosts
        # the shards come off each host's disk and over its NIC: one copy of each is read
        local["restore_s"] = state / (min(hosts * st.disk_GBps_per_host, nic) * GB)
        out["local"] = local
    if st.remote_every_n:
        # each worker uploads its own shard: the store, the hosts' disks (reading) or their NICs bound it
        up = min(st.object_store_GBps, hosts * st.disk_GBps_per_host, nic)
        remote = _tier(st.remote_every_n, state * ratio, up, it, st.keep)
        remote["upload_s"] = remote.pop("write_s")
        remote["restore_s"] = state * ratio / (st.object_store_GBps * GB)
        out["remote"] = remote
    out["after"] = after_failures(cfg, out)
    return out


def after_failures(cfg: PlanConfig, tiers: dict) -> list[dict]:
    """Which tier a restore reads after each kind of failure, the iterations lost (on
    average and at most) and how long reading the state takes."""
    lag = cfg.shadow.lag_iterations
    local, remote = tiers.get("local"), tiers.get("remote")
    disk = ("local", local) if local else ("remote", remote) if remote else (None, None)
    durable = ("remote", remote) if remote else (None, None)

    def row(failure: str, tier: tuple, why: str) -> dict:
        name, t = tier
        if name == "memory":
            lost, worst, restore_s = float(lag), float(lag), tiers["memory"]["restore_s"]
        elif t is None:
            return {"failure": failure, "tier": None, "why": why + "; no tier holds the state: the run starts over"}
        else:
            lost, worst, restore_s = lag + t["every_n"] / 2.0, float(lag + t["every_n"]), t["restore_s"]
        return {
            "failure": failure,
            "tier": name,
            "lost_iterations": lost,
            "lost_iterations_max": worst,
            "restore_s": restore_s,
            "why": why,
        }

    memory = ("memory", tiers["memory"])
    replica = memory if cfg.shadow.replicas > 1 else durable
    return [
        row("trainer GPUs, hosts or network", memory, "the shadow holds the last completed iteration"),
        row(
            "trainers and one shadow host with its disk",
            replica,
            "its shard's replica holds it" if cfg.shadow.replicas > 1 else "its shard was on that host only",
        ),
        row(
            "the whole shadow cluster, disks kept (power, network, all processes)", disk, "every disk holds its shards"
        ),
        row(
            "the whole shadow cluster with its disks (hosts replaced, allocation ended)",
            durable,
            "only the object store holds it",
        ),
    ]
