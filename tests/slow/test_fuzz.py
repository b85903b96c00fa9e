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
from shadow import security
from shadow.testing import LocalCluster, rss_bytes
from shadow.wire import frames as F
from tests.conftest import capture_commits
from tests.helpers import doors
from tests.helpers.doors import rank_door
from tests.helpers.keys import role_keys
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow
N_FRAMES = 10_000
N_MESSAGES = 2_000


def _mutated_frames(rnd: random.Random, template: F.Header):
    """Random bytes, random-but-well-formed headers, truncations, huge sizes."""
    for _ in range(N_FRAMES):
        kind = rnd.random()
        if kind < 0.3:
            yield [rnd.randbytes(rnd.randint(0, 200))]
            continue
        runs = tuple(
            (
                rnd.choice([0, rnd.getrandbits(63), rnd.randint(0, 5000)]),
                rnd.choice([0, 1, rnd.getrandbits(62), rnd.randint(1, 3000)]),
                rnd.getrandbits(64),
            )
            for _ in range(rnd.randint(0, 4))
        )
        h = F.Header(
            F.Kind(rnd.randint(1, 3)),
            F.Field(rnd.randint(0, 4)),
            rnd.choice([template.job, rnd.getrandbits(64)]),
            rnd.choice([template.epoch + 1, rnd.getrandbits(32)]),  # never the live epoch
            rnd.randint(0, 3),
            rnd.randint(1, 4),
            rnd.choice([template.layout, rnd.getrandbits(64)]),
            rnd.getrandbits(63),
            rnd.getrandbits(63),
            runs,
        )
        raw = h.pack()
        if kind < 0.5:
            raw = raw[: rnd.randint(0, len(raw))]
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
                [rnd.getrandbits(63) - 2**62, -1, "s", None, [1, 2], {"a": 1}, 1.5, b"\x00"]
            )
        yield msgpack.packb(msg, use_bin_type=True)


def test_fuzzed_frames_and_messages_change_nothing(world1, shared_cluster, job):
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    for it in range(1, 4):
        train_step(ddp, opt, sched, it)
    door = rank_door(session, 0)  # frames past the door: what one who saw the rank's credential sends
    session.close()
    before = shared_cluster.wait_caught_up(3)
    worker = before["workers"][0]
    rss0 = rss_bytes(worker["pid"])
    template = F.Header(F.Kind.GRAD, F.Field.GRAD, session.job_id, session.epoch, 0, 1, session.layout.hash, 4, 0, ())
    rnd = random.Random(1234)
    ctx = zmq.Context.instance()
    push = doors.push(worker["data"], door)
    for frames in _mutated_frames(rnd, template):
        push.send_multipart(frames)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 5000)
    security.current_client().apply(dealer)  # a trainer of this user: a default cluster takes no other
    dealer.connect(shared_cluster.address)
    for raw in _random_messages(rnd):
        dealer.send(raw)
    push.close()
    time.sleep(1.0)
    while dealer.poll(200):
        dealer.recv()  # error replies
    dealer.close()
    after = shared_cluster.wait_status(
        lambda st: st["workers"][0]["frames_in"] - worker["frames_in"] >= N_FRAMES,
        what=f"worker 0 receiving the {N_FRAMES} fuzzed frames",
    )
    w = after["workers"][0]
    assert w["frames_in"] - worker["frames_in"] == N_FRAMES
    assert sum(w["rejected"].values()) - sum(worker["rejected"].values()) == N_FRAMES  # each counted

    # the coordinator counted its rejections: malformed, or of a type a trainer may not send
    def refused(st):
        return sum(st["rejected"].values()) + sum(st["security"]["refused_by_role"].values())

    assert refused(after) - refused(before) >= N_MESSAGES * 0.9
    assert w["health"] == "ok" and after["job"]["committed"] == 3 and w["applied"] == 3, w
    assert rss_bytes(worker["pid"]) - rss0 < 64 << 20
    fresh, fopt, fsched = build(seed=8)
    assert trainer_hooks.restore(fresh, fopt, source=shared_cluster.address, job=job).iteration == 3
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


# -- live values: the epoch, job, layout hash and sequence numbers of the running session ------

N_LIVE_FRAMES = 3000
_LIVE_SAFE = ("starting", "register", "rejoin", "attach", "trainer_hb")


