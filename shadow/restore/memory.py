"""A live shadow cluster's memory as a restore source: what its coordinator says it holds
(:func:`restore_info`) and fetching that iteration from every worker (:func:`fetch_memory`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import zmq

from shadow.client import dealer, request
from shadow.errors import ShadowConnectionError, ShadowError
from shadow.layout import Layout
from shadow.restore.sources import Candidate
from shadow.snapshot import Snapshot
from shadow.transport import fetch
from shadow.tuning import DEFAULT, Tuning
from shadow.wire import messages as M
from shadow.wire.frames import Field, state_fields

if TYPE_CHECKING:
    from shadow.restore.tier import TierSource

logger = logging.getLogger(__name__)


class MovedOn(ShadowError):
    """A live cluster applied a newer iteration while a restore was reading it, or a
    worker was too busy to serve it (error codes ``moved_on``, ``busy``); worth asking again."""


def restore_info(address: str, job: str | None, timeout: float, tuning: Tuning = DEFAULT) -> dict:
    """The coordinator's answer to ``restore_info``: the iteration its workers' memory holds
    (``memory``, or why none: ``memory_error``), its job and its tiers (``storage``)."""
    sock = dealer(zmq.Context.instance(), address, tuning=tuning)
    try:
        return request(sock, address, M.encode("restore_info", job=job), timeout, ("restore_info_reply",))["info"]
    finally:
        sock.close(linger=0)


class MemorySource:
    """The cluster behind coordinator ``address``: at most one candidate, the iteration its
    workers hold now (each :meth:`candidates` call asks again: a live cluster moves on).

    Call order: :meth:`candidates` (one request, ``timeout`` seconds at most), then
    :meth:`load` of its candidate (``tuning.fetch_timeout_s`` for the workers' replies;
    :class:`MovedOn` means ask again), and :meth:`tiers` for the cluster's persisted tiers
    as of the last answer."""

    name = "memory"

    def __init__(self, address: str, timeout: float, tuning: Tuning = DEFAULT) -> None:
        self.address, self.timeout, self.tuning = address, timeout, tuning
        self.info: dict = {}  # the coordinator's last answer
        self.problem = ""  # why the last answer named no iteration

    @property
    def root(self) -> str:
        return self.address

    @property
    def job(self) -> str | None:
        """The job the coordinator's last answer was about."""
        return self.info.get("job")

    def candidates(self, job: str | None) -> list[Candidate]:
        self.info = restore_info(self.address, job, self.timeout, self.tuning)
        mem = self.info["memory"]
        if mem is None:
            self.problem = str(self.info["memory_error"])
            return []
        self.problem = ""
        return [Candidate(mem["job"], mem["iteration"], "memory", self.address, generation=None, handle=mem)]

    def load(self, candidate: Candidate, progress=None) -> Snapshot:
        return fetch_memory(candidate.handle, self.address, progress, self.tuning)

    def tiers(self) -> list[TierSource]:
        """The cluster's persisted tiers, nearest first, as its last answer named them."""
        from shadow.restore.tier import TierSource  # the tiers' readers load only when a tier is read

        return [TierSource(st["tier"], st["root"]) for st in self.info.get("storage", [])]


