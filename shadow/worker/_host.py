"""What the worker's mixins (:mod:`apply`, :mod:`peer`, :mod:`fetches`) take from
:class:`~shadow.worker.server.Worker` and from each other, declared once for the type
checker.

The fields are set in ``Worker.__init__`` (the sockets and their endpoints when they are
opened); the methods are defined in the worker or in one of its mixins. Annotations
without values and the declarations under ``TYPE_CHECKING`` create nothing at run time:
this base is empty there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections import Counter

    import zmq

    from shadow.security import ClientKeys
    from shadow.transport.receive import FrameReceiver
    from shadow.worker.assignment import Assignment
    from shadow.worker.fetches import Reply
    from shadow.worker.peer import PeerCopy


class WorkerHost:
    """The state and methods of a worker that its mixins use (see the module docstring)."""

    worker_id: int
    keys: ClientKeys | None  # CURVE client keys, for the connection to a peer
    ctx: zmq.Context
    data: zmq.Socket  # PULL: the trainers' frames
    data_ep: str
    serve: zmq.Socket  # ROUTER: fetches of restore clients and peers
    serve_ep: str
    rejected: Counter[str]
    rx: FrameReceiver | None  # reads the data socket (set with it)
    assignment: Assignment | None
    retired: Assignment | None  # the previous epoch, served while the new one bootstraps
    pending_fetch: list[tuple[bytes, dict[str, Any], float]]  # (client, fetch, deadline)
    replies: dict[bytes, Reply]  # client identity -> its shard reply, until zmq is done with it
    awaiting_copy: bool  # a replacement replica: data frames stay queued until its peer copy
    peer: PeerCopy | None
    replay_s: float
    replayed: int
    persisted: dict[str, list[Any]]  # tier -> [seconds, shards, bytes, failures]

    if TYPE_CHECKING:
        # server.Worker
        def _open_data(self) -> None: ...
        def _to_coord(self, kind: str, **fields: Any) -> None: ...
        def _go_stale(self, reason: str) -> None: ...

        # serve.FetchMixin
        def _answer_fetches(self) -> None: ...
        def _wait_for_readers(self) -> None: ...
