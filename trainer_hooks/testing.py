"""Trainer-side fault injection, as wrappers around the production classes (tests, the
fault matrix, and anyone who wants to see the shadow survive): nothing here is imported
by the production modules, and nothing in them checks for faults.

:func:`inject` (or :func:`inject_from_env`, which reads ``SHADOW_FAULT_NET`` and
``SHADOW_FAULT_DIE_AT``) makes every session attached afterwards in this thread (and its
resyncs) send through a :class:`FaultySender`; :func:`faults` does the same for the
sessions attached inside a ``with`` block. Neither patches anything: the faulty sender
reaches a session as its sender factory, through the context variable
:data:`~trainer_hooks.session.sender.SENDER_FACTORY` a session reads when it is built, or
passed directly (``Session(..., sender_factory=testing.sender_factory(net=...))``).

``net="drop=0.02,dup=0.02,reorder=0.02,truncate=0.02,bitflip=0.02,seed=7,until=30"``
makes each data message (GRAD, STATE or COMMIT, to one worker) of iterations in
``[from, until)`` suffer at most one fault, drawn with the given probabilities from a
generator seeded by ``seed`` and the rank (with ``cover=1``, the first faults drawn go
through every listed kind once, rank r starting at the (2r)-th kind, so that even a short
run in which each of two ranks draws three faults sees every kind):

* drop      -- never sent (its sequence number is used: the worker sees a gap);
* dup       -- sent twice (the worker drops the second copy by sequence number);
* reorder   -- held back and sent after the next message to the same worker;
* truncate  -- the last frame of the message is left off (or the header is cut short);
* bitflip   -- one random bit of one random frame (header, run table or payload) flipped.

``die_at="k:n"``: iteration k sends its first n messages (gradient and commit messages
alike) normally, then everything else only to worker 0, then the process dies (exit 137)
once k's commit is out. With n at least the iteration's message count nothing is held back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Iterator

import zmq

from shadow.testing.faults import FaultyDataSender, NetFaults, parse
from shadow.transport.send import DataSender
from trainer_hooks.session.items import CommitItem
from trainer_hooks.session.sender import SENDER_FACTORY, Sender, SenderFactory, data_channels

logger = logging.getLogger(__name__)

__all__ = [
    "FaultyDataSender",
    "FaultySender",
    "NetFaults",
    "faults",
    "inject",
    "inject_from_env",
    "parse_die_at",
    "sender_factory",
]


def parse_die_at(spec: str | None) -> tuple[int, int] | None:
    """``"k:n"`` (n defaults to 0) as ``(k, n)``."""
    if not spec:
        return None
    k, _, n = spec.partition(":")
    try:
        return int(k), int(n or 0)
    except ValueError:
        raise ValueError(f"die_at={spec!r}: expected 'iteration:messages', e.g. '5:3'") from None


class FaultySender(Sender):
    """A :class:`Sender` whose messages pass through the faults it is built with
    (``net_spec``, ``die_at``): its data channels are wrapped in a
    :class:`FaultyDataSender` (passed to :class:`Sender` as its ``channels``); ``net`` may
    also be set or cleared on a live one."""

    def __init__(self, *args, net_spec: str | None = None, die_at: tuple[int, int] | None = None, **kwargs) -> None:
        inner = kwargs.pop("channels", data_channels)
        super().__init__(*args, channels=functools.partial(self._open_faulty, inner), **kwargs)
        self.die_at = die_at
        self._net: NetFaults | None = parse(net_spec, self.rank)
        self._faulty: FaultyDataSender | None = None
        self._die_sent = 0

    def _open_faulty(self, inner, ctx: zmq.Context, endpoints: list[str], hwm: int, curve) -> DataSender:
        self._faulty = FaultyDataSender(inner(ctx, endpoints, hwm, curve), self._net)
        return self._faulty

    @property
    def net(self) -> NetFaults | None:
        return self._net

    @net.setter
    def net(self, value: NetFaults | None) -> None:
        self._net = value
        if self._faulty is not None:
            self._faulty.net = value

    def _send(self, w: int, frames: list, track: bool, iteration: int):
        if self.die_at is not None and iteration == self.die_at[0]:
            if self._die_sent >= self.die_at[1] and w != 0:
                self.seq[w] -= 1  # held back, as if never framed: no gap, no count
                return None
            self._die_sent += 1
        return super()._send(w, frames, track, iteration)

    def _send_commit(self, item: CommitItem) -> None:
        super()._send_commit(item)
        if self.die_at is not None and item.iteration == self.die_at[0]:
            logger.error("fault injection: dying in the middle of iteration %d", self.die_at[0])
            time.sleep(0.5)  # let zmq's I/O thread put what was sent on the wire
            os._exit(137)


def sender_factory(net: str | None = None, die_at: str | None = None) -> SenderFactory:
    """A sender factory (for ``Session(sender_factory=...)``) making :class:`FaultySender`
    with these faults; a malformed spec fails here, not in a sender thread."""
    if net:
        parse(net, 0)
    return functools.partial(FaultySender, net_spec=net or None, die_at=parse_die_at(die_at))


def inject(net: str | None = None, die_at: str | None = None) -> SenderFactory:
    """Every session attached from now on in this thread (and every resync of it) sends
    through a :class:`FaultySender` with these faults; returns the factory it installed
    (in :data:`~trainer_hooks.session.sender.SENDER_FACTORY`)."""
    factory = sender_factory(net, die_at)
    SENDER_FACTORY.set(factory)
    return factory


def inject_from_env() -> bool:
    """:func:`inject` with ``SHADOW_FAULT_NET`` and ``SHADOW_FAULT_DIE_AT``, if either is set."""
    net, die_at = os.environ.get("SHADOW_FAULT_NET"), os.environ.get("SHADOW_FAULT_DIE_AT")
    if not net and not die_at:
        return False
    inject(net, die_at)
    return True


@contextlib.contextmanager
def faults(net: str | None = None, die_at: str | None = None) -> Iterator[SenderFactory]:
    """:func:`inject` for the sessions attached inside the block (their resyncs after it
    keep the faults: a session reads its sender factory once, when it is built)."""
    factory = sender_factory(net, die_at)
    token = SENDER_FACTORY.set(factory)
    try:
        yield factory
    finally:
        SENDER_FACTORY.reset(token)
