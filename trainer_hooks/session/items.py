"""What passes between a session and its sender thread: the work items the training thread
puts on :attr:`Sender.q <trainer_hooks.session.sender.Sender.q>` (in order), and the
:class:`SenderEvents` through which the sender reports what it hears and what goes wrong."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from shadow.wire import frames as F
from shadow.wire.tags import PLAIN, Tags
from trainer_hooks.session.transfer import DONE


@dataclass
class GradItem:
    iteration: int
    ring_off: int
    nelem: int
    runs: list  # per worker: [(src, dst, n)], src relative to ring_off
    ready: Any = DONE  # the event of the copy into the ring
    probes: list = field(default_factory=list)  # [(position relative to ring_off, param index, element)]


@dataclass
class StateItem:
    iteration: int
    field: F.Field
    data: np.ndarray
    runs: list  # per worker: [(src, dst, n)], src relative to data


class Refused(Exception):
    """A commit that must not be applied (raised by :attr:`CommitItem.make`)."""


@dataclass
class CommitItem:
    iteration: int
    bodies: list | None  # per worker: bytes (None until ``make`` built them)
    # on the sender thread: make(probed) -> (extras, bodies); probed: {(param, element): staged value}
    make: Callable[[dict], tuple[list, list]] | None = None


@dataclass
class ExtraItem:
    """Chunks of model state outside the optimizer for one worker (trainer_hooks.capture.extras)."""

    iteration: int
    worker: int
    chunks: list  # [(key, uint8 array)]


@dataclass
class NoticeItem:
    """A control message to the coordinator (the sender owns the socket)."""

    kind: str
    fields: dict


@dataclass
class JoinItem:
    """Start streaming to a (replacement) replica at ``endpoint`` from the next item on, its
    frames tagged with ``tags`` (this rank's key of the newcomer's configuration); ``mode``:
    its data socket's (``curve`` takes CURVE; None: as the old one's)."""

    worker: int
    endpoint: str
    tags: Tags = PLAIN
    mode: str | None = None


@dataclass
class FlushItem:
    done: threading.Event


class SenderEvents(Protocol):
    """What the sender thread reports (called on the sender thread)."""

    def on_error(self, exc: BaseException) -> None:
        """The sender failed, or the coordinator answered ``error``."""

    def on_progress(self, applied: int) -> None:
        """The cluster committed iteration ``applied`` (the flow-control credit)."""

    def on_degraded(self, reason: str) -> None:
        """The coordinator reports the cluster cannot take this epoch's stream."""

    def on_audit(self, msg: dict) -> None:
        """A divergence audit failed (``iteration``, ``detail``)."""

    def on_resync(self) -> None:
        """The coordinator asks for a resync (the cluster is whole again)."""

    def on_join(self, msg: dict) -> None:
        """A replica joins (``replica_in``: ``gen``, ``worker``, ``data``)."""

    def on_lost(self, why: str) -> None:
        """No answer from the coordinator for ``SHADOW_COORDINATOR_LOST_S``."""

    def on_back(self) -> None:
        """The coordinator answers again after :meth:`on_lost`."""

    def on_refused(self, iteration: int, exc: BaseException) -> None:
        """The commit of ``iteration`` failed its check (raised at the next step)."""


class NoEvents:
    """A :class:`SenderEvents` that ignores everything (tests of the framing)."""

    def on_error(self, exc: BaseException) -> None:
        pass

    def on_progress(self, applied: int) -> None:
        pass

    def on_degraded(self, reason: str) -> None:
        pass

    def on_audit(self, msg: dict) -> None:
        pass

    def on_resync(self) -> None:
        pass

    def on_join(self, msg: dict) -> None:
        pass

    def on_lost(self, why: str) -> None:
        pass

    def on_back(self) -> None:
        pass

    def on_refused(self, iteration: int, exc: BaseException) -> None:
        pass
