"""The coordinator: membership, the consistent cut, status and restore discovery.

One ROUTER socket; every peer (worker, trainer rank, CLI) talks to it with a DEALER.
The cut rule: iteration k is declared applied only when every worker has reported
PREPARED(k); then every worker is told to apply through k and every trainer rank
learns the new cut (its flow-control credit).

The coordinator is composed of one :class:`~shadow.coordinator.cluster.ClusterState`, an
:class:`~shadow.coordinator.outbox.Outbox`, and components that handle the messages named
in :data:`~shadow.coordinator.routes.ROUTES`: :class:`~shadow.coordinator.membership.Membership`,
:class:`~shadow.coordinator.cut.Cut`, :class:`~shadow.coordinator.replicas.Replicas`,
:class:`~shadow.coordinator.rebuild.Rebuild`, :class:`~shadow.coordinator.attach.Attach`,
:class:`~shadow.coordinator.trainers.Trainers`, :class:`~shadow.coordinator.queries.Queries`,
:class:`~shadow.coordinator.jobs.Jobs` and :class:`~shadow.coordinator.persistence.Persistence`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import MethodType
from typing import Any

import zmq

from shadow import security
from shadow.config import PersistConfig
from shadow.config.tuning import Tuning
from shadow.coordinator import scope
from shadow.coordinator.attach import Attach
from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.cut import Cut
from shadow.coordinator.jobs import Jobs
from shadow.coordinator.membership import Membership
from shadow.coordinator.outbox import Outbox, ZmqOutbox
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.queries import Queries, status_view
from shadow.coordinator.rebuild import Rebuild
from shadow.coordinator.replicas import Replicas
from shadow.coordinator.routes import PERIODIC, ROUTES
from shadow.coordinator.trainers import Trainers
from shadow.coordinator.watch import LoopWatch
from shadow.core.errors import ShadowError
from shadow.security import Peer
from shadow.transport import SocketFactory
from shadow.wire import messages as M

logger = logging.getLogger(__name__)
#: frames of a control message on the coordinator's ROUTER: the sender's identity, then the body;
#: a message of more is dropped without being copied (ZeroMQ holds one whole until its last
#: frame, what a keyed peer can make it hold: see docs/operations.md)
CONTROL_FRAMES = 2


class Coordinator:
    """Membership, the committed cut, attaches, replicas and persistence of one cluster.

    Threads: :meth:`run` (the ``coordinator`` thread, or the process's main thread for
    ``shadow coordinator``) owns the ROUTER socket, :attr:`state` and every component:
    each message and each periodic step runs there, one at a time, so nothing is locked.
    :meth:`stop` (a signal handler) only sets a flag the loop reads. The metrics endpoint's
    HTTP thread reads the state without a lock (``coordinator.metrics.samples`` copies what
    it reads and never writes); the :class:`~shadow.security.Guard` has its own thread and
    counters.

    ``outbox``: where messages go instead of the socket (unit tests drive :meth:`on_message`
    without :meth:`run`); ``tuning``: the knobs (default: :meth:`Tuning.load`, the
    environment's); ``sign_key``: the key manifests are signed with (``persist.sign``)."""

    def __init__(
        self,
        bind: str,
        workers: int,
        persist: PersistConfig | None = None,
        guard=None,
        replicas: int = 1,
        outbox: Outbox | None = None,
        tuning: Tuning | None = None,
        sign_key: bytes | None = None,
    ) -> None:
        self.bind = bind
        self.tuning = tuning if tuning is not None else Tuning.load()
        self.state = ClusterState(expected=workers, replicas=replicas, tuning=self.tuning, keyed=guard is not None)
        self.guard = guard  # shadow.security.Guard when CURVE is on
        self.persist = Persistence(persist, self.tuning, sign_key)
        self.socket_out: ZmqOutbox | None = None  # the socket's outbox, opened by run()
        if outbox is None:
            outbox = self.socket_out = ZmqOutbox()
        self.out: Outbox = outbox
        # each message and periodic step timed; a slow one logged by name, a stalled one with its stack
        self.watch = self.state.loop = LoopWatch(self.tuning.loop_slow_s)
        self._stop = False
        # a shared cluster's front wants the memory (SIGUSR1 to `shadow cluster`): the held job's
        # last iteration to the local tier first (:meth:`Cut.keep_last`); ``last_kept``: done
        self.keep_last_asked = False
        self.last_kept = False
        self._build()

    def _build(self) -> None:
        """The components, each given the state, the outbox and the components it calls, and
        the tables :meth:`on_message` and :meth:`tick` dispatch through."""
        st, out, persist = self.state, self.out, self.persist
        self.cut = Cut(st, out, persist)
        self.replicas = Replicas(st, out, self.cut, persist)
        self.attach = Attach(st, out, persist, self.cut)
        self.membership = Membership(st, out, self.cut, self.replicas, self.attach)
        self.rebuild = Rebuild(st, out, self.cut, self.membership, persist)
        self.trainers = Trainers(st, out, self.cut, self.replicas)
        self.queries = Queries(st, out, persist, self.guard)
        self.jobs = Jobs(st, out, persist)
        components: dict[type, object] = {
            type(c): c
            for c in (
                self.cut,
                self.replicas,
                self.attach,
                self.membership,
                self.rebuild,
                self.trainers,
                self.queries,
                self.jobs,
            )
        }
        self.routes: dict[str, Callable[..., None]] = {t: r.bind(components) for t, r in ROUTES.items()}
        self.periodic: dict[str, Callable[[], None]] = {
            method.__name__: MethodType(method, components[component]) for component, method in PERIODIC
        }

    def run(self) -> None:
        sock = SocketFactory(zmq.Context.instance(), guard=self.guard).router(
            M.socket_limit("coordinator", self.tuning.max_commit_bytes)
        )
        # a worker that replaced a silent connection keeps its routing id (16 random bytes that
        # only it knows; shadow.worker.outbox.silence_options): the new connection takes it over
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            sock.bind(self.bind)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ShadowError(
                f"the coordinator cannot listen on {self.bind}: {exc}"
                + (
                    " (another cluster or program holds that port: choose another with port=, or stop it)"
                    if exc.errno == zmq.EADDRINUSE
                    else ""
                )
            ) from None
        if self.socket_out is not None:
            self.socket_out.sock = sock
        logger.info("coordinator listening on %s, expecting %d workers", self.bind, self.state.expected)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        lane = self.persist.lane
        lane.failed = lambda what: self.state.rejected.failed("lane", f"what follows {what}")
        lane.start()  # tier I/O off this thread from now on
        poller.register(lane.fileno(), zmq.POLLIN)
        self.watch.start()
        try:
            while not self._stop:
                if poller.poll(timeout=200):
                    self._drain_lane()
                    for _ in range(256):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if len(frames) > CONTROL_FRAMES:  # never copied: a peer's bulk costs no stall
                            self.state.rejected.add("multipart")
                            logger.warning("dropped a control message of %d frames, unread", len(frames))
                            continue
                        peer = security.peer_of(frames[-1]) if self.guard is not None else None
                        self.on_message(
                            [f.bytes for f in frames], peer.role if peer else None, peer.jobs if peer else None
                        )
                self.tick()
        finally:
            self.watch.stop()
            lane.stop()
            sock.close(linger=0)
            if self.guard is not None:
                self.guard.stop()

    def stop(self) -> None:
        self._stop = True

    def _drain_lane(self) -> None:
        """Run what follows the storage work the lane finished (replies, records, follow-ups)."""
        self.watch.begin("what follows the storage lane's work")
        try:
            self.persist.lane.drain()  # (also empties the pipe that woke the poll)
        finally:
            self.watch.end()

    def status(self) -> dict[str, Any]:
        """What ``shadow status`` shows (:func:`~shadow.coordinator.queries.status_view`)."""
        return status_view(self.state, self.persist, self.guard)

    def tick(self) -> None:
        """Run every periodic step; one that raises (state built from some message) is
        counted and logged, and the others still run."""
        watch = self.watch
        if self.keep_last_asked and self.cut.keep_last() is None:  # on the tier, or it cannot be
            self.keep_last_asked, self.last_kept = False, True
        for name, step in self.periodic.items():
            watch.begin(name)
            try:
                step()
            except Exception:
                self.state.rejected.failed("periodic_" + name, f"periodic step {name}")
            finally:
                watch.end()

    def refuse(self, envelope: list[bytes], role: str | None, reason: str, message: str) -> None:
        """Refuse one message: counted by role and reason, answered with a ``refused`` error."""
        self.state.refuse(role, reason)
        logger.warning("refused a message (%s from %s): %s", reason, role or "an unauthenticated peer", message)
        self.out.reply(envelope, "error", code="refused", message=message)

    def _malformed(self, envelope: list[bytes], exc: M.MessageError) -> None:
        self.state.rejected.add(exc.reason)
        logger.warning("rejected control message: %s", exc)
        self.out.reply(envelope, "error", code="malformed", message=f"rejected: {exc}")

    def on_message(self, parts: list[bytes], role: str | None = None, jobs: tuple[str, ...] | None = None) -> None:
        """Check and route one message from the ROUTER (envelope frames, then the body),
        sent by a peer of ``role`` (None: no authentication, any role) limited to ``jobs``
        (None: every job; :mod:`~shadow.coordinator.scope`). The type is read
        from the body's first bytes and checked against the sender's role (and a worker's
        identity) before the body is decoded: a refused peer costs the bytes it sent, not
        the objects its body would build."""
        st = self.state
        if len(parts) < 2:
            st.rejected.add("malformed")
            return
        envelope, raw = parts[:-1], parts[-1]
        try:
            kind = M.peek_type(raw)
        except M.MessageError as exc:
            self._malformed(envelope, exc)
            return
        route, handler = ROUTES.get(kind), self.routes.get(kind)
        if route is None or handler is None:
            st.rejected.add("unexpected")
            self.out.reply(envelope, "error", code="refused", message=f"coordinator does not accept {kind!r} messages")
            return
        if role is not None and role not in route.roles:
            article = "an" if role[0] in "aeiou" else "a"
            allowed = sorted(route.roles)
            dirs = " or ".join(f"security.allow_{r}s" for r in allowed)
            self.refuse(
                envelope,
                role,
                "role",
                f"{article} {role} may not send {kind!r} messages: the cluster takes them from {', '.join(allowed)} "
                f"keys only (connect with a key whose public half is in the cluster's {dirs})",
            )
            return
        if route.worker_only and st.worker(envelope[0]) is None:
            st.rejected.add("not_a_worker")  # (or a worker of a previous coordinator, not rejoined yet)
            return
        self.watch.begin(f"a {kind} message")  # timed from its decoding on: a slow one is logged by name
        try:
            self._handle(envelope, raw, kind, route, handler, role, jobs)
        finally:
            self.watch.end()

    def _handle(
        self,
        envelope: list[bytes],
        raw: bytes,
        kind: str,
        route,
        handler,
        role: str | None,
        jobs: tuple[str, ...] | None,
    ) -> None:
        """Decode one message that passed :meth:`on_message`'s checks, check a job-scoped
        sender's job, and run its handler."""
        st = self.state
        try:
            msg = M.decode(raw, self.tuning.max_commit_bytes)
        except M.MessageError as exc:
            self._malformed(envelope, exc)
            return
        st.sender_role = role
        st.sender = Peer(role, jobs) if role is not None else None
        if st.sender is not None and st.sender.jobs is not None:
            why = scope.problem(st, kind, msg, st.sender)
            if why is not None:
                self.refuse(envelope, role, "scope", why)
                return
        try:
            if route.sized:
                handler(envelope, msg, size=len(raw))
            else:
                handler(envelope, msg)
        except Exception as exc:  # a bug meeting an input: count it, answer, and carry on
            st.rejected.failed("handler_" + kind, f"the {kind} handler")
            try:
                self.out.reply(
                    envelope,
                    "error",
                    code="internal",
                    message=f"the coordinator could not handle this {kind} message "
                    f"({type(exc).__name__}: {exc}); it was dropped",
                )
            except Exception:  # the envelope itself may be the problem
                logger.debug("could not answer a failed %s message", kind, exc_info=True)
