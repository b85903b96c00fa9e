"""What an attachment builds before its pipeline runs: the staging ring, sized for
``SHADOW_RING_ITERATIONS`` steps of this rank's stripes, and the sender thread over the
handshake's endpoints (made by the sender factory it is given, not started)."""

from __future__ import annotations

import zmq

from shadow.config.tuning import Tuning
from trainer_hooks.session.handshake import Handshake
from trainer_hooks.session.items import SenderEvents
from trainer_hooks.session.sender import Sender, SenderFactory
from trainer_hooks.session.staging import StagingRing
from trainer_hooks.session.target import Target

RING_SLACK = 16 * 256  # elements per step beyond the stripes: room for the buckets' padding


def ring_capacity(target: Target, tuning: Tuning) -> int:
    """Elements of the staging ring: ``tuning.ring_iterations`` steps of this rank's stripe
    (DDP: its share of the layout; sharded: its share of its boxes), plus slack."""
    shards = target.fsdp
    per_step = target.layout.total // target.world if shards is None else shards.total
    return tuning.ring_iterations * (per_step + RING_SLACK)


def new_ring(target: Target, tuning: Tuning) -> StagingRing:
    """The staging ring of one attachment (pinned on a CUDA device)."""
    return StagingRing(ring_capacity(target, tuning), pin=target.device.type == "cuda")


def new_sender(
    factory: SenderFactory,
    dealer: zmq.Socket,
    ring: StagingRing,
    target: Target,
    answer: Handshake,
    events: SenderEvents,
    tuning: Tuning,
) -> Sender:
    """The sender of the epoch ``answer`` opened, made by ``factory`` (called as
    :class:`Sender` is) over the connection ``dealer``, reading ``ring`` and telling
    ``events`` what it learns."""
    return factory(
        zmq.Context.instance(),
        dealer,
        answer.endpoints,
        ring,
        job_id=answer.job_id,
        epoch=answer.epoch,
        rank=target.rank,
        world=target.world,
        layout_hash=target.wire_layout.hash,
        events=events,
        tuning=tuning,
        tags=list(answer.data_tags),
        curve=answer.curve,
        token=answer.token,
    )
