"""Frame and message fuzzing against a live worker and coordinator: thousands of random
and mutated inputs, no crash, no memory blow-up, no state change, every one counted."""
from __future__ import annotations

import random
import struct
import time

import msgpack
import pytest
import torch
import zmq
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.wire import frames as F
from tests.conftest import train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow
N_FRAMES = 10_000
N_MESSAGES = 2_000


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _mutated_frames(rnd: random.Random, template: F.Header):
    """Random bytes, random-but-well-formed headers, truncations, huge sizes."""
    for _ in range(N_FRAMES):
        kind = rnd.random()
        if kind < 0.3:
            yield [rnd.randbytes(rnd.randint(0, 200))]
            continue
        runs = tuple((rnd.choice([0, rnd.getrandbits(63), rnd.randint(0, 5000)]),
                      rnd.choice([0, 1, rnd.getrandbits(62), rnd.randint(1, 3000)]),
                      rnd.getrandbits(64)) for _ in range(rnd.randint(0, 4)))
        h = F.Header(F.Kind(rnd.randint(1, 3)), F.Field(rnd.randint(0, 4)),
                     rnd.choice([template.job, rnd.getrandbits(64)]),
                     rnd.choice([template.epoch + 1, rnd.getrandbits(32)]),  # never the live epoch
                     rnd.randint(0, 3), rnd.randint(1, 4), rnd.choice([template.layout, rnd.getrandbits(64)]),
                     rnd.getrandbits(63), rnd.getrandbits(63), runs)
        raw = h.pack()
        if kind < 0.5:
            raw = raw[:rnd.randint(0, len(raw))]
        elif kind < 0.6:
            raw = raw[:10] + struct.pack("<I", rnd.getrandbits(32)) + raw[14:]  # nruns-ish garbage
        payloads = [rnd.randbytes(rnd.randint(0, 64)) for _ in range(rnd.randint(0, 3))]
        yield [raw, *payloads]


def _random_messages(rnd: random.Random):
    kinds = ["register", "prepared", "persisted", "attach", "status", "restore_info", "heartbeat", "nope", None, 7]
    for _ in range(N_MESSAGES):
        if rnd.random() < 0.3:
            yield rnd.randbytes(rnd.randint(0, 100))
            continue
        msg = {"t": rnd.choice(kinds), "v": rnd.choice([1, 2, "1", None])}
        for _ in range(rnd.randint(0, 6)):
            msg[rnd.choice(["epoch", "iteration", "rank", "world", "job", "layout", "x"])] = rnd.choice(
                [rnd.getrandbits(63) - 2**62, -1, "s", None, [1, 2], {"a": 1}, 1.5, b"\x00"])
        yield msgpack.packb(msg, use_bin_type=True)


def test_fuzzed_frames_and_messages_change_nothing(world1, cluster):
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="fuzz")
    for it in range(1, 4):
        train_step(ddp, opt, sched, it)
    session.close()
    before = cluster.settled()
    worker = before["workers"][0]
    rss0 = _rss_kib(worker["pid"])
    template = F.Header(F.Kind.GRAD, F.Field.GRAD, session.job_id, session.epoch, 0, 1, session.layout.hash,
                        4, 0, ())
    rnd = random.Random(1234)
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(worker["data"])
    for frames in _mutated_frames(rnd, template):
        push.send_multipart(frames)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 5000)
    dealer.connect(cluster.address)
    for raw in _random_messages(rnd):
        dealer.send(raw)
    push.close()
    time.sleep(1.0)
    while dealer.poll(200):
        dealer.recv()  # error replies
    dealer.close()
    after = cluster.settled()
    w = after["workers"][0]
    assert w["frames_in"] - worker["frames_in"] == N_FRAMES
    assert sum(w["rejected"].values()) - sum(worker["rejected"].values()) == N_FRAMES  # each counted
    assert sum(after["rejected"].values()) >= N_MESSAGES * 0.9  # the coordinator counted its rejections
    assert w["health"] == "ok" and after["job"]["committed"] == 3 and w["applied"] == 3, w
    assert _rss_kib(worker["pid"]) - rss0 < 64 * 1024
    fresh, fopt, fsched = build(seed=8)
    assert trainer_hooks.restore(fresh, fopt, source=cluster.address, job="fuzz").iteration == 3
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
