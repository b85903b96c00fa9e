"""The attach handshake and its answer: what the coordinator granted one epoch (the epoch,
the job's id, the workers with their ranges and data sockets, this rank's data keys and
token). The answer is a frozen :class:`Handshake`, apart from the running pipeline that
uses it (:class:`~trainer_hooks.session.attachment.Attachment`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import zmq

from shadow.core import sqrttab
from shadow.core.errors import ShadowError
from shadow.transport.client import LogWaiting, dealer, moved_to, request
from shadow.wire import messages as M
from shadow.wire import tags
from trainer_hooks.restorer.points import RestorePoint
from trainer_hooks.session.options import AttachOptions
from trainer_hooks.session.target import Target

logger = logging.getLogger(__name__)

#: the epoch of a ``detach`` that withdraws a held attach (no epoch was granted yet)
WITHDRAW = -1


@dataclass(frozen=True)
class Handshake:
    """The coordinator's ``attached`` answer for iteration ``base``: fixed for the epoch."""

    coordinator: str  # the address it answered at
    base: int  # the iteration attached at (bootstrapped from this rank's state)
    epoch: int
    job_id: int  # in every data frame header
    workers: tuple[dict, ...]  # per worker: start, stop, data endpoint, mode, shard
    shards: tuple[tuple[int, int], ...]  # per worker: the flat range it holds
    data_tags: tuple[tags.Tags, ...]  # per worker: what this rank tags its frames to it with
    token: bytes | None  # proves this rank to a restarted coordinator
    keep: bool = False  # every worker kept the base: prove the state by digests instead of sending it

    @classmethod
    def from_reply(cls, coordinator: str, base: int, reply: dict) -> Handshake:
        """The answer in ``reply`` (an ``attached`` message); a keyed cluster's missing or
        malformed data keys are a :class:`ShadowError`."""
        workers = tuple(reply["workers"])
        token = reply.get("token")
        return cls(
            coordinator=coordinator,
            base=base,
            epoch=reply["epoch"],
            job_id=reply["job_id"],
            workers=workers,
            shards=tuple((w["start"], w["stop"]) for w in workers),
            data_tags=tuple(data_tags(list(workers), reply.get("keys"))),
            token=token if isinstance(token, bytes) else None,
            keep=reply.get("keep") is True,
        )

    @property
    def endpoints(self) -> list[str]:
        """Each worker's data socket."""
        return [w["data"] for w in self.workers]

    @property
    def curve(self) -> list[bool]:
        """Per worker: whether its data socket takes CURVE."""
        return [w.get("mode") == "curve" for w in self.workers]


def launch_round(environ: Mapping[str, str] | None = None) -> dict | None:
    """The launcher's run and restart round this process was started in, from the
    environment: torchrun's ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``,
    Slurm's ``SLURM_JOB_ID`` and ``SLURM_RESTART_COUNT`` (a requeue), or
    ``SHADOW_LAUNCH_ID`` and ``SHADOW_LAUNCH_RESTART`` (any other launcher). torchrun under
    Slurm counts both: a requeue's rounds come after every round of the run before it.
    None when nothing names a run (torchrun's default run id ``none`` does not). A later
    round of the same run takes over the job its earlier round held at once: the launcher
    ended that round's ranks first."""
    env = os.environ if environ is None else environ
    runs, restart = [], 0
    for run_var, restart_var, weight in (
        ("SHADOW_LAUNCH_ID", "SHADOW_LAUNCH_RESTART", 10**8),
        ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", 10**4),
        ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", 1),
    ):
        run = env.get(run_var, "")
        if not run or run == "none" or len(run) > 200:
            continue
        try:
            count = int(env.get(restart_var) or 0)
        except ValueError:
            return None  # a round that cannot be told: never taken as a later one
        if not 0 <= count < 10**4:
            return None
        runs.append(f"{run_var}={run}")
        restart += count * weight
    return {"run": ",".join(runs), "restart": restart} if runs else None


