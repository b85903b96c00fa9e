"""What the coordinator checks of a job's ``attach`` messages, as functions of the messages
and what the cluster holds (no sockets, no tiers): the layout every rank agrees on, whether
the workers have the memory for it, a rank's proof that it owns the job, a launch's restart
round, and whether the workers may keep the state they hold as the new epoch's base."""

from __future__ import annotations

from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.records import JobRec
from shadow.core.layout import Layout, shard_bounds
from shadow.core.sizing import human, nfields, session_bytes


def agreed_layout(msgs: list[dict]) -> Layout | str:
    """The layout every rank's ``attach`` agrees on, or why there is none."""
    first = msgs[0]
    if any(
        m["world"] != first["world"] or m["layout_hash"] != first["layout_hash"] or m["iteration"] != first["iteration"]
        for m in msgs
    ):
        return "ranks disagree on world size, layout or start iteration"
    if first["layout"] is None:
        return "rank 0 did not send the layout"
    try:
        layout = Layout.from_dict(first["layout"])
    except ValueError as exc:
        return str(exc)
    if layout.hash != first["layout_hash"]:
        return "layout does not match its hash"
    return layout


def memory_problem(state: ClusterState, name: str, layout: Layout, optim: dict, persist: bool) -> str | None:
    """Why the workers could not hold ``layout`` (``persist``: with a local tier's images):
    the ranges of the workers of each host need more than the least free memory a worker
    there reports."""
    bounds = shard_bounds(layout.total, state.nshards)
    hosts: dict[str, list] = {}
    for w in state.workers:
        start, stop = bounds[w.id % state.nshards]
        need = session_bytes(stop - start, nfields(optim), len(layout.params), persist, state.tuning)
        hosts.setdefault(host(w.data), []).append((w, need))
    for where, held in sorted(hosts.items()):
        known = [w.memory for w, _ in held if w.memory >= 0]
        need = sum(n for _, n in held)
        if not known or need <= min(known):
            continue
        w, one = max(held, key=lambda x: x[1])
        start, stop = bounds[w.id % state.nshards]
        shared = f" (with {len(held) - 1} other workers on host {where}: {human(need)} in all)" if len(held) > 1 else ""
        return (
            f"not enough memory: the layout of job {name!r} ({layout.total} elements) needs about "
            f"{human(one)} on worker {w.id} (range [{start}, {stop}): optimizer state, gradient slots"
            f"{', checkpoint images' if persist else ''}){shared}, and host {where} has {human(min(known))} "
            f"free; add workers (each holds 1/{state.nshards} of the elements), train a smaller model, or "
            "free memory on that host"
        )
    return None


def host(endpoint: str) -> str:
    """The host of a worker's ``tcp://host:port`` data endpoint (workers on one host
    share its memory)."""
    return endpoint.removeprefix("tcp://").rsplit(":", 1)[0]


def keepable(name: str, msgs: list[dict], generation: int, old: JobRec | None) -> int | None:
    """The epoch of ``old`` whose state the workers may keep as the base of job ``name``'s
    new epoch, instead of taking it from the ranks' STATE frames, or None. Offered when the
    cluster's memory holds exactly the ranks' start iteration, in the same layout, world and
    optimizer, of an epoch that never diverged, and every rank says it restored that
    iteration from this memory and can prove it (``keep``): not for a resync (``owner``).
    An offer is only that: each rank then proves, by a digest of every run it would have
    sent, that its state is the kept one, and a worker that finds any other goes stale (a
    resync then sends the state whole)."""
    first = msgs[0]
    base = first["iteration"]
    if (
        old is None
        or old.name != name
        or old.diverged is not None
        or old.cut != base
        or old.cut < old.base
        or old.layout_hash != first["layout_hash"]
        or old.world != first["world"]
        or old.optim != first["optim"]
    ):
        return None
    for m in msgs:
        r = m.get("restored")
        if m.get("keep") is not True or m.get("owner") is not None or not isinstance(r, dict):
            return None
        if r.get("tier") != "memory" or r.get("job") != name or r.get("iteration") != base:
            return None
        if r.get("generation") != generation:
            return None
    return old.epoch


def proves_owner(job: JobRec, rank: int, owner: object) -> bool:
    """``owner`` (an attach's) proves its sender is rank ``rank`` of ``job``'s epoch: the
    epoch and the rank token its ``attached`` gave it."""
    return (
        isinstance(owner, dict)
        and owner.get("epoch") == job.epoch
        and 0 <= rank < job.world
        and job.rank_token_ok(rank, owner.get("token"))
    )


def launch_of(value: object) -> dict | None:
    """An attach's ``launch`` (``{"run": str, "restart": int}``), or None when absent or
    not of that form."""
    if (
        isinstance(value, dict)
        and isinstance(value.get("run"), str)
        and 0 < len(value["run"]) <= 256
        and isinstance(value.get("restart"), int)
        and not isinstance(value["restart"], bool)
        and value["restart"] >= 0
    ):
        return {"run": value["run"], "restart": value["restart"]}
    return None


def next_round(held: dict | None, launch: object) -> bool:
    """``launch`` is a later restart round of the launch that attached ``held``: its
    launcher ended the earlier round's ranks before starting these."""
    new = launch_of(launch)
    return held is not None and new is not None and new["run"] == held["run"] and new["restart"] > held["restart"]
