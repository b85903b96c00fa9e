"""A live shadow cluster's memory as a restore source: what its coordinator says it holds
(:func:`restore_info`) and fetching that iteration from every worker (:func:`fetch_memory`)."""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import numpy as np
import zmq

from shadow import security
from shadow.config.tuning import DEFAULT, Tuning
from shadow.core.errors import ShadowConnectionError, ShadowError
from shadow.core.layout import Layout
from shadow.core.optimizers import state_fields
from shadow.core.snapshot import Assembly, Snapshot
from shadow.restore.sources import Candidate
from shadow.transport import fetch
from shadow.transport.client import ask, dealer
from shadow.wire import messages as M
from shadow.wire import tags
from shadow.wire.frames import Field

if TYPE_CHECKING:
    from shadow.restore.storage_source import TierSource

logger = logging.getLogger(__name__)


class MovedOn(ShadowError):
    """A live cluster applied a newer iteration while a restore was reading it, or a
    worker was too busy to serve it (error codes ``moved_on``, ``busy``); worth asking again."""


def restore_info(address: str, job: str | None, timeout: float, tuning: Tuning = DEFAULT) -> dict:
    """The coordinator's answer to ``restore_info``: the iteration its workers' memory holds
    (``memory``, or why none: ``memory_error``), its job and its tiers (``storage``)."""
    return ask(address, M.encode("restore_info", job=job), timeout, ("restore_info_reply",), tuning)["info"]


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

    def load(self, candidate: Candidate, progress=None, sink: ParamSink | None = None, ranges=None) -> Snapshot:
        return fetch_memory(candidate.handle, self.address, progress, self.tuning, sink, ranges)

    def tiers(self) -> list[TierSource]:
        """The cluster's persisted tiers, nearest first, as its last answer named them: the
        local one through the coordinator and its workers (its disks may be node-local:
        :class:`~shadow.restore.node_local.ClusterTierSource`), the others as they are."""
        from shadow.restore.node_local import ClusterTierSource  # the tiers' readers load only when read
        from shadow.restore.storage_source import TierSource

        return [
            ClusterTierSource(st["tier"], st["root"], self.address, st["workers"], self.timeout, self.tuning)
            if isinstance(st.get("workers"), list)
            else TierSource(st["tier"], st["root"])
            for st in self.info.get("storage", [])
        ]


class ParamSink(Protocol):
    """The live parameters a restore receives ``Field.PARAM`` into, when its checkpoint has
    their layout (``layout_hash``): ``scatter`` puts each checked chunk in place (see
    :class:`shadow.transport.fetch.Scatter`); ``tensors``, layout order, end up in
    :attr:`Snapshot.placed`; ``world``: the ranks of the job the checkpoint must have been
    taken with for the parameters to go in before the caller's checks (None: any; another
    world is fetched into flat arrays, so a refusal changes nothing).
    ``trainer_hooks.restore`` makes one for a model on the CPU."""

    layout_hash: int
    scatter: fetch.Scatter
    tensors: tuple
    world: int | None