def attach(
    target: Target,
    coordinator: str,
    options: AttachOptions,
    base: int,
    overwrite: bool,
    restored: RestorePoint | None,
    owner: tuple[int, bytes] | None = None,
    wait_s: float | None = None,
) -> tuple[zmq.Socket, Handshake]:
    """Ask ``coordinator`` to attach ``target`` at iteration ``base`` (bounded by
    ``SHADOW_CONNECT_TIMEOUT_S``): the connection (a DEALER, for the sender from now on)
    and the answer. ``owner``: the epoch this rank leaves and its token of it (a resync: a
    job's own ranks re-attach it at once, while any other launch waits for them to fall
    silent). ``wait_s``: a shorter bound than ``SHADOW_CONNECT_TIMEOUT_S`` (a resync, which
    holds the training step). If the request or its answer fails, the connection is closed."""
    sock = dealer(zmq.Context.instance(), coordinator)
    rank0 = target.rank == 0
    launch = launch_round()
    extra: dict = {"keep": True}  # this rank proves a state the workers kept by digests (bootstrap)
    if owner is not None:
        extra["owner"] = {"epoch": owner[0], "token": owner[1]}
    if launch is not None:
        extra["launch"] = launch
    payload = M.encode(
        "attach",
        job=options.job,
        rank=target.rank,
        world=target.world,
        layout_hash=target.wire_layout.hash,
        layout=target.wire_layout.to_dict() if rank0 else None,
        optim=target.optim_desc if rank0 else sqrttab.public(target.optim_desc),  # one table is enough
        iteration=base,
        overwrite=bool(overwrite),
        restored=restored.wire() if restored is not None else None,
        **extra,
    )
    waiting = LogWaiting(f"rank {target.rank}", coordinator)
    try:
        limit = options.tuning.connect_timeout_s if wait_s is None else wait_s
        deadline = time.monotonic() + limit
        reply = request(sock, coordinator, payload, limit, ("attached", "moved"), interim=waiting)
        if reply["t"] == "moved":  # a shared cluster's front: the job's own coordinator takes it from here
            to = moved_to(coordinator, reply)
            sock.close(linger=0)
            sock = dealer(zmq.Context.instance(), to)
            waiting = LogWaiting(f"rank {target.rank}", to)
            reply = request(sock, to, payload, max(1.0, deadline - time.monotonic()), ("attached",), interim=waiting)
            coordinator = to
        if isinstance(reply.get("took_over"), str):
            logger.warning("rank %d: %s", target.rank, reply["took_over"])
        return sock, Handshake.from_reply(coordinator, base, reply)
    except BaseException:
        if waiting.heard:  # the coordinator said it holds the attach (a live owner, workers starting): withdraw it
            try:
                sock.send(M.encode("detach", epoch=WITHDRAW, rank=target.rank), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        sock.close(linger=200 if waiting.heard else 0)
        raise


def detach(sock: zmq.Socket, handshake: Handshake, rank: int) -> None:
    """Tell the coordinator this rank leaves ``handshake``'s epoch (best effort), and close
    the connection (what was queued on it gets half a second)."""
    try:
        sock.send(M.encode("detach", epoch=handshake.epoch, rank=rank), zmq.NOBLOCK)
    except zmq.ZMQError:
        pass
    sock.close(linger=500)


def data_tags(workers: list[dict], keys: list | None) -> list[tags.Tags]:
    """What this rank tags its frames to each worker with, from the ``attached`` reply: its
    MAC key per worker on a keyed cluster, checksums on one without keys."""
    keyed = [w.get("mode") in ("mac", "curve") for w in workers]
    if not any(keyed):
        return [tags.PLAIN] * len(workers)
    if not isinstance(keys, list) or len(keys) != len(workers):
        sent = len(keys) if isinstance(keys, list) else "no"
        raise ShadowError(
            f"the coordinator named {len(workers)} keyed workers but sent {sent} data keys; "
            "coordinator and trainers must run the same shadow version"
        )
    for w, (k, on) in enumerate(zip(keys, keyed, strict=True)):
        if on and not (isinstance(k, bytes) and len(k) == tags.KEY_SIZE):
            raise ShadowError(f"the coordinator sent no valid data key for worker {w}; is it the same shadow version?")
    return [tags.for_key(k) if on else tags.PLAIN for k, on in zip(keys, keyed, strict=True)]