def _live_frames(rnd: random.Random, session, workers: list, seq: list, applied: int, window: int):
    """Frames that carry the live job, epoch and layout hash, each with at least one defect
    that the worker must find before it takes a sequence number: a sequence number behind
    or far ahead of the expected one, an iteration already applied or beyond the slots, a
    run outside the range or larger than a part, a field that does not fit the kind. Tagged
    as the session tags its own (on a keyed cluster: with the rank's keys, as a rank that
    turned against the cluster would)."""
    for _ in range(N_LIVE_FRAMES):
        w = rnd.randrange(len(workers))
        tagger = session.sender.tags[w]
        lo, hi = workers[w]["start"], workers[w]["stop"]
        nxt = seq[w]
        defect = rnd.choice(["seq_far", "seq_behind", "iter_old", "iter_far", "run_out", "run_zero", "field"])
        s = rnd.choice([nxt, nxt + 1, nxt + window, max(0, nxt - 1)])
        it = rnd.choice([applied + 1, applied + 2])
        kind = F.Kind(rnd.randint(1, 4))
        field = F.Field.GRAD
        dst, n = lo + rnd.randrange(max(1, hi - lo - 8)), rnd.randint(1, 8)
        if defect == "seq_far":
            s = rnd.choice([nxt + window + 1, 2**40, rnd.getrandbits(63)])
        elif defect == "seq_behind":
            s = rnd.randrange(nxt) if nxt else 2**40
        elif defect == "iter_old":
            it = rnd.choice([applied, 0, applied - 1])
        elif defect == "iter_far":
            it = rnd.choice([applied + 6, 2**40, rnd.getrandbits(63)])
        elif defect == "run_out":
            kind = rnd.choice([F.Kind.GRAD, F.Kind.STATE])
            dst = rnd.choice([hi, lo - 1 if lo else hi + 5, hi - 2, 2**62])
            n = rnd.choice([4, 2**40]) if dst == hi - 2 else n
        elif defect == "run_zero":
            kind, n = F.Kind.GRAD, 0
        else:
            kind, field = rnd.choice(
                [
                    (F.Kind.GRAD, F.Field.PARAM),
                    (F.Kind.STATE, F.Field.GRAD),
                    (F.Kind.EXTRA, F.Field.EXP_AVG),
                    (F.Kind.STATE, F.Field.MAX_EXP_AVG_SQ),
                ]
            )
        payload = rnd.randbytes(4 * min(n, 8))
        nonce = tagger.nonce()
        runs = ((dst, n, tagger.tag(nonce, 1, payload)),)
        if kind == F.Kind.COMMIT and defect not in ("seq_far", "seq_behind", "iter_old", "iter_far"):
            runs = ((0, 10, 0), (0, 10, 0))  # a commit has exactly one run
        if kind == F.Kind.EXTRA and defect in ("run_out", "run_zero"):
            runs = ((1, 0, 0),)
        h = F.Header(kind, field, session.job_id, session.epoch, 0, 1, session.layout.hash, it, s, runs, nonce)
        yield w, [h.pack(tagger), payload]


def _bad_commit_bodies(rnd: random.Random, body: bytes, iteration: int, nparams: int):
    """A real commit body made malformed in one way each (all found by the decoder)."""
    rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
    defects = [
        lambda r: r["replay"].update(audit={"positions": [0], "values": []}),
        lambda r: r["replay"].update(audit={"positions": [0], "values": {"1": [1.0]}}),
        lambda r: r["replay"].update(audit={"positions": ["x"], "values": {}}),
        lambda r: r["replay"].update(audit=[1, 2]),
        lambda r: r["replay"].update(audit={"positions": [0, 1], "values": {1: [0.5]}}),
        lambda r: r["replay"].update(audit={"positions": [0], "values": {1: [None]}}),
        lambda r: r["replay"].update(groups=[]),
        lambda r: r["replay"].update(groups=[{"lr": "fast"}]),
        # each group setting of its own type: a flag is a bool (not 1 or "yes"), a number not a string
        lambda r: r["replay"]["groups"][0].update(maximize="yes"),
        lambda r: r["replay"]["groups"][0].update(maximize=1),
        lambda r: r["replay"]["groups"][0].update(lr=True),
        lambda r: r["replay"]["groups"][0].update(eps="1e-8"),
        lambda r: r["replay"]["groups"][0].update(betas=["0.9", 0.999]),
        lambda r: r["replay"]["groups"][0].update(betas=[0.9]),
        lambda r: r["replay"]["groups"][0].update(nesterov=True),  # an SGD key in an Adam group
        lambda r: r["replay"]["groups"][0].pop("amsgrad"),
        lambda r: r["replay"].update(sent=-1),
        lambda r: r["replay"].update(sent="many"),
        lambda r: r["replay"].update(skipped=[nparams]),
        lambda r: r["replay"].update(skipped=[-1]),
        lambda r: r["replay"].update(iteration=iteration + 1),
        lambda r: r["replay"].update(rank=1),
        lambda r: r["replay"].update(clip="1.0"),
        lambda r: r["replay"].update(skip_step=1),
        lambda r: r["replay"].update(bootstrap=True),
        lambda r: r["replay"].pop("groups"),
        lambda r: r.update(blob=[1, 2, 3]),
        lambda r: r.update(replay=[]),
    ]
    for defect in defects:
        r = msgpack.unpackb(msgpack.packb(rec, use_bin_type=True), raw=False, strict_map_key=False)
        r["replay"]["iteration"] = iteration
        defect(r)
        yield msgpack.packb(r, use_bin_type=True)
    yield rnd.randbytes(64)  # not msgpack at all


