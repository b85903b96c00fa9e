"""Trainer-side fault injection, as wrappers around the production classes (tests, the
fault matrix, and anyone who wants to see the shadow survive): nothing here is imported
by the production modules, and nothing in them checks for faults.

:func:`inject` (or :func:`inject_from_env`, which reads ``SHADOW_FAULT_NET`` and
``SHADOW_FAULT_DIE_AT``) makes every attachment opened afterwards in this process send
through a :class:`FaultySender`; :func:`faults` does the same for a ``with`` block.

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
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence

from shadow.transport.send import DataSender
from shadow.wire import frames as F
from trainer_hooks.session.attachment import Attachment
from trainer_hooks.session.sender import CommitItem, Sender

logger = logging.getLogger(__name__)

KINDS = ("drop", "dup", "reorder", "truncate", "bitflip")


_ACTIVE: dict[tuple[str, int], NetFaults] = {}  # one draw sequence per process, across resyncs


def parse(spec: str | None, rank: int) -> NetFaults | None:
    if not spec:
        return None
    if (spec, rank) in _ACTIVE:
        return _ACTIVE[spec, rank]
    probs, seed, span, cover = {}, 0, [0, 1 << 62], False
    for item in spec.split(","):
        key, _, value = item.strip().partition("=")
        if key == "seed":
            seed = int(value)
        elif key == "cover":
            cover = bool(int(value))
        elif key in ("from", "until"):
            span[key == "until"] = int(value)
        elif key in KINDS:
            probs[key] = float(value)
        else:
            raise ValueError(f"network faults: unknown fault {key!r}; use {', '.join(KINDS)}, seed, from, until, cover")
    if sum(probs.values()) > 1.0:
        raise ValueError(f"network faults: probabilities add up to more than 1 ({spec})")
    _ACTIVE[spec, rank] = NetFaults(probs, seed * 1000 + rank, (span[0], span[1]), cover, 2 * rank)
    return _ACTIVE[spec, rank]


class NetFaults:
    def __init__(
        self,
        probs: dict[str, float],
        seed: int,
        span: tuple[int, int] = (0, 1 << 62),
        cover: bool = False,
        first: int = 0,
    ) -> None:
        self.probs, self.span, self.cover = probs, span, cover
        kinds = [k for k in probs if probs[k] > 0]
        self.order = kinds[first % len(kinds) :] + kinds[: first % len(kinds)] if kinds else []
        self.rng = random.Random(seed)
        self.injected: Counter[str] = Counter()
        self.held: dict[int, list] = {}  # worker -> frames held back for reordering

    def send(self, out: DataSender, worker: int, frames: Sequence, track: bool, iteration: int):
        """Send ``frames`` through the fault model to ``out``; returns a tracker or None (done)."""
        x, kind = self.rng.random(), None
        for name, p in self.probs.items() if self.span[0] <= iteration < self.span[1] else ():
            if x < p:
                kind = name
                break
            x -= p
        if kind is not None and self.cover:
            kind = next((k for k in self.order if not self.injected[k]), kind)
        held = self.held.pop(worker, None)
        tracker = None
        if kind is None:
            tracker = out.send(worker, frames, track)
        else:
            self.injected[kind] += 1
            copies = [bytes(f) for f in frames]
            if kind == "dup":
                out.send(worker, copies, False)
                out.send(worker, copies, False)
            elif kind == "reorder":
                self.held[worker] = copies
            elif kind == "truncate":
                out.send(worker, copies[:-1] if len(copies) > 1 else [copies[0][: len(copies[0]) // 2]], False)
            elif kind == "bitflip":
                i = self.rng.randrange(len(copies))
                frame = bytearray(copies[i])
                if frame:
                    bit = self.rng.randrange(len(frame) * 8)
                    frame[bit // 8] ^= 1 << (bit % 8)
                copies[i] = bytes(frame)
                out.send(worker, copies, False)
            logger.warning("fault injection: %s of a data message to worker %d", kind, worker)
        if held is not None:
            out.send(worker, held, False)
        return tracker


class FaultyDataSender:
    """A :class:`shadow.transport.send.DataSender` around another one: every message
    passes through ``net`` (None: straight through). It reads each message's iteration
    from its header, as anything on the wire could."""

    def __init__(self, inner: DataSender, net: NetFaults | None) -> None:
        self.inner, self.net = inner, net

    def send(self, worker: int, frames: Sequence, track: bool):
        if self.net is None:
            return self.inner.send(worker, frames, track)
        iteration = F.unpack_header(bytes(frames[0]), 1 << 20).iteration
        return self.net.send(self.inner, worker, frames, track, iteration)

    def open(self, worker: int, endpoint: str) -> None:
        if self.net is not None:
            self.net.held.pop(worker, None)
        self.inner.open(worker, endpoint)

    def drop(self, worker: int) -> None:
        if self.net is not None:
            self.net.held.pop(worker, None)
        self.inner.drop(worker)

    def close(self) -> None:
        self.inner.close()


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
    """A :class:`Sender` whose messages pass through the configured faults (class
    attributes, set by :func:`inject`); ``net`` may also be set or cleared on a live one."""

    net_spec: str | None = None
    die_at: tuple[int, int] | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._net: NetFaults | None = parse(self.net_spec, self.rank)
        self._faulty: FaultyDataSender | None = None
        self._die_sent = 0

    @property
    def net(self) -> NetFaults | None:
        return self._net

    @net.setter
    def net(self, value: NetFaults | None) -> None:
        self._net = value
        if self._faulty is not None:
            self._faulty.net = value

    def open_data(self, endpoints: list[str]) -> DataSender:
        self._faulty = FaultyDataSender(super().open_data(endpoints), self._net)
        return self._faulty

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


def inject(net: str | None = None, die_at: str | None = None) -> type[Sender]:
    """Every attachment opened from now on in this process sends through a
    :class:`FaultySender` with these faults; returns the class it installed."""
    cls = type("FaultySender", (FaultySender,), {"net_spec": net or None, "die_at": parse_die_at(die_at)})
    if net:
        parse(net, 0)  # a malformed spec fails here, not in a sender thread
    Attachment.sender_class = cls
    return cls


def inject_from_env() -> bool:
    """:func:`inject` with ``SHADOW_FAULT_NET`` and ``SHADOW_FAULT_DIE_AT``, if either is set."""
    net, die_at = os.environ.get("SHADOW_FAULT_NET"), os.environ.get("SHADOW_FAULT_DIE_AT")
    if not net and not die_at:
        return False
    inject(net, die_at)
    return True


@contextlib.contextmanager
def faults(net: str | None = None, die_at: str | None = None) -> Iterator[type[Sender]]:
    """:func:`inject` for the attachments opened inside the block."""
    before = Attachment.sender_class
    try:
        yield inject(net, die_at)
    finally:
        Attachment.sender_class = before
