"""Tuning: every knob of the trainer side and the services, in one typed, frozen dataclass.

A :class:`Tuning` is built once -- :meth:`Tuning.load`: an argument, else the environment
(``SHADOW_<NAME>``), else the default -- and passed to what runs: ``trainer_hooks.attach``
(the session, its attachments and sender), the :class:`~shadow.worker.server.Worker` and the
:class:`~shadow.coordinator.server.Coordinator` (and every part they build). Nothing reads
the environment for a knob after that. Services take the same fields as a ``tuning:`` group
(``shadow cluster tuning.worker_lost_s=1.5``); ``shadow cluster`` hands its tuning to the
workers it starts through :meth:`Tuning.environ`.

Units are in the names: ``_s`` seconds, ``_bytes``, ``_iterations``, ``_messages``,
``_elements``; a bare count counts what its name says.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


def _knob(default: float, env: str, doc: str) -> Any:
    return field(default=default, metadata={"env": "SHADOW_" + env, "doc": doc})


@dataclass(frozen=True)
class Tuning:
    """The knobs (see the module docstring). Every field is a number >= 0; a field's
    environment variable is in its metadata (``env``), and :data:`ENV` maps them back."""

    # -- trainer side --------------------------------------------------------------------
    ring_iterations: int = _knob(4, "RING_ITERATIONS", "staging ring capacity, in iterations of this rank's stripe")
    max_lag_iterations: int = _knob(3, "MAX_LAG", "iterations a trainer may run ahead of the committed cut")
    block_timeout_s: float = _knob(120.0, "BLOCK_TIMEOUT_S", "longest a trainer waits for the shadow (policy=block)")
    connect_timeout_s: float = _knob(
        60.0, "CONNECT_TIMEOUT_S", "attach and restore wait this long for the coordinator (and a cluster starting)"
    )
    close_timeout_s: float = _knob(60.0, "CLOSE_TIMEOUT_S", "session.close() waits this long for the last commit")
    sender_poll_s: float = _knob(0.005, "SENDER_POLL_S", "the sender thread's idle poll")
    coordinator_lost_s: float = _knob(
        10.0, "COORDINATOR_LOST_S", "a trainer hearing nothing from the coordinator this long trains unprotected"
    )
    unprotected_warn_iterations: int = _knob(
        100, "UNPROTECTED_WARN_ITERATIONS", "a rank training without new checkpoints warns again every this many steps"
    )
    metrics_port: int = _knob(
        0, "METRICS_PORT", "trainer /metrics on this port + LOCAL_RANK (0 = off; host: SHADOW_METRICS_HOST)"
    )
    sndhwm_messages: int = _knob(1000, "ZMQ_SNDHWM", "messages queued per data socket before a send blocks")
    extra_chunk_bytes: int = _knob(
        4 << 20, "EXTRA_CHUNK_BYTES", "model state outside the optimizer travels in chunks of this size"
    )
    # -- services ------------------------------------------------------------------------
    worker_slots: int = _knob(5, "WORKER_SLOTS", "gradient buffers per worker (more than max_lag_iterations)")
    worker_hugepages: int = _knob(1, "WORKER_HUGEPAGES", "workers start with glibc's malloc on huge pages (1/0)")
    kernel_chunk_elements: int = _knob(32768, "KERNEL_CHUNK", "elements per parallel work item of the replay")
    max_runs: int = _knob(65536, "MAX_RUNS", "run-table entries accepted in one frame")
    seq_window_messages: int = _knob(
        4096, "SEQ_WINDOW", "a data message further ahead of its rank's expected sequence number is dropped"
    )
    max_commit_bytes: int = _knob(
        16 << 20, "MAX_COMMIT_BYTES", "largest commit record (or chunk of state outside the optimizer) accepted"
    )
    data_rcvhwm_messages: int = _knob(1000, "DATA_RCVHWM", "messages queued per sender on a worker's data socket")
    heartbeat_s: float = _knob(0.5, "HEARTBEAT_S", "worker -> coordinator heartbeat period")
    worker_lost_s: float = _knob(5.0, "WORKER_LOST_S", "the coordinator marks a silent worker lost after this long")
    loop_slow_s: float = _knob(
        1.0, "LOOP_SLOW_S", "a coordinator loop step this long is logged (its stack too while it runs 5 times as long)"
    )
    slot_grace_s: float = _knob(
        120.0, "SLOT_GRACE_S", "a dead worker's slot is kept this long for a register with its slot token"
    )
    attach_pending_jobs: int = _knob(16, "ATTACH_PENDING_JOBS", "job names with an attach waiting for its ranks")
    attach_pending_ranks: int = _knob(65536, "ATTACH_PENDING_RANKS", "rank attaches waiting (all jobs)")
    attach_pending_bytes: int = _knob(64 << 20, "ATTACH_PENDING_BYTES", "bytes of the attach messages held waiting")
    fetch_timeout_s: float = _knob(60.0, "FETCH_TIMEOUT_S", "a restore or peer copy drops a worker silent this long")
    fetch_chunk_bytes: int = _knob(16 << 20, "FETCH_CHUNK_BYTES", "a worker sends its shard in parts of this size")
    serve_hold_s: float = _knob(2.0, "SERVE_HOLD_S", "the next apply waits this long at most for a shard being sent")
    serve_stall_s: float = _knob(
        0.5, "SERVE_STALL_S", "a shard reply with no chunk sent for this long is not read; an apply drops it"
    )
    serve_max_fetches: int = _knob(64, "SERVE_MAX_FETCHES", "fetches a worker holds pending or sending at once")
    persist_buffers: int = _knob(2, "PERSIST_BUFFERS", "preallocated shard images per worker (writes in flight)")
    persist_close_s: float = _knob(
        2.0, "PERSIST_CLOSE_S", "a replaced assignment's write or copy in flight: wait this long, then abandon it"
    )
    persist_skip_log_s: float = _knob(
        60.0, "PERSIST_SKIP_LOG_S", "skipped checkpoints: one summed warning per period of this length"
    )
    persist_upload_hold_s: float = _knob(
        1800.0, "PERSIST_UPLOAD_HOLD_S", "local retention keeps a checkpoint whose remote copy is in flight this long"
    )
    compress_block_bytes: int = _knob(16 << 20, "COMPRESS_BLOCK_BYTES", "raw bytes per compressed block of a shard")
    compress_threads: int = _knob(1, "COMPRESS_THREADS", "blocks a writer compresses at once")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = int if f.type in ("int", int) else float
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"tuning.{f.name}={value!r} must be a number ({f.metadata['doc']})")
            if kind is int and value != int(value):
                raise ValueError(f"tuning.{f.name}={value!r} must be a whole number ({f.metadata['doc']})")
            if value < 0:
                raise ValueError(f"tuning.{f.name}={value!r} must be >= 0 ({f.metadata['doc']})")
            object.__setattr__(self, f.name, kind(value))

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **args: float | None) -> Tuning:
        """The tuning of this process: each field from ``args`` (None: not given), else from
        ``env`` (default: ``os.environ``) as ``SHADOW_<NAME>``, else its default. A value
        that is not a number is an error naming the variable."""
        env = os.environ if env is None else env
        unknown = sorted(set(args) - set(NAMES))
        if unknown:
            raise ValueError(f"unknown tuning field(s) {unknown}; the fields are {sorted(NAMES)}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            given = args.get(f.name)
            if given is not None:
                values[f.name] = given
                continue
            raw = env.get(f.metadata["env"])
            if raw is None or raw == "":
                continue
            try:
                values[f.name] = float(raw)
            except ValueError:
                raise ValueError(f"environment variable {f.metadata['env']}={raw!r} is not a number") from None
        return cls(**values)

    def replace(self, **changes: Any) -> Tuning:
        """This tuning with some fields changed (tests, and a service's overrides)."""
        return dataclasses.replace(self, **changes)

    def environ(self) -> dict[str, str]:
        """The ``SHADOW_*`` variables that rebuild this tuning in a process it starts (the
        fields that differ from their defaults)."""
        default = Tuning()
        return {
            f.metadata["env"]: repr(getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }


#: the defaults: what a helper uses when its caller passes no tuning
DEFAULT = Tuning()


def _config_class() -> type:
    """:class:`TuningConfig`: the services' ``tuning:`` group, every field of :class:`Tuning`
    optional (None: from the environment, else the default)."""
    default = Tuning()
    spec = [
        (
            f.name,
            int | None if f.type in ("int", int) else float | None,
            field(
                default=None,
                metadata={
                    **f.metadata,
                    "help": f"{f.metadata['doc']} (null: ${f.metadata['env']}, else {getattr(default, f.name)})",
                },
            ),
        )
        for f in fields(Tuning)
    ]

    def resolve(self: Any) -> Tuning:
        """The :class:`Tuning` these settings give (argument, then environment, then default)."""
        return Tuning.load(**{f.name: getattr(self, f.name) for f in fields(self)})

    def check(self: Any) -> None:
        self.resolve()  # a value out of range is an error when the command line is read

    doc = "Knobs given on the command line (``tuning.worker_lost_s=1.5``); see :class:`Tuning`."
    namespace = {"resolve": resolve, "__post_init__": check, "__doc__": doc}
    return dataclasses.make_dataclass("TuningConfig", spec, namespace=namespace)


TuningConfig = _config_class()
TuningConfig.__module__ = __name__


def check_section(value: Any) -> None:
    """A config's ``tuning`` field holds a :class:`TuningConfig` (its annotation is ``Any``, so
    OmegaConf would take ``tuning=3``), or a ``ValueError`` naming the fix."""
    if not isinstance(value, TuningConfig):
        raise ValueError(
            f"tuning={value!r} is not allowed: tuning is a section; set its keys, e.g. tuning.worker_lost_s=1.5"
        )


#: field name -> its environment variable
NAMES: dict[str, str] = {f.name: f.metadata["env"] for f in fields(Tuning)}
#: environment variable -> field name
ENV: dict[str, str] = {v: k for k, v in NAMES.items()}