def _schema_value(types, rnd: random.Random, live: dict, name: str):
    if name in live and isinstance(live[name], types):
        return live[name]
    t = types[0]
    return {int: 0, float: 0.5, str: "fuzz", bool: True, dict: {}, list: [], bytes: b"", type(None): None}[t]


def _near_valid_messages(rnd: random.Random, live: dict):
    """Every message type with live values: well-formed ones of the types only a known
    worker or trainer rank may send, and for every type, variants with one defect (a
    field of the wrong type, a missing field, an unknown field, another version)."""
    from shadow.wire import messages as M

    for kind, schema in M.SCHEMAS.items():
        base = {"t": kind, "v": M.VERSION, **{f: _schema_value(t, rnd, live, f) for f, t in schema.items()}}
        if kind not in _LIVE_SAFE:  # those change membership or stop the cluster: roles decide who may
            yield kind, "valid", msgpack.packb(base, use_bin_type=True)
        yield kind, "unknown_field", msgpack.packb({**base, "zz": 1}, use_bin_type=True)
        yield kind, "version", msgpack.packb({**base, "v": M.VERSION + 1}, use_bin_type=True)
        for f in schema:
            yield kind, "missing", msgpack.packb({k: v for k, v in base.items() if k != f}, use_bin_type=True)
            wrong = [
                x
                for x in (b"\x00", "s", 1.5, [1], {"a": 1}, None, 2**63 - 1, True)
                if not isinstance(x, schema[f]) or (isinstance(x, bool) and bool not in schema[f])
            ]
            yield kind, "bad_field", msgpack.packb({**base, f: rnd.choice(wrong)}, use_bin_type=True)


def test_fuzz_with_live_values_changes_nothing(world1, tmp_path, monkeypatch):
    """The fuzz above never matches the live session, so it never reaches sequence handling
    or commit decoding. This one does: live epoch, job, layout hash and valid or near-valid
    sequence numbers for frames, malformed commits at the next valid sequence number, and
    every control message type with live values, to the coordinator and the serve socket.
    On a keyless cluster (``security.insecure=true``), where frames carry checksums only."""
    monkeypatch.setenv("SHADOW_INSECURE", "1")
    cluster = LocalCluster(tmp_path, args=("security.insecure=true",))
    try:
        _fuzz_live_values(cluster, "keyless-fuzz", monkeypatch)
    finally:
        cluster.stop()


def test_fuzz_with_live_values_on_a_keyed_cluster_changes_nothing(world1, tmp_path, monkeypatch):
    """The same against a keyed cluster (security.data=mac), each frame tagged with the rank's
    own MAC keys (a rank gone rogue), plus copies of them with a flipped bit, which the
    workers drop as bad_mac before reading anything else."""
    keys = role_keys(tmp_path / "keys")
    cluster = LocalCluster(tmp_path, args=keys["args"], keys=keys["admin"])
    security.set_client(keys["trainer"])
    try:
        _fuzz_live_values(cluster, "keyed-fuzz", monkeypatch, keys=keys["trainer"])
    finally:
        security.reset_client()
        cluster.stop()