def fetch_memory(
    info: dict,
    address: str,
    progress=None,
    tuning: Tuning = DEFAULT,
    sink: ParamSink | None = None,
    ranges: tuple[int, Sequence[tuple[int, int]]] | None = None,
) -> Snapshot:
    """Read the iteration described by a coordinator's memory info from every worker.

    All workers are asked at once and read in parallel (a thread per worker, up to
    ``FETCH_THREADS``; zmq I/O threads, up to 4). Each chunk is received straight into place
    in the flat arrays as it arrives (``recv_into``: one copy from zmq's buffer, none after)
    and its checksum checked there, while the later chunks are still on the wire; a worker
    silent for ``tuning.fetch_timeout_s`` fails the fetch. With a ``sink`` whose layout the
    checkpoint has, the parameters go straight into its tensors (no flat parameter array);
    if the fetch then fails, they hold part of it.

    ``ranges``: ``(layout hash, flat element ranges)``: when the checkpoint has that layout,
    only those ranges are fetched (an FSDP2 rank's rows; sorted, not overlapping): each
    worker sends its part of them, the flat arrays are mapped but only those ranges are
    ever written (memory for the rest is never committed), and the snapshot says so
    (:attr:`Snapshot.ranges`): nothing outside them may be read. Another layout: all of it
    is fetched (the caller then finds the mismatch)."""
    layout = Layout.from_dict(info["layout"])
    if layout.hash != info["layout_hash"]:
        raise ShadowError("coordinator sent a layout that does not match its hash")
    total = layout.total
    fields = state_fields(info["optim"])
    try:
        wanted = (
            fetch.check_ranges([list(r) for r in ranges[1]], 0, total)
            if ranges is not None and ranges[0] == layout.hash
            else None
        )
    except ValueError as exc:
        raise ShadowError(f"cannot fetch those ranges of the checkpoint: {exc}") from None
    if wanted is not None:
        logger.info(
            "fetching %d ranges (%d of %d elements) of iteration %s",
            len(wanted),
            sum(b - a for a, b in wanted),
            total,
            info.get("iteration"),
        )
    placed = (
        wanted is None and sink is not None and sink.layout_hash == layout.hash and sink.world in (None, info["world"])
    )
    targets: dict = {Field.PARAM: sink.scatter} if placed and sink is not None else {}
    alloc = _lazy if wanted is not None else (lambda n: np.empty(n, dtype=np.float32))
    arrays = {fld: alloc(total) for fld in fields if fld not in targets}
    workers = list(info["workers"])
    ctx = zmq.Context(io_threads=max(1, min(4, len(workers))))
    nbytes = total * 4 if wanted is None else sum(b - a for a, b in wanted) * 4
    tracker = _Progress(progress, nbytes * len(fields))
    stop = threading.Event()  # one shard failed: the others stop reading
    try:
        with ThreadPoolExecutor(max(1, min(FETCH_THREADS, len(workers))), thread_name_prefix="shadow-fetch") as pool:
            jobs = [
                pool.submit(_fetch_shard, ctx, w, info, total, fields, arrays | targets, tuning, tracker, stop, wanted)
                for w in workers
            ]
            futures.wait(jobs, return_when=futures.FIRST_EXCEPTION)
            stop.set()
            readers = [(w, job.result()) for w, job in zip(workers, jobs, strict=True)]
    finally:
        stop.set()
        ctx.destroy(linger=0)  # closes every socket
    parts = Assembly(layout, info["world"], ShadowError)
    for w, reader in readers:
        _merge(reader, w, layout, parts)
    return parts.snapshot(
        info["job"],
        info["iteration"],
        info["optim"],
        arrays,
        address,
        generation=int(info.get("generation", 0)),
        placed=sink.tensors if placed and sink is not None else (),
        ranges=None if wanted is None else tuple((a, b) for a, b in wanted),
    )


def _lazy(n: int) -> np.ndarray:
    """``n`` float32 elements of private anonymous memory, committed only where written
    (a fetch of some ranges maps the whole flat array and fills those)."""
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_NORESERVE", 0)
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    return np.frombuffer(mmap.mmap(-1, n * 4, flags=flags), dtype=np.float32)


FETCH_THREADS = 8  # threads reading workers' replies at once (each waits on its own socket)


