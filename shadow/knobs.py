"""Tuning knobs: one home, each with a ``SHADOW_<NAME>`` environment override.

Read them through the accessor functions (values are looked up at call time, so an
override set before a process starts reaches it). Tests use :func:`override`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_DEFAULTS: dict[str, float] = {
    # trainer side
    "RING_ITERATIONS": 4,  # staging ring capacity, in iterations of this rank's stripe
    "MAX_LAG": 3,  # iterations a trainer may run ahead of the cluster's committed cut
    "BLOCK_TIMEOUT_S": 120.0,  # longest a trainer waits for the shadow under policy=block
    "CONNECT_TIMEOUT_S": 60.0,  # attach / restore: wait for the coordinator (and a cluster still starting) this long
    "CLOSE_TIMEOUT_S": 60.0,  # session.close(): wait for the last commit this long
    "SENDER_POLL_S": 0.005,  # sender thread idle poll
    "COORDINATOR_LOST_S": 10.0,  # a trainer hearing nothing from the coordinator this long trains on unprotected
    "METRICS_PORT": 0,  # trainer /metrics on this port + LOCAL_RANK (0 = off; host: SHADOW_METRICS_HOST)
    "ZMQ_SNDHWM": 1000,  # messages queued per data socket before send blocks
    "EXTRA_CHUNK_BYTES": 4
    << 20,  # model state outside the optimizer travels in chunks of this size (<= MAX_COMMIT_BYTES)
    # service side
    "WORKER_SLOTS": 5,  # gradient buffers per worker (> MAX_LAG)
    "WORKER_HUGEPAGES": 1,  # workers start with glibc's malloc on transparent huge pages (shadow/worker/malloc.py)
    "KERNEL_CHUNK": 32768,  # elements per parallel work item in the replay kernel
    "MAX_RUNS": 65536,  # run-table entries accepted in one frame
    # a data frame further than this ahead of a rank's expected sequence number is dropped, not a gap
    "SEQ_WINDOW": 4096,
    "MAX_COMMIT_BYTES": 16 << 20,  # largest commit record (or chunk of model state outside the optimizer) accepted
    "DATA_RCVHWM": 1000,  # messages queued per sender on a worker's data socket (a few iterations' worth)
    "HEARTBEAT_S": 0.5,  # worker -> coordinator heartbeat period
    "WORKER_LOST_S": 5.0,  # coordinator marks a silent worker lost after this long
    "ATTACH_PENDING_JOBS": 16,  # coordinator: job names with an attach waiting for its other ranks, at most
    "ATTACH_PENDING_RANKS": 65536,  # coordinator: rank attaches waiting (all jobs), at most
    "ATTACH_PENDING_BYTES": 64 << 20,  # coordinator: bytes of the attach messages it holds while they wait
    "FETCH_TIMEOUT_S": 60.0,  # restore: wait for the workers' shards this long
    "FETCH_CHUNK_BYTES": 16 << 20,  # restore: a worker sends its shard in parts of this size
    "SERVE_HOLD_S": 2.0,  # restore: the next apply waits this long at most for a shard being sent
    "SERVE_STALL_S": 0.5,  # restore: a shard reply with no chunk sent for this long is not read; an apply drops it
    "SERVE_MAX_FETCHES": 64,  # restore: fetches a worker holds pending or sending at once (one per client)
    "PERSIST_BUFFERS": 2,  # preallocated shard images per worker (checkpoint writes in flight)
    "PERSIST_CLOSE_S": 2.0,  # a replaced session's checkpoint write or copy in flight: wait this long, then abandon it
    "PERSIST_SKIP_LOG_S": 60.0,  # checkpoints skipped (every image still being written): one summed warning per period
    # local retention keeps a checkpoint whose remote copy is in flight this long at most
    "PERSIST_UPLOAD_HOLD_S": 1800.0,
    "COMPRESS_BLOCK_BYTES": 16 << 20,  # compressed shards: raw bytes per independently compressed block
    "COMPRESS_THREADS": 1,  # compressed shards: blocks compressed at once by a writer (background threads)
}

_overrides: dict[str, float] = {}


def get(name: str) -> float:
    """Current value of knob ``name`` (override > environment > default)."""
    if name not in _DEFAULTS:
        raise KeyError(f"unknown knob {name!r}; known knobs: {sorted(_DEFAULTS)}")
    if name in _overrides:
        return _overrides[name]
    raw = os.environ.get("SHADOW_" + name)
    if raw is None:
        return _DEFAULTS[name]
    try:
        return type(_DEFAULTS[name])(float(raw))
    except ValueError:
        raise ValueError(f"environment variable SHADOW_{name}={raw!r} is not a number") from None


def get_int(name: str) -> int:
    return int(get(name))


@contextlib.contextmanager
def override(**values: float) -> Iterator[None]:
    """Temporarily override knobs in this process (tests)."""
    for k in values:
        get(k)  # validate the name
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
