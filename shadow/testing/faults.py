"""Faults in the services, as wrappers around the real code (tests only).

Nothing in a service module checks for a fault: :func:`install` replaces three methods
in this process with wrappers that misbehave on cue, and :func:`uninstall` puts them back.

* ``corrupt_apply_at=k``: right after applying iteration k, a worker flips the lowest bit
  of every parameter in its range (a silent bit flip in the replica, for the audit);
* ``persist_die_at=k``: a worker writing its first checkpoint at or after iteration k
  writes half of it to the temporary file and dies (exit 137);
* ``persist_full=path``: while ``path`` exists, every plain shard write stops half way with
  ``ENOSPC``, as on a disk that fills up.

A cluster with faults is started through this package's entry point, ``python -m
shadow.testing.faulty``, which installs the faults named by ``SHADOW_FAULT_*`` variables
and spawns its workers through itself (``LocalCluster(faults=ServiceFaults(...))`` does
both); in a test process, ``with injected(ServiceFaults(...)):``.

Faults on the wire: :class:`FaultyDataSender` wraps a trainer's
:class:`shadow.transport.send.DataSender` and passes each message through
:class:`NetFaults` (drop, dup, reorder, truncate, bitflip; :func:`parse` reads the
``net=`` spec). :mod:`trainer_hooks.testing` installs it in a trainer, with a sender that
dies half-way through an iteration. :func:`sever` closes a trainer's UCX connection to a
worker that lives, as UCX over TCP closed one under load."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from shadow.security import Door
from shadow.transport.send import DataSender
from shadow.wire import frames as F

logger = logging.getLogger(__name__)

ENV = {
    "corrupt_apply_at": "SHADOW_FAULT_CORRUPT_APPLY_AT",
    "persist_die_at": "SHADOW_FAULT_PERSIST_DIE_AT",
    "persist_full": "SHADOW_FAULT_PERSIST_FULL",
}


@dataclasses.dataclass(frozen=True)
class ServiceFaults:
    corrupt_apply_at: int | None = None
    persist_die_at: int | None = None
    persist_full: str | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))

    def env(self) -> dict[str, str]:
        """The ``SHADOW_FAULT_*`` variables that name these faults to ``shadow.testing.faulty``."""
        return {ENV[f.name]: str(v) for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServiceFaults:
        env = os.environ if env is None else env
        got: dict[str, Any] = {}
        for name, var in ENV.items():
            raw = env.get(var)
            if raw:
                try:
                    got[name] = raw if name == "persist_full" else int(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r} is not an iteration number") from None
        return cls(**got)


_originals: dict[tuple[Any, str], Any] = {}  # (owner, name) -> what install replaced there


def _replace(owner: Any, name: str, wrapper: Any) -> None:
    """Put ``wrapper`` in place of ``owner.name``, keeping the original for :func:`uninstall`."""
    _originals[(owner, name)] = getattr(owner, name)
    setattr(owner, name, wrapper)


def install(faults: ServiceFaults) -> None:
    """Wrap the code these faults live in (replacing any faults installed before)."""
    from shadow.persist import shardfile, writer
    from shadow.worker import shard

    uninstall()
    if faults.corrupt_apply_at is not None:
        real_apply = shard.ShardState.apply

        def apply(self, parts, commit, snap=None):
            done = real_apply(self, parts, commit, snap)
            if commit.get("iteration") == faults.corrupt_apply_at and self.size:
                logger.error(
                    "fault injection: flipping a bit of every parameter after iteration %d", faults.corrupt_apply_at
                )
                self.param.view(np.uint32)[:] ^= 1
            return done

        _replace(shard.ShardState, "apply", apply)
    if faults.persist_die_at is not None:
        real_write = writer.ShardPersister._write

        def _write(self, img, iteration, epoch, extra):
            if iteration >= faults.persist_die_at:
                _die_mid_write(img, self.local_path(iteration))
            return real_write(self, img, iteration, epoch, extra)

        _replace(writer.ShardPersister, "_write", _write)
    if faults.persist_full is not None:
        real_write_all = shardfile._write_all
        flag = faults.persist_full

        def _write_all(fd, mv, length):
            if os.path.exists(flag):  # half of the first piece goes in, as on a disk that fills up
                os.pwrite(fd, mv[: min(length, shardfile.CHUNK) // 2 // shardfile.PAGE * shardfile.PAGE], 0)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write_all(fd, mv, length)

        _replace(shardfile, "_write_all", _write_all)


def uninstall() -> None:
    """Put back what :func:`install` replaced."""
    while _originals:
        (owner, name), real = _originals.popitem()
        setattr(owner, name, real)


@contextlib.contextmanager
def injected(faults: ServiceFaults) -> Iterator[None]:
    """These faults in this process for the duration of the block."""
    install(faults)
    try:
        yield
    finally:
        uninstall()


def _die_mid_write(image, path: str) -> None:
    """Write half the image to the temporary file, then die."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(memoryview(image.buf)[: image.size // 2])
        f.flush()
        os.fsync(f.fileno())
    logger.error("fault injection: worker dying in the middle of a checkpoint write")
    os._exit(137)


# -- faults on the wire ------------------------------------------------------------------------
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
        iteration = F.header_iteration(bytes(frames[0]))
        return self.net.send(self.inner, worker, frames, track, iteration)

    def open(self, worker: int, endpoint: str, curve: bool | Door | None = None) -> None:
        if self.net is not None:
            self.net.held.pop(worker, None)
        self.inner.open(worker, endpoint, curve)

    def drop(self, worker: int) -> None:
        if self.net is not None:
            self.net.held.pop(worker, None)
        self.inner.drop(worker)

    def poll(self) -> None:
        self.inner.poll()

    def close(self) -> None:
        self.inner.close()


def sever(out: Any, worker: int, timeout: float = 10.0) -> bool:
    """Close the ready UCX connection that ``out`` (a :class:`FaultyDataSender`, a
    :class:`~shadow.transport.channels.Channels` or a
    :class:`~shadow.transport.ucx_send.UcxDataSender`) holds to ``worker``, as UCX closes one
    on its own while the worker lives, and wait until UCX has carried the close out (up to
    ``timeout`` seconds); False where there is no such connection. Call it on the thread that
    sends through ``out``."""
    from shadow.transport.ucx_base import _close_endpoint
    from shadow.transport.ucx_send import UcxDataSender

    out = getattr(out, "inner", out)
    if not isinstance(out, UcxDataSender):
        out = getattr(out, "ucx", None)
    ch = out.chans[worker] if isinstance(out, UcxDataSender) and 0 <= worker < len(out.chans) else None
    if ch is None or not ch.ready or ch.ep is None or not ch.ep.alive:
        return False
    ep = ch.ep
    _close_endpoint(ep)
    deadline = time.monotonic() + timeout
    while ep.alive and time.monotonic() < deadline:  # UCX's progress thread carries it out
        time.sleep(0.001)
    logger.warning("fault injection: the UCX connection to worker %d closed under the sender", worker)
    return True
