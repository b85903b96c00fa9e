"""Fetching a checkpoint (:class:`~shadow.snapshot.Snapshot`) from a live shadow cluster's memory."""

from __future__ import annotations

import logging
import time

import numpy as np
import zmq

from shadow import knobs
from shadow.client import dealer
from shadow.errors import ShadowConnectionError, ShadowError
from shadow.layout import Layout
from shadow.snapshot import Snapshot
from shadow.transport import fetch
from shadow.wire import messages as M
from shadow.wire.frames import Field, state_fields

logger = logging.getLogger(__name__)


class MovedOn(ShadowError):
    """A live cluster applied a newer iteration while a restore was reading it, or a
    worker was too busy to serve it (error codes ``moved_on``, ``busy``); worth asking again."""


def fetch_memory(info: dict, address: str, progress=None) -> Snapshot:
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
    limit = knobs.get("FETCH_TIMEOUT_S")
    ctx = zmq.Context(io_threads=max(1, min(4, len(info["workers"]))))
    pending: dict[zmq.Socket, dict] = {}
    poller = zmq.Poller()
    try:
        for w in info["workers"]:
            sock = dealer(ctx, w["serve"])
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
                head = _take_shard(sock, w, info, layout, arrays, steps, has_state, blobs, extras)
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
    sock, w: dict, info: dict, layout: Layout, arrays, steps, has_state, blobs, extras: dict | None = None
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
            src, epoch=None, iteration=info["iteration"], start=lo, stop=hi, fields=[int(f) for f in arrays], who=who
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
