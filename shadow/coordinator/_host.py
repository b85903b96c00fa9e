"""What the coordinator's mixins (:mod:`attach`, :mod:`replicas`, :mod:`rebuild`,
:mod:`queries`, :mod:`trainers`) take from :class:`~shadow.coordinator.server.Coordinator`
and from each other, declared once for the type checker.

The fields are set in ``Coordinator.__init__`` (``sock`` in ``run``); the methods are
defined in the coordinator or in one of its mixins. Annotations without values and the
declarations under ``TYPE_CHECKING`` create nothing at run time: this base is empty there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import zmq

    from shadow.coordinator.persistence import Persistence
    from shadow.coordinator.records import JobRec, WorkerRec
    from shadow.security import Guard


class CoordinatorHost:
    """The state and methods of a coordinator that its mixins use (see the module docstring)."""

    bind: str
    expected: int  # worker slots
    replicas: int
    nshards: int
    ctx: zmq.Context
    sock: zmq.Socket  # the ROUTER every peer talks to
    workers: list[WorkerRec]
    job: JobRec | None
    # job name -> {"ranks": {rank: (ident, msg)}, "bytes": {rank: size held}, "held": their sum,
    #              "since": t, "told": n, "deadline": t}
    pending: dict[str, dict[str, Any]]
    _msg_bytes: int
    _failed_at: dict[str, float]
    rejected: dict[str, int]
    epoch: int
    _stop: bool
    started: float
    persist: Persistence
    tokens: dict[int, int]
    guard: Guard | None
    retired: dict[str, Any] | None
    resyncs: dict[str, int]
    starting: dict[int, dict[str, Any]]

    if TYPE_CHECKING:
        # server.Coordinator
        def _reply(self, envelope: list[bytes], kind: str, **fields: Any) -> None: ...
        def _count(self, reason: str) -> None: ...
        def _failed(self, reason: str, what: str) -> None: ...
        def _worker(self, envelope: list[bytes]) -> WorkerRec | None: ...
        def ready_workers(self, now: float | None = None) -> list[WorkerRec]: ...
        def _on_register(self, env: list[bytes], msg: dict[str, Any]) -> None: ...
        def _enrol(self, env: list[bytes], msg: dict[str, Any], fresh: bool) -> WorkerRec | None: ...
        def _degrade(self, reason: str) -> None: ...
        def _advance_cut(self) -> None: ...

        # attach.AttachMixin
        def pending_view(self) -> dict[str, int]: ...

        # replicas.ReplicaMixin
        def shard_of(self, w: WorkerRec) -> int: ...
        def healthy(self, w: WorkerRec, now: float | None = None) -> bool: ...
        def serving(self) -> list[WorkerRec] | None: ...
        def _replica_down(self, w: WorkerRec, reason: str) -> None: ...

        # queries.QueryMixin
        def _memory_info(self, job_name: str | None) -> dict[str, Any] | None: ...