class _Progress:
    """``progress(done_bytes, total_bytes)`` after each chunk, from any fetch thread."""

    def __init__(self, progress, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0
        self.lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        if self.progress is None or not nbytes:
            return
        with self.lock:
            self.done += nbytes
            self.progress(self.done, self.total)


def _fetch_shard(
    ctx: zmq.Context,
    w: dict,
    info: dict,
    total: int,
    fields,
    targets: dict,
    tuning: Tuning,
    tracker: _Progress,
    stop: threading.Event,
    wanted: list | None = None,
):
    """Ask worker ``w`` for its shard (``wanted``: only its part of these flat ranges) and
    read the reply into ``targets`` (field -> flat array or
    :class:`~shadow.transport.fetch.Scatter`) as it arrives; the reader, complete (None if
    ``stop`` was set first). Runs in a fetch thread, on a socket of its own."""
    who = f"worker {w.get('id')}"
    lo, hi = w.get("start"), w.get("stop")
    if not isinstance(lo, int) or not isinstance(hi, int) or not 0 <= lo <= hi <= total:
        raise ShadowError(f"the restore info gives {who} no range within the layout (start {lo!r}, stop {hi!r})")
    mine = None if wanted is None else [(max(a, lo), min(b, hi)) for a, b in wanted if max(a, lo) < min(b, hi)]
    # mac mode: the coordinator handed out a ticket for this worker (over CURVE); the worker's
    # serve socket is in clear and its reply comes under the ticket's MAC
    ticket, key = w.get("ticket"), w.get("key")
    if not (isinstance(ticket, bytes) and isinstance(key, bytes)):
        ticket = key = None
    # at most FETCH_BUFFER_BYTES of chunks wait in zmq's buffers before it stops reading the connection
    rcvhwm = max(2, FETCH_BUFFER_BYTES // max(1, tuning.fetch_chunk_bytes))
    door = security.ticket_door(ticket, key) if ticket is not None and key is not None else None
    sock = dealer(ctx, w["serve"], tuning=tuning, rcvhwm=rcvhwm, curve=key is None, door=door)
    try:
        epoch, iteration = info["epoch"], info["iteration"]
        auth = {"ticket": ticket, "mac": tags.fetch_mac(key, epoch, iteration)} if key is not None else {}
        asked: dict = dict(auth) if mine is None else dict(auth, ranges=mine)
        sock.send(M.encode("fetch", epoch=epoch, iteration=iteration, **asked))
        reader = fetch.ReplyReader(
            epoch=None,
            iteration=info["iteration"],
            start=lo,
            stop=hi,
            fields=[int(f) for f in fields],
            who=who,
            target=lambda fld: t if not isinstance(t := targets[fld], np.ndarray) else fetch.as_bytes(t[lo:hi]),
            commit_bytes=tuning.max_commit_bytes,
            key=key,
            ranges=mine,
        )
        parts = fetch.SocketParts(sock, zmq.NOBLOCK)
        limit = tuning.fetch_timeout_s
        heard = time.monotonic()
        while not reader.done:
            if stop.is_set():
                return None
            if not sock.poll(100, zmq.POLLIN):
                if time.monotonic() - heard > limit:
                    raise ShadowConnectionError(f"{who} at {w['serve']} sent nothing for {limit:.0f} s")
                continue
            heard = time.monotonic()
            while not reader.done:  # every part already here
                before = reader.received
                try:
                    reader.feed(parts)
                except zmq.Again:
                    break
                tracker.add(reader.received - before)
        reader.finish(parts)
    except fetch.FetchError as exc:
        raise (MovedOn if exc.retry else ShadowError)(str(exc)) from None
    finally:
        sock.close(linger=0)
    return reader


FETCH_BUFFER_BYTES = 64 << 20  # per worker: what zmq may hold of a reply before the reader takes it


def _merge(reader, w: dict, layout: Layout, parts: Assembly) -> None:
    """A complete reply's range, steps, state flags, commit records and extras, checked,
    into the snapshot's :class:`~shadow.core.snapshot.Assembly`."""
    head, who = reader.head, f"worker {w.get('id')}"
    nparams = len(layout.params)
    try:
        pairs = fetch.param_indices(head["steps"], nparams, who, "a step")
        flags = fetch.param_indices(head["has_state"], nparams, who, "state flags")
    except fetch.FetchError as exc:
        raise ShadowError(str(exc)) from None
    for entry in head["commits"]:
        if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int and isinstance(entry[1], bytes)):
            raise ShadowError(f"{who} sent a malformed commit record entry {entry!r:.80}")
    parts.add(head["start"], head["stop"], pairs, [(i, True) for i in flags], head["commits"], reader.extras)
