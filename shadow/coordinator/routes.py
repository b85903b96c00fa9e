"""Which component handles each control message the coordinator accepts: :data:`ROUTES`.

A message type missing here is refused (``unexpected``). ``worker_only``: accepted only from
a registered worker's connection (from anyone else it is counted as ``not_a_worker`` and
dropped). ``sized``: the handler is also given the message's size on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    component: str  # attribute of the Coordinator holding the handler
    handler: str  # its method: handler(envelope, msg) (+ size=bytes when sized)
    worker_only: bool = False
    sized: bool = False


ROUTES: dict[str, Route] = {
    # workers
    "starting": Route("membership", "on_starting"),
    "register": Route("membership", "on_register"),
    "rejoin": Route("rebuild", "on_rejoin"),
    "heartbeat": Route("membership", "on_heartbeat"),
    "stale": Route("membership", "on_stale", worker_only=True),
    "configured": Route("cut", "on_configured", worker_only=True),
    "prepared": Route("cut", "on_prepared", worker_only=True),
    "persisted": Route("cut", "on_persisted", worker_only=True),
    "audited": Route("cut", "on_audited", worker_only=True),
    "copied": Route("replicas", "on_copied", worker_only=True),
    # trainers
    "attach": Route("attach", "on_attach", sized=True),
    "detach": Route("attach", "on_detach"),
    "trainer_hb": Route("trainers", "on_trainer_hb"),
    "paused": Route("trainers", "on_paused"),
    "lagging": Route("trainers", "on_lagging"),
    "replica_from": Route("replicas", "on_replica_from"),
    # clients
    "status": Route("queries", "on_status"),
    "restore_info": Route("queries", "on_restore_info"),
    "shutdown": Route("lifecycle", "on_shutdown"),
}

#: periodic steps the loop runs after each poll, in order: (component, method)
PERIODIC: tuple[tuple[str, str], ...] = (
    ("attach", "start_attaches"),
    ("attach", "expire_attaches"),
    ("membership", "check_workers"),
    ("trainers", "check_transit"),
)