def _fuzz_live_values(cluster, job: str, monkeypatch, keys=None) -> None:
    from shadow.config.tuning import Tuning

    commits = capture_commits(monkeypatch)
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job=job)
    for it in range(1, 4):
        train_step(ddp, opt, sched, it)
    assert session.close() == 3
    seq = list(session.sender.seq)  # after close: the last commit has been sent
    before = cluster.wait_caught_up(3)
    workers = before["workers"]
    rss0 = {w["pid"]: rss_bytes(w["pid"]) for w in workers}
    rnd = random.Random(4321)
    ctx = zmq.Context.instance()
    pushes = []
    for i, w in enumerate(workers):
        pushes.append(doors.push(w["data"], rank_door(session, i)))
    sent = [0] * len(workers)
    for w, frames in _live_frames(rnd, session, workers, seq, 3, Tuning.load().seq_window_messages):
        pushes[w].send_multipart(frames)
        sent[w] += 1
    # malformed commits at the next valid sequence number: each takes it and is refused
    k, bodies = commits[-1]
    assert k == 3
    forged = 0
    for w, body in enumerate(bodies):
        tagger = session.sender.tags[w]
        for bad in _bad_commit_bodies(rnd, body, 4, len(session.layout.params)):
            nonce = tagger.nonce()
            h = F.Header(
                F.Kind.COMMIT,
                F.Field.GRAD,
                session.job_id,
                session.epoch,
                0,
                1,
                session.layout.hash,
                4,
                seq[w],
                ((0, len(bad), tagger.tag(nonce, 1, bad)),),
                nonce,
            ).pack(tagger)
            if tagger.keyed:  # first a copy with one flipped bit: dropped, no sequence number taken
                flipped = bytearray(h)
                # in a field only the MAC guards: job, epoch, layout, iteration, sequence, nonce, tags
                at = rnd.choice([*range(8, 20), *range(24, 48), *range(52, len(h))])
                flipped[at] ^= 1 << rnd.randrange(8)
                pushes[w].send_multipart([bytes(flipped), bad])
                sent[w] += 1
                forged += 1
            pushes[w].send_multipart([h, bad])
            seq[w] += 1
            sent[w] += 1
    for p in pushes:
        p.close()
    live = {
        "epoch": session.epoch,
        "iteration": 4,
        "rank": 0,
        "world": 1,
        "job_id": session.job_id,
        "job": job,
        "layout_hash": session.layout.hash,
        "worker": 0,
        "applied": 3,
        "ok": False,
        "shard": 0,
        "gen": 0,
        "pid": 1,
        "worker_id": 0,
        "data": workers[0]["data"],
        "reason": "fuzz",
        "detail": "forged",
        "seq": [0],
        "tier": "local",
    }
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 5000)
    serve = ctx.socket(zmq.DEALER)
    serve.setsockopt(zmq.LINGER, 5000)
    door = doors.reader_door(cluster.address, 0)
    if door is not None:  # past the door with a ticket's credential: each fetch is still checked
        door.apply(serve)
    if keys is not None:  # the rank's own key: the control plane stays CURVE
        keys.apply(dealer)
    # the serve socket of a keyed cluster's workers (security.data=mac) takes connections in
    # clear, each fetch vouched for by a ticket: a CURVE client would never be admitted there
    # (its messages would never arrive, and once the refused handshake drops the connection
    # a send would wait for a peer)
    dealer.connect(cluster.address)
    serve.connect(workers[0]["serve"])
    n_msgs = 0
    for kind, variant, raw in _near_valid_messages(rnd, live):
        dealer.send(raw)
        if kind != "fetch" or variant != "valid":
            serve.send(raw)
        n_msgs += 1
    time.sleep(1.5)
    for s in (dealer, serve):
        while s.poll(200):
            s.recv()  # error replies
        s.close()
    after = cluster.wait_status(
        lambda st: all(
            w1["frames_in"] - w0["frames_in"] >= n for w0, w1, n in zip(workers, st["workers"], sent, strict=True)
        ),
        what=f"the workers receiving the {sent} frames sent",
    )
    assert after["job"]["committed"] == 3 and after["job"]["epoch"] == before["job"]["epoch"], after["job"]
    assert after["job"]["audit"]["mismatches"] == 0, after["job"]["audit"]  # a forged "audited" is not a worker's
    assert after["job"]["status"] == before["job"]["status"], after["job"]
    for w0, w1, n in zip(workers, after["workers"], sent, strict=True):
        assert w1["pid"] == w0["pid"] and w1["health"] == "ok" and w1["applied"] == 3 and not w1["stale"], w1
        assert w1["frames_in"] - w0["frames_in"] == n
        assert sum(w1["rejected"].values()) - sum(w0["rejected"].values()) >= n  # each one counted
        assert w1["rejected"].get("bad_commit", 0) - w0["rejected"].get("bad_commit", 0) >= 20, w1["rejected"]
        assert rss_bytes(w0["pid"]) - rss0[w0["pid"]] < 64 << 20
    dropped = sum(
        w1["rejected"].get("bad_mac", 0) - w0["rejected"].get("bad_mac", 0)
        for w0, w1 in zip(workers, after["workers"], strict=True)
    )
    assert dropped == forged and (forged > 0) == (keys is not None), (dropped, forged)
    # each counted: as malformed, or (a type its key's role may not send) refused by role before decoding
    counted = sum(after["rejected"].values()) - sum(before["rejected"].values())
    counted += sum(after["security"]["refused_by_role"].values()) - sum(before["security"]["refused_by_role"].values())
    assert counted >= n_msgs * 0.9, (after["rejected"], after["security"]["refused_by_role"])
    fresh, fopt, _ = build(seed=8)
    assert trainer_hooks.restore(fresh, fopt, source=cluster.address, job=job).iteration == 3
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
