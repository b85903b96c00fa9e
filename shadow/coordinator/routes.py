"""Which component handles each control message the coordinator accepts, and from whom: :data:`ROUTES`.

Each route holds its handler itself (the component's method, unbound; mypy and
go-to-definition follow it), bound to the coordinator's instance of that component when the
coordinator starts, as the worker's ``ROUTES`` holds ``Worker`` methods.

A message type missing here is refused (``unexpected``); ``shutdown`` is among them: the
coordinator stops on a signal to its own process, never on a message. ``roles``: the roles
(:data:`shadow.config.choices.ROLES`) whose keys may send it; on a cluster with CURVE keys anything
else is refused and counted by role and reason (status ``refused_by_role``, metric
``shadow_refused_messages``); a cluster started without keys of its own has this user's key
set, so this holds by default. Only without any keys (``security.insecure=true``, warned at
every start) may every peer send anything. ``worker_only``: accepted only from a
registered worker's connection (from anyone else it is counted as ``not_a_worker`` and
dropped). ``sized``: the handler is also given the message's size on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType

from shadow.coordinator.attach import Attach
from shadow.coordinator.cut import Cut
from shadow.coordinator.jobs import Jobs
from shadow.coordinator.membership import Membership
from shadow.coordinator.queries import Queries
from shadow.coordinator.rebuild import Rebuild
from shadow.coordinator.replicas import Replicas
from shadow.coordinator.trainers import Trainers

WORKER = frozenset({"worker"})
TRAINER = frozenset({"trainer"})
READERS = frozenset({"trainer", "client", "admin"})  # a trainer restores (and asks for its job) too
ADMIN = frozenset({"admin"})  # what changes the cluster on a person's word (shadow drop)


@dataclass(frozen=True)
class Route:
    component: type  # the component class whose instance handles it (one per Coordinator)
    handler: Callable[..., None]  # its method, unbound: handler(component, envelope, msg) (+ size=bytes when sized)
    roles: frozenset[str]
    worker_only: bool = False
    sized: bool = False

    def bind(self, components: dict[type, object]) -> Callable[..., None]:
        """The handler bound to this coordinator's instance of :attr:`component`."""
        return MethodType(self.handler, components[self.component])


ROUTES: dict[str, Route] = {
    # workers
    "starting": Route(Membership, Membership.on_starting, WORKER),
    "register": Route(Membership, Membership.on_register, WORKER),
    "rejoin": Route(Rebuild, Rebuild.on_rejoin, WORKER),
    "heartbeat": Route(Membership, Membership.on_heartbeat, WORKER),
    "stale": Route(Membership, Membership.on_stale, WORKER, worker_only=True),
    "configured": Route(Cut, Cut.on_configured, WORKER, worker_only=True),
    "prepared": Route(Cut, Cut.on_prepared, WORKER, worker_only=True),
    "persisted": Route(Cut, Cut.on_persisted, WORKER, worker_only=True),
    "audited": Route(Cut, Cut.on_audited, WORKER, worker_only=True),
    "copied": Route(Replicas, Replicas.on_copied, WORKER, worker_only=True),
    # trainers
    "attach": Route(Attach, Attach.on_attach, TRAINER, sized=True),
    "detach": Route(Attach, Attach.on_detach, TRAINER),
    "trainer_hb": Route(Trainers, Trainers.on_trainer_hb, TRAINER),
    "paused": Route(Trainers, Trainers.on_paused, TRAINER),
    "lagging": Route(Trainers, Trainers.on_lagging, TRAINER),
    "replica_from": Route(Replicas, Replicas.on_replica_from, TRAINER),
    # readers: trainers restoring, clients (status, ls, restore, export), admins
    "status": Route(Queries, Queries.on_status, READERS),
    "restore_info": Route(Queries, Queries.on_restore_info, READERS),
    "catalog": Route(Queries, Queries.on_catalog, READERS),
    # the jobs the cluster knows (readers: a resuming trainer asks whether its job is there), and
    # detaching a crashed one (admins)
    "jobs": Route(Jobs, Jobs.on_jobs, READERS),
    "drop": Route(Jobs, Jobs.on_drop, ADMIN),
}

#: periodic steps the loop runs after each poll, in order: (component class, its method, unbound)
PERIODIC: tuple[tuple[type, Callable[..., None]], ...] = (
    (Attach, Attach.start_attaches),
    (Attach, Attach.expire_attaches),
    (Membership, Membership.check_workers),
    (Trainers, Trainers.check_transit),
    (Cut, Cut.retry_persist),
)