def fetch_memory(info: dict, address: str, progress=None, tuning: Tuning = DEFAULT) -> Snapshot:
    """Read the iteration described by a coordinator's memory info from every worker.

    All workers are asked at once and answer in parallel (a context of its own with an
    I/O thread per worker, up to 4); each shard's chunks are received straight into
    place in the flat arrays (``recv_into``: one copy from zmq's buffer, none after)."""
    layout = Layout.from_dict(info["layout"])
    if layout.hash != info["layout_hash"]:
        raise ShadowError("coordinator sent a layout that does not match its hash")
    total = layout.total
    arrays: dict[Field, np.ndarray] = {}
    steps = np.zeros(len(layout.params), dtype=np.float64)
    has_state = np.zeros(len(layout.params), dtype=bool)
    blobs: dict[int, bytes] = {}
    extras: dict[int, bytes] = {}
    covered, done_bytes = 0, 0
    limit = tuning.fetch_timeout_s
    ctx = zmq.Context(io_threads=max(1, min(4, len(info["workers"]))))
    pending: dict[zmq.Socket, dict] = {}
    poller = zmq.Poller()
    try:
        for w in info["workers"]:
            sock = dealer(ctx, w["serve"], tuning=tuning)
            sock.send(M.encode("fetch", epoch=info["epoch"], iteration=info["iteration"]))
            pending[sock] = w
            poller.register(sock, zmq.POLLIN)
        # while the workers copy and send, fault the destination pages in: first touches
        # of fresh memory cost as much as the transfer itself on some hosts
        for fld in state_fields(info["optim"]):
            arrays[fld] = np.empty(total, dtype=np.float32)
            arrays[fld].fill(0)
        deadline = time.monotonic() + limit
        while pending:
            ready = dict(poller.poll(int(max(0.0, deadline - time.monotonic()) * 1000)))
            if not ready:
                late = ", ".join(f"{w['id']} at {w['serve']}" for w in pending.values())
                raise ShadowConnectionError(f"workers {late} did not answer within {limit:.0f} s")
            for sock in ready:
                w = pending.pop(sock)
                poller.unregister(sock)
                head = _take_shard(
                    sock, w, info, layout, arrays, steps, has_state, blobs, extras, tuning.max_commit_bytes
                )
                covered += head["stop"] - head["start"]
                done_bytes += (head["stop"] - head["start"]) * 4 * len(head["arrays"])
                if progress is not None:
                    progress(done_bytes, total * 4 * len(head["arrays"]))
    finally:
        ctx.destroy(linger=0)  # closes every socket
    if covered != total:
        raise ShadowError(f"workers cover {covered} of {total} elements")
    missing = sorted(set(range(info["world"])) - set(blobs))
    if missing:
        raise ShadowError(f"commit records of ranks {missing} are missing from the cluster")
    return Snapshot(
        info["job"],
        info["iteration"],
        layout,
        info["optim"],
        info["world"],
        arrays,
        steps,
        has_state,
        blobs,
        source=address,
        generation=int(info.get("generation", 0)),
        extras=extras,
    )


def _take_shard(
    sock,
    w: dict,
    info: dict,
    layout: Layout,
    arrays,
    steps,
    has_state,
    blobs,
    extras: dict | None = None,
    commit_bytes: int = DEFAULT.max_commit_bytes,
) -> dict:
    """Receive one worker's reply into ``arrays`` (allocated for the optimizer's fields, in
    wire order), each chunk straight into place; returns its head."""
    who = f"worker {w['id']}"
    lo, hi = w.get("start"), w.get("stop")
    if not isinstance(lo, int) or not isinstance(hi, int):
        raise ShadowError(f"the restore info gives {who} no range (start {lo!r}, stop {hi!r})")
    src = fetch.SocketParts(sock)
    try:
        head = fetch.read_head(
            src,
            epoch=None,
            iteration=info["iteration"],
            start=lo,
            stop=hi,
            fields=[int(f) for f in arrays],
            who=who,
            commit_bytes=commit_bytes,
        )
        fetch.read_arrays(src, head, lambda fld: fetch.as_bytes(arrays[fld][lo:hi]), who)
        got = fetch.read_extras(src, head, who)
        nparams = len(layout.params)
        pairs = fetch.param_indices(head["steps"], nparams, who, "a step")
        flags = fetch.param_indices(head["has_state"], nparams, who, "state flags")
    except fetch.FetchError as exc:
        raise (MovedOn if exc.retry else ShadowError)(str(exc)) from None
    if extras is not None:
        extras.update(got)
    for i, s in pairs:
        if layout.params[i].offset >= lo:  # the shard holding a param's first element owns its step
            steps[i] = s
    for i in flags:
        if layout.params[i].offset >= lo:
            has_state[i] = True
    for r, b in head["commits"]:
        blobs[int(r)] = b
    return head
