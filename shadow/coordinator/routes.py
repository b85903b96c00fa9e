"""Which component handles each control message the coordinator accepts, and from whom: :data:`ROUTES`.

A message type missing here is refused (``unexpected``); ``shutdown`` is among them: the
coordinator stops on a signal to its own process, never on a message. ``roles``: the roles
(:data:`shadow.choices.ROLES`) whose keys may send it; on a cluster with CURVE keys anything
else is refused and counted by role and reason (status ``refused_by_role``, metric
``shadow_refused_messages``); a cluster started without keys of its own has this user's key
set, so this holds by default. Only without any keys (``security.insecure=true``, warned at
every start) may every peer send anything. ``worker_only``: accepted only from a
registered worker's connection (from anyone else it is counted as ``not_a_worker`` and
dropped). ``sized``: the handler is also given the message's size on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

WORKER = frozenset({"worker"})
TRAINER = frozenset({"trainer"})
READERS = frozenset({"trainer", "client", "admin"})  # a trainer restores (and asks for its job) too
ADMIN = frozenset({"admin"})  # what changes the cluster on a person's word (shadow drop)


@dataclass(frozen=True)
class Route:
    component: str  # attribute of the Coordinator holding the handler
    handler: str  # its method: handler(envelope, msg) (+ size=bytes when sized)
    roles: frozenset[str]
    worker_only: bool = False
    sized: bool = False


ROUTES: dict[str, Route] = {
    # workers
    "starting": Route("membership", "on_starting", WORKER),
    "register": Route("membership", "on_register", WORKER),
    "rejoin": Route("rebuild", "on_rejoin", WORKER),
    "heartbeat": Route("membership", "on_heartbeat", WORKER),
    "stale": Route("membership", "on_stale", WORKER, worker_only=True),
    "configured": Route("cut", "on_configured", WORKER, worker_only=True),
    "prepared": Route("cut", "on_prepared", WORKER, worker_only=True),
    "persisted": Route("cut", "on_persisted", WORKER, worker_only=True),
    "audited": Route("cut", "on_audited", WORKER, worker_only=True),
    "copied": Route("replicas", "on_copied", WORKER, worker_only=True),
    # trainers
    "attach": Route("attach", "on_attach", TRAINER, sized=True),
    "detach": Route("attach", "on_detach", TRAINER),
    "trainer_hb": Route("trainers", "on_trainer_hb", TRAINER),
    "paused": Route("trainers", "on_paused", TRAINER),
    "lagging": Route("trainers", "on_lagging", TRAINER),
    "replica_from": Route("replicas", "on_replica_from", TRAINER),
    # readers: trainers restoring, clients (status, ls, restore, export), admins
    "status": Route("queries", "on_status", READERS),
    "restore_info": Route("queries", "on_restore_info", READERS),
    "catalog": Route("queries", "on_catalog", READERS),
    # the jobs the cluster knows (readers: a resuming trainer asks whether its job is there), and
    # detaching a crashed one (admins)
    "jobs": Route("jobs", "on_jobs", READERS),
    "drop": Route("jobs", "on_drop", ADMIN),
}

#: periodic steps the loop runs after each poll, in order: (component, method)
PERIODIC: tuple[tuple[str, str], ...] = (
    ("attach", "start_attaches"),
    ("attach", "expire_attaches"),
    ("membership", "check_workers"),
    ("trainers", "check_transit"),
    ("cut", "retry_persist"),
)
