"""The one place where shadow's ZeroMQ sockets get their options.

Every socket: ``LINGER`` 0 (a closing service never waits on a peer that is gone) and,
where it receives, ``MAXMSGSIZE``: a peer announcing a larger message is disconnected
before anything is buffered. Server sockets (ROUTER, PULL) get CURVE from the process's
:class:`shadow.security.Guard` before they bind; client sockets (DEALER, PUSH) get the
process's :class:`shadow.security.ClientKeys` before they connect. A server socket in clear
with a ``door`` (``mac`` mode's data, serve and files sockets) takes ZeroMQ PLAIN, checked by
the guard (:meth:`shadow.security.Guard.door`); its clients bring a
:class:`shadow.security.Door` as their ``keys``. Every server socket drops a connection that
has not finished its handshake within :data:`HANDSHAKE_S`. High-water marks are
per use: the worker's data socket holds a few iterations' messages, the trainer's data
sockets ``Tuning.sndhwm_messages``.

Call order: build one factory per process part (``SocketFactory(ctx, guard=..., keys=...)``),
then ask it for sockets; the caller owns and closes them."""

from __future__ import annotations

import zmq

from shadow.config.choices import ROLES
from shadow.config.tuning import DEFAULT, Tuning
from shadow.wire import frames as F
from shadow.wire import messages as M

_CURRENT = object()
#: seconds a connection may take to finish its handshake before the server drops it (ZeroMQ's
#: default is 30 s): what bounds the descriptors a stranger holds with connections that never
#: finish one (its rate of new connections times this)
HANDSHAKE_S = 10.0
#: connections a worker's serve or files socket in clear holds at once beyond twice the
#: job's world (a restore of every rank at once connects each rank once; reconnects overlap)
DOOR_CONNECTIONS = 1024  # keys: this process's client keys (security.current_client), read when a socket is made


def fetch_limit(tuning: Tuning = DEFAULT) -> int:
    """The largest message a client of a service receives: a reply, or a fetched shard's head
    or chunk."""
    return max(M.socket_limit("client", tuning.max_commit_bytes), tuning.fetch_chunk_bytes)


def data_limit(tuning: Tuning = DEFAULT) -> int:
    """The largest data-plane frame: a payload part, a commit record or a full run table."""
    return max(F.MAX_PART_BYTES, tuning.max_commit_bytes, F.HEADER_SIZE + tuning.max_runs * F.RUN_SIZE)


def send_if_connected(router: zmq.Socket, frames: list[bytes]) -> bool:
    """Send ``frames`` (an identity, then the message) on ``router`` only if that identity is
    still connected; whether it was (a connected peer whose queue is full counts as connected)."""
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown identity raises instead of being dropped
    try:
        router.send_multipart(frames, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return True
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise
    finally:
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)


class SocketFactory:
    """Sockets of one context with shadow's options. ``guard``: the CURVE server side
    (None: plain); ``keys``: the CURVE client side (default: this process's keys,
    :func:`shadow.security.current_client`, at the time each socket is made; None: plain)."""

    def __init__(self, ctx: zmq.Context | None = None, guard=None, keys=_CURRENT) -> None:
        self.ctx = ctx if ctx is not None else zmq.Context.instance()
        self.guard = guard
        self._keys = keys

    def keys(self):
        if self._keys is _CURRENT:
            from shadow import security

            return security.current_client()
        return self._keys

    def _socket(self, kind: int, max_bytes: int | None) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if max_bytes is not None:
            s.setsockopt(zmq.MAXMSGSIZE, int(max_bytes))
        return s

    def _server(
        self, s: zmq.Socket, roles: tuple[str, ...], curve: bool = True, door=None, door_cap=None
    ) -> zmq.Socket:
        s.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        try:
            if curve and self.guard is not None:
                self.guard.server(s, roles)
            elif not curve and door is not None:
                if self.guard is not None:
                    self.guard.door(s, door, door_cap)
                else:  # parts of a keyed service built without its guard (tests): the context's
                    from shadow import security

                    security.doorkeeper(s.context).door(s, door, door_cap)
        except BaseException:
            s.close(linger=0)  # a socket left open would hold the context's term() forever
            raise
        return s

    def _client(self, s: zmq.Socket, address: str | None, keys) -> zmq.Socket:
        keys = self.keys() if keys is _CURRENT else keys
        if keys is not None:
            keys.apply(s)
        if address is not None:
            s.connect(address)
        return s

    def router(
        self,
        max_bytes: int,
        roles: tuple[str, ...] = ROLES,
        sndhwm: int | None = None,
        send_timeout_s: float | None = None,
        curve: bool = True,
        door=None,
        door_cap=None,
    ) -> zmq.Socket:
        """A server ROUTER (not bound yet) admitting peers of ``roles`` (with a guard): the
        coordinator's, a worker's serve and files sockets. A reply to a peer that has gone is
        dropped (``ROUTER_MANDATORY`` off), and so is a message over ``sndhwm`` queued for one
        peer (0: no limit; default zmq's 1000). With ``send_timeout_s``, a send to a peer with
        ``sndhwm`` queued waits for it that long, then raises ``zmq.Again``, and one to a peer
        that has gone raises ``EHOSTUNREACH`` (``ROUTER_MANDATORY`` on): the files socket, whose
        thread may block. ``curve=False``: in clear even with a guard (a serve socket in mac
        mode, whose requests carry tickets instead); then with a guard, ``door``: the
        check of the PLAIN credential a peer proves at the handshake, and ``door_cap`` the most
        connections it holds (:meth:`shadow.security.Guard.door`)."""
        s = self._socket(zmq.ROUTER, max_bytes)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1 if send_timeout_s is not None else 0)
        if send_timeout_s is not None:
            s.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        if sndhwm is not None:
            s.setsockopt(zmq.SNDHWM, int(sndhwm))
        return self._server(s, roles, curve, door, door_cap)

    def pull(
        self,
        max_bytes: int,
        rcvhwm: int,
        roles: tuple[str, ...] = ("trainer",),
        curve: bool = True,
        door=None,
        door_cap=None,
    ) -> zmq.Socket:
        """A server PULL (not bound yet) holding at most ``rcvhwm`` messages, admitting peers of
        ``roles`` (with a guard and ``curve``): a worker's data socket, which takes trainers
        only. ``curve=False``: in clear even with a guard (frames carry MACs instead), with
        ``door`` and ``door_cap`` as :meth:`router`'s."""
        s = self._socket(zmq.PULL, max_bytes)
        s.setsockopt(zmq.RCVHWM, int(rcvhwm))
        return self._server(s, roles, curve, door, door_cap)

    def dealer(self, address: str | None, max_bytes: int, keys=_CURRENT, rcvhwm: int | None = None) -> zmq.Socket:
        """A client DEALER, connected to ``address`` when given; ``rcvhwm``: the messages it
        holds at most before it stops reading the connection (default zmq's 1000)."""
        s = self._socket(zmq.DEALER, max_bytes)
        if rcvhwm is not None:
            s.setsockopt(zmq.RCVHWM, int(rcvhwm))
        return self._client(s, address, keys)

    def push(self, address: str | None, sndhwm: int, keys=_CURRENT) -> zmq.Socket:
        """A client PUSH (sends only) holding at most ``sndhwm`` messages: a trainer's data socket."""
        s = self._socket(zmq.PUSH, None)
        s.setsockopt(zmq.SNDHWM, int(sndhwm))
        return self._client(s, address, keys)
