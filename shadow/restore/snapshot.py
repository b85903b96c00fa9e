"""A complete checkpoint in flat form, and fetching it from a live shadow cluster.

A :class:`Snapshot` is what every restore path produces and every exporter consumes:
the flat parameter and moment arrays, per-parameter step counts, the layout, and the
opaque per-rank commit blobs (RNG, scheduler, extra state), all for one iteration.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import zmq

from shadow import knobs
from shadow.client import dealer
from shadow.errors import ShadowConnectionError, ShadowError
from shadow.layout import Layout
from shadow.wire import messages as M
from shadow.wire.frames import Field

logger = logging.getLogger(__name__)


@dataclass
class Snapshot:
    job: str
    iteration: int
    layout: Layout
    optim: dict
    world: int
    arrays: dict[Field, np.ndarray]
    steps: np.ndarray
    has_state: np.ndarray
    blobs: dict[int, bytes]
    source: str
    tier: str = "memory"
    extra: dict = field(default_factory=dict)


class MovedOn(ShadowError):
    """A live cluster applied a newer iteration while a restore was reading it."""


def fetch_memory(info: dict, address: str, progress=None) -> Snapshot:
    """Read the iteration described by a coordinator's memory info from every worker."""
    ctx = zmq.Context.instance()
    layout = Layout.from_dict(info["layout"])
    if layout.hash != info["layout_hash"]:
        raise ShadowError("coordinator sent a layout that does not match its hash")
    total = layout.total
    arrays: dict[Field, np.ndarray] = {}
    steps = np.zeros(len(layout.params), dtype=np.float64)
    has_state = np.zeros(len(layout.params), dtype=bool)
    blobs: dict[int, bytes] = {}
    covered = 0
    limit = knobs.get("FETCH_TIMEOUT_S")
    for w in info["workers"]:
        sock = dealer(ctx, w["serve"])
        try:
            sock.send(M.encode("fetch", epoch=info["epoch"], iteration=info["iteration"]))
            if not sock.poll(limit * 1000):
                raise ShadowConnectionError(f"worker {w['id']} at {w['serve']} did not answer within {limit:.0f} s")
            parts = sock.recv_multipart()
        finally:
            sock.close(linger=0)
        head = M.decode(parts[0])
        if head["t"] == "error":
            if "moved on" in head["message"]:
                raise MovedOn(head["message"])
            raise ShadowError(f"worker {w['id']}: {head['message']}")
        if head["t"] != "fetch_reply" or head["iteration"] != info["iteration"]:
            raise ShadowError(f"worker {w['id']} answered for iteration {head.get('iteration')}, not {info['iteration']}")
        lo, hi = head["start"], head["stop"]
        if (lo, hi) != (w["start"], w["stop"]) or len(parts) != 1 + len(head["arrays"]):
            raise ShadowError(f"worker {w['id']} sent a malformed shard")
        for f, raw in zip(head["arrays"], parts[1:]):
            fld = Field(f)
            if len(raw) != (hi - lo) * 4:
                raise ShadowError(f"worker {w['id']} sent {len(raw)} bytes for {fld.name}, expected {(hi - lo) * 4}")
            if fld not in arrays:
                arrays[fld] = np.zeros(total, dtype=np.float32)
            arrays[fld][lo:hi] = np.frombuffer(raw, dtype=np.float32)
        for i, s in head["steps"]:
            if layout.params[i].offset >= lo:  # the shard holding a param's first element owns its step
                steps[i] = s
        for i in head["has_state"]:
            if layout.params[i].offset >= lo:
                has_state[i] = True
        for r, b in head["commits"]:
            blobs[int(r)] = b
        covered += hi - lo
        if progress is not None:
            progress(covered * 4 * len(head["arrays"]), total * 4 * len(head["arrays"]))
    if covered != total:
        raise ShadowError(f"workers cover {covered} of {total} elements")
    missing = sorted(set(range(info["world"])) - set(blobs))
    if missing:
        raise ShadowError(f"commit records of ranks {missing} are missing from the cluster")
    return Snapshot(info["job"], info["iteration"], layout, info["optim"], info["world"], arrays, steps, has_state,
                    blobs, source=address)
