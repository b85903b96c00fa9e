"""Who may send what: every message type of the coordinator from every role, and each attack
the trust review found (an unauthenticated shutdown, a fake worker taking a slot, a job
replaced by another process, a forged ``persisted``, a spoofed ``paused``), refused and
counted. Driven through ``Coordinator.on_message`` (the role is what the CURVE guard
attaches to each message) with a recording outbox: no processes."""

from __future__ import annotations

import glob
import logging

import msgpack
import pytest

from shadow.config.choices import ROLES
from shadow.coordinator.queries import status_view
from shadow.coordinator.records import JobStatus
from shadow.coordinator.routes import ROUTES
from shadow.persist.checkpoints import shard_name
from shadow.wire import messages as M
from tests.coordinator.test_coordinator_parts import BOUNDS, LAYOUT, Sim
from tests.coordinator.test_jobs_drop import _silent


def _live(sim: Sim) -> dict:
    job = sim.state.job
    assert job is not None
    return {
        "epoch": job.epoch,
        "job": job.name,
        "job_id": job.job_id,
        "rank": 0,
        "world": job.world,
        "worker": 1,
        "worker_id": 1,
        "iteration": job.cut + 1,
        "gen": job.gen,
        "tier": "local",
        "shard": 1,
        "pid": 4242,
        "data": "tcp://127.0.0.1:9999",
        "serve": "tcp://127.0.0.1:9998",
    }


def _message(kind: str, live: dict) -> bytes:
    """A well-formed ``kind`` with the live job's values where a field names one."""
    fields = {}
    for name, types in M.SCHEMAS[kind].items():
        if name in live and isinstance(live[name], types):
            fields[name] = live[name]
        else:
            t = types[0]
            fields[name] = {int: 0, float: 0.5, str: "x", bool: True, dict: {}, list: [], bytes: b"", type(None): None}[
                t
            ]
    return M.encode(kind, **fields)


def _with_tier(tmp_path) -> Sim:
    """A running :class:`Sim` whose coordinator has a local tier at ``tmp_path``, due every iteration."""
    from shadow.config import LocalTierConfig, PersistConfig

    sim = Sim()
    sim.coord = type(sim.coord)(
        "tcp://127.0.0.1:1",
        workers=2,
        outbox=sim.out,
        persist=PersistConfig(LocalTierConfig(dir=str(tmp_path), every_n=1)),
    )
    sim.state = sim.coord.state
    sim.running()
    return sim


def _view(sim: Sim) -> tuple:
    """What an unauthorised message must not change."""
    job = sim.state.job
    assert job is not None
    workers = tuple((w.id, w.ident, w.serve, w.data, w.lost, w.out_of_service) for w in sim.state.workers)
    return job.name, job.epoch, job.status, job.cut, dict(job.trainers), set(job.detached), workers


@pytest.mark.parametrize("kind", sorted(ROUTES))
@pytest.mark.parametrize("role", [None, *ROLES])
def test_each_message_type_is_taken_from_its_roles_only(kind, role):
    """With CURVE, the guard gives every message its sender's role; without it (``None``)
    every peer may send every type, and only the checks beyond the role apply."""
    sim = Sim()
    sim.running()
    ident = b"w1" if role == "worker" else b"t0" if role == "trainer" else b"peer"
    before = _view(sim)
    sim.coord.on_message([ident, _message(kind, _live(sim))], role)
    if role is None or role in ROUTES[kind].roles:
        assert not [k for k in sim.state.refused if k[1] == "role"]
        return
    assert sim.state.refused == {(role, "role"): 1}
    assert sim.out.kinds() == ["error"] and sim.out.last("error")["code"] == "refused"
    assert f"{'an' if role == 'admin' else 'a'} {role} may not send {kind!r}" in sim.out.last("error")["message"]
    assert _view(sim) == before
    refused = status_view(sim.state, sim.coord.persist)["security"]["refused_by_role"]
    assert refused == {f"{role}/role": 1}


def test_a_refused_role_costs_no_decode(monkeypatch):
    """Row 2 (issue 38): a client key's 64 MiB ``attach`` of empty arrays was decoded whole
    (4.9 GB, 41.7 s) before its role was refused. The type is read from the first bytes and
    the role refused before the body is decoded."""
    sim = Sim()
    sim.running()
    decoded = []
    real = M.decode
    head = msgpack.packb({"t": "attach", "v": M.VERSION})
    body = b"\xde\x00\x03" + head[1:] + b"\xa6layout" + b"\xdd\x00\x10\x00\x00" + b"\x90" * (1 << 20)
    # (the test's outbox decodes the replies: only decodes of the attack's body count)
    monkeypatch.setattr(M, "decode", lambda raw, *a, **k: (raw is body and decoded.append(raw)) or real(raw, *a, **k))
    before = _view(sim)
    sim.coord.on_message([b"peer", body], "client")
    assert decoded == [] and sim.state.refused == {("client", "role"): 1}
    assert "a client may not send 'attach'" in sim.out.last("error")["message"] and _view(sim) == before
    sim.coord.on_message([b"t0", body], "trainer")  # its role may: then it is decoded (and refused by its schema)
    assert len(decoded) == 1 and sim.state.rejected["missing_field"] == 1


def test_the_route_table_names_who_sends_what():
    worker = {"starting", "register", "rejoin", "heartbeat", "prepared", "persisted", "stale", "configured"}
    worker |= {"copied", "audited"}
    trainer = {"attach", "detach", "paused", "lagging", "replica_from", "trainer_hb"}
    assert {k for k, r in ROUTES.items() if r.roles == {"worker"}} == worker
    assert {k for k, r in ROUTES.items() if r.roles == {"trainer"}} == trainer
    assert {k for k, r in ROUTES.items() if "client" in r.roles} == {"status", "restore_info", "catalog", "jobs"}
    assert {k for k, r in ROUTES.items() if r.roles == {"admin"}} == {"drop"}  # detaching a job is an admin's
    assert ROUTES["jobs"].roles == {"trainer", "client", "admin"}  # a resuming trainer asks for its job
    assert "shutdown" not in ROUTES and "shutdown" not in M.SCHEMAS  # no message stops anything


@pytest.mark.parametrize("role", [None, *ROLES])
def test_shutdown_is_not_a_message_the_coordinator_takes(role):
    """Row 1 and 2: one ``shutdown`` stopped the cluster and lost the in-memory checkpoint."""
    sim = Sim()
    sim.running()
    before = _view(sim)
    sim.coord.on_message([b"t0", msgpack.packb({"t": "shutdown", "v": M.VERSION})], role)
    assert sim.out.kinds() == ["error"] and "unknown message type 'shutdown'" in sim.out.last("error")["message"]
    assert sim.state.rejected["unknown_type"] == 1
    assert "shutdown" not in sim.out.kinds(b"w0") and not sim.coord._stop and _view(sim) == before


def test_a_register_cannot_take_a_live_connected_slot():
    """Row 3: a fake worker registering as worker 0 every 20 ms took its slot, and restores
    were sent to its serve endpoint."""
    sim = Sim()
    sim.running()
    for _ in range(5):
        sim.send(b"fake", "register", data="tcp://6.6.6.6:1", serve="tcp://6.6.6.6:2", pid=666, worker_id=0, memory=-1)
        assert sim.out.last("error", b"fake")["code"] == "busy"
    w0 = sim.state.workers[0]
    assert w0.ident == b"w0" and w0.serve == "tcp://127.0.0.1:8000" and not w0.lost
    info = status_view(sim.state, sim.coord.persist)
    assert info["workers"][0]["serve"] == "tcp://127.0.0.1:8000"
    assert sim.state.refused == {("peer", "slot_taken"): 5}
    job = sim.state.job
    assert job is not None and job.status == JobStatus.RUNNING  # nothing degraded either
    w0.lost = True  # once the holder is lost (or its connection gone), its restart takes the slot back
    sim.send(
        b"w0b",
        "register",
        data="tcp://127.0.0.1:7100",
        serve="tcp://127.0.0.1:8100",
        pid=7,
        worker_id=0,
        memory=-1,
        slot_token=w0.slot_token,
    )
    assert sim.out.last("registered", b"w0b")["worker_id"] == 0 and sim.state.workers[0].ident == b"w0b"


def test_a_dead_workers_slot_is_kept_for_its_restarted_process():
    """Row 8 (issue 38): SIGKILL worker 0, then ``register`` every 20 ms: the attacker took
    slot 0 within 0.03 s and kept it, and its restarted process was refused. The slot is
    kept for a register with the slot's token (its first ``registered`` gave it) for
    ``tuning.slot_grace_s``; after that a worker without it may take the slot."""
    sim = Sim()
    sim.running()
    w0 = sim.state.workers[0]
    token = w0.slot_token
    assert isinstance(token, bytes) and len(token) == 16 and token != sim.state.workers[1].slot_token
    sim.out.gone.add(b"w0")  # SIGKILLed: its connection is gone
    reg = {"data": "tcp://6.6.6.6:1", "serve": "tcp://6.6.6.6:2", "pid": 666, "worker_id": 0, "memory": -1}
    for forged in ({}, {"slot_token": b"x" * 16}, {"slot_token": token[:8]}):
        sim.send(b"squatter", "register", **reg, **forged)
        assert sim.out.last("error", b"squatter")["code"] == "busy"
        assert "kept for its restarted worker" in sim.out.last("error", b"squatter")["message"]
    assert sim.state.workers[0].ident == b"w0" and sim.state.refused == {("peer", "slot_reserved"): 3}
    sim.send(b"w0-restarted", "register", **{**reg, "pid": 7}, slot_token=token)
    assert sim.out.last("registered", b"w0-restarted")["slot_token"] == token
    assert sim.state.workers[0].ident == b"w0-restarted"
    # once the grace period is over, a worker without the token (another host's, a new disk) gets it
    sim.out.gone.add(b"w0-restarted")
    sim.state.workers[0].last_seen -= sim.state.tuning.slot_grace_s + 1
    sim.send(b"replacement", "register", **{**reg, "pid": 8})
    fresh = sim.out.last("registered", b"replacement")["slot_token"]
    assert sim.state.workers[0].ident == b"replacement" and fresh != token


def test_another_job_replaces_the_attached_one_only_with_overwrite():
    """Row 4: a second process attached another job name without any flag and replaced it."""
    sim = Sim()
    sim.running()

    def attach(name: str, overwrite: bool) -> None:
        sim.send(
            b"intruder",
            "attach",
            job=name,
            rank=0,
            world=1,
            layout_hash=LAYOUT.hash,
            layout=LAYOUT.to_dict(),
            optim={"kind": "adam", "impl": "fused", "vec_width": 8, "tail_width": 1},
            iteration=0,
            overwrite=overwrite,
            restored=None,
        )

    attach("other", overwrite=False)
    assert "with overwrite=True to replace it" in sim.out.last("error", b"intruder")["message"]
    assert sim.state.job.name == "job" and sim.state.refused == {("trainer", "replace_without_overwrite"): 1}
    attach("other", overwrite=True)  # while the job's rank still heartbeats: held, whatever the flag
    held = sim.out.last("waiting", b"intruder")
    assert "owned by a live run" in held["reason"] and "overwrite=True neither" in held["reason"]
    assert sim.state.job.name == "job" and "other" in sim.state.pending
    _silent(sim)  # its rank is gone (crashed): the held attach takes over
    sim.coord.attach.start_attaches()
    assert sim.state.job.name == "other" and sim.out.kinds(b"w0")[-1] == "configure"  # replaced, as asked


def test_persisted_is_taken_from_the_shards_writer_under_its_own_name(tmp_path, caplog):
    """Row 5: a forged ``persisted`` whose ``file`` pointed elsewhere became the manifest."""
    sim = _with_tier(tmp_path)
    job = sim.state.job
    assert job is not None
    sim.prepared(b"w0", 1)
    sim.prepared(b"w1", 1)
    assert sim.coord.persist.tiers["local"].in_flight == {1: {}}  # iteration 1 is being written

    def persisted(ident: bytes, shard: int, file: str) -> None:
        lo, hi = BOUNDS[shard]
        sim.send(
            ident,
            "persisted",
            epoch=job.epoch,
            iteration=1,
            tier="local",
            shard=shard,
            ok=True,
            error="",
            file=file,
            start=lo,
            stop=hi,
            bytes=8,
            checksum="0" * 16,
            seconds=0.1,
            blob_ranks=[],
            commit=None,
        )

    caplog.set_level(logging.WARNING)
    persisted(b"w0", 1, shard_name(1, 2))  # worker 0 reports worker 1's shard
    assert "not asked to write" in sim.out.last("error", b"w0")["message"]
    persisted(b"w1", 1, "../../elsewhere/evil.safetensors")  # the writer, another file
    assert "the local tier names it 'shard-00001-of-00002.safetensors'" in sim.out.last("error", b"w1")["message"]
    assert sim.state.refused == {("peer", "not_the_writer"): 2}
    tier = sim.coord.persist.tiers["local"]
    assert tier.in_flight == {1: {}}  # neither report was recorded
    persisted(b"w1", 1, shard_name(1, 2))  # the writer, under its name
    assert tier.in_flight == {1: {1: tier.in_flight[1][1]}} and sim.state.refused == {("peer", "not_the_writer"): 2}


def test_paused_lagging_detach_and_votes_come_from_the_ranks_own_connection():
    """Row 6: one spoofed ``paused`` forced a full resync."""
    sim = Sim()
    sim.running()
    job = sim.state.job
    assert job is not None
    before = _view(sim)
    sim.send(b"spoof", "paused", epoch=job.epoch, rank=0, reason="spoofed")
    sim.send(b"spoof", "lagging", epoch=job.epoch, rank=0, iteration=9, applied=0)
    sim.send(b"spoof", "detach", epoch=job.epoch, rank=0)
    assert _view(sim) == before and job.status == JobStatus.RUNNING
    assert sim.state.refused == {("peer", "not_the_rank"): 3}
    sim.send(b"t0", "paused", epoch=job.epoch, rank=0, reason="real")  # the rank itself
    assert job.status == JobStatus.DEGRADED


def test_a_heartbeat_rebinds_a_rank_only_with_its_token():
    """Row 7 (issue 38): a ``trainer_hb`` naming rank 0 from another connection took the
    rank's connection (then a ``paused`` there degraded the job, and the attacker was sent
    the rank's progress and resyncs). Only the token the rank got in its ``attached``
    rebinds it: a rank reconnecting, or a coordinator rebuilt from its workers."""
    sim = Sim()
    for i in range(2):
        sim.register(i)
    sim.attach()
    sim.configured(b"w0", b"w1")
    job = sim.state.job
    assert job is not None
    token = sim.out.last("attached", b"t0")["token"]
    assert token == job.rank_token(0) and len(token) == 16
    assert sim.out.last("configure", b"w0")["rank_secret"] == job.secret  # a rebuilt job knows the tokens
    for i in range(2):
        sim.prepared(b"w%d" % i, 0)
    sim.out.clear()
    hb = {"epoch": job.epoch, "rank": 0, "world": job.world, "job_id": job.job_id, "seq": []}
    before = _view(sim)
    for forged in ({}, {"token": b"x" * 16}, {"token": token[:8]}):
        sim.send(b"spoof", "trainer_hb", **hb, **forged)
    sim.send(b"spoof", "paused", epoch=job.epoch, rank=0, reason="spoofed")
    assert _view(sim) == before and job.status == JobStatus.RUNNING and job.trainers[0] == b"t0"
    assert sim.state.refused == {("peer", "not_the_rank"): 4}
    assert not {"progress", "degraded", "resync"} & set(sim.out.kinds(b"spoof"))
    sim.send(b"t0", "trainer_hb", **hb)  # the rank's own connection needs none
    assert job.trainers[0] == b"t0" and sim.state.refused == {("peer", "not_the_rank"): 4}
    sim.send(b"t0-again", "trainer_hb", **hb, token=token)  # the rank, reconnected
    assert job.trainers[0] == b"t0-again"


def test_a_flood_of_starting_messages_keeps_a_bounded_table():
    """Row 15 (issue 38): 200k ``starting`` in 6 s, and ``shadow status`` hung for over a
    minute rendering them."""
    from shadow.coordinator.membership import starting_cap

    sim = Sim()
    sim.register(0)
    for pid in range(20_000):
        sim.send(b"flood", "starting", worker_id=1, pid=pid + 100, seconds=0.0)
    cap = starting_cap(sim.state.expected)
    assert len(sim.state.starting) == cap and sim.state.rejected["starting_evicted"] == 20_000 - cap
    assert len(status_view(sim.state, sim.coord.persist)["workers"]) <= 1 + cap
    sim.send(b"w1", "starting", worker_id=1, pid=7, seconds=1.0)  # the real one, arriving last, is kept
    assert 7 in sim.state.starting


def test_a_restored_claim_goes_back_only_to_what_the_coordinator_finds(tmp_path):
    """Row 9 (issue 38): an ``attach`` at iteration 4 claiming a restore from the local tier,
    after the job reached 20, wrote a generation record {base 4}: restores then returned 4.
    The claim is checked here: the tier must hold a complete checkpoint of 4 (memory: the
    iteration it holds)."""
    from tests.coordinator.test_coordinator_parts import LAYOUT as SIM_LAYOUT
    from tests.persist.test_persist_units import _write_checkpoint

    sim = _with_tier(tmp_path)
    for it in range(1, 21):
        sim.prepared(b"w0", it)
        sim.prepared(b"w1", it)
    job = sim.state.job
    assert job is not None and job.cut == 20
    _silent(sim)  # its trainer crashed: no live run owns the job any more
    for it in (18, 19, 20):
        _write_checkpoint(str(tmp_path), "job", it, SIM_LAYOUT)

    def claim(tier: str, source: str) -> None:
        restored = {"iteration": 4, "job": "job", "generation": job.generation, "tier": tier, "source": source}
        sim.attach(iteration=4, ident=b"evil", restored=restored)

    for tier, source in (("local", f"{tmp_path}/job/iteration-0000000004"), ("memory", "tcp://x"), ("nope", "/")):
        sim.out.clear()
        claim(tier, source)
        assert "restore first" in sim.out.last("error", b"evil0")["message"], tier
    assert sim.state.rejected["restored_unchecked"] == 3
    assert job.generation == 0 and not glob.glob(f"{tmp_path}/job/generation-*.json") and sim.state.job is job
    _write_checkpoint(str(tmp_path), "job", 4, SIM_LAYOUT)  # a checkpoint of 4 the tier does hold: it may go back
    sim.out.clear()
    claim("local", f"{tmp_path}/job/iteration-0000000004")
    assert "error" not in sim.out.kinds(b"evil0") and glob.glob(f"{tmp_path}/job/generation-000001.json")


def test_catalog_requests_share_one_reply_while_the_tier_is_unchanged(tmp_path, monkeypatch):
    """Row 4 (issue 38): 40 catalog requests that were never read cost the coordinator about
    37 MB each (1.5 GB), built on its loop thread. The encoded reply is built once per
    version of the tier and the same bytes go (zero-copy) to every requester."""
    from tests.coordinator.test_coordinator_parts import LAYOUT as SIM_LAYOUT
    from tests.persist.test_persist_units import _write_checkpoint

    sim = _with_tier(tmp_path)
    for it in (3, 4):
        _write_checkpoint(str(tmp_path), "job", it, SIM_LAYOUT)
    sent: list[bytes] = []
    real = sim.out.reply_encoded
    monkeypatch.setattr(sim.out, "reply_encoded", lambda env, raw: sent.append(raw) or real(env, raw))
    for _ in range(40):
        sim.send(b"reader", "catalog", tier="local", job="job")
    assert len(sent) == 40 and all(raw is sent[0] for raw in sent)  # one buffer, however many wait
    assert [e[0] for e in sim.out.last("catalog_reply")["checkpoints"]][-1].endswith("iteration-0000000004")
    _write_checkpoint(str(tmp_path), "job", 5, SIM_LAYOUT)  # the tier changed: a new reply
    sim.send(b"reader", "catalog", tier="local", job="job")
    assert sent[-1] is not sent[0]
    assert [e[0] for e in sim.out.last("catalog_reply")["checkpoints"]][-1].endswith("iteration-0000000005")


def test_a_service_without_keys_takes_this_users_key_set_on_loopback_only(caplog):
    from shadow.cli._services import secure
    from shadow.config import SecurityConfig
    from shadow.security import SecurityError, keyset

    caplog.set_level(logging.INFO, logger="shadow.cli")
    on_loopback = secure(SecurityConfig(), "127.0.0.1", "cluster")
    mine = keyset.ensure()
    assert on_loopback.server_key == str(mine.secret("server")) and on_loopback.data_mode() == "mac"
    assert on_loopback.allow() == {r: str(mine.public(r)) for r in ("worker", "trainer", "client", "admin")}
    assert "keyed with this user's key set" in caplog.text
    with pytest.raises(SecurityError, match="refusing to bind 10.1.2.3 without keys.*security.insecure=true"):
        secure(SecurityConfig(), "10.1.2.3", "coordinator")
    caplog.clear()
    assert not secure(SecurityConfig(insecure=True), "127.0.0.1", "cluster").enabled
    assert "INSECURE: bound to 127.0.0.1 without keys (security.insecure=true): any local account" in caplog.text
    caplog.clear()
    assert not secure(SecurityConfig(insecure=True), "10.1.2.3", "coordinator").enabled
    assert "INSECURE: bound to 10.1.2.3 without keys (security.insecure=true): anyone who can reach it" in caplog.text
    caplog.clear()
    keyed = SecurityConfig(server_key="k.key_secret", allow_trainers="t")
    assert secure(keyed, "10.1.2.3", "coordinator") is keyed
    assert caplog.text == ""


@pytest.mark.parametrize("seed", range(3))
def test_forged_well_formed_messages_from_every_role_take_nothing(seed, tmp_path):
    """The fuzz, with valid messages: every type, live values (the job, epoch, ranks, slots,
    shards) or random ones, sent with every role from connections that are not the cluster's
    own workers and ranks. Nothing crashes a handler, no slot changes hands, the job is not
    replaced (``overwrite`` is the trainer role's to ask: the forgeries never ask), the cut
    never goes back, and no report reaches a tier."""
    import random

    rnd = random.Random(seed)
    sim = _with_tier(tmp_path)
    job = sim.state.job
    assert job is not None
    slots = [(w.id, w.ident, w.serve, w.data) for w in sim.state.workers]
    live = _live(sim)
    cut = job.cut
    for _ in range(1500):
        kind = rnd.choice(sorted(M.SCHEMAS))
        fields = {}
        for name, types in M.SCHEMAS[kind].items():
            if name in live and isinstance(live[name], types) and rnd.random() < 0.8:
                fields[name] = live[name]
            else:
                t = rnd.choice(types)
                fields[name] = {
                    int: rnd.choice([0, 1, -1, 2, 7, 2**31]),
                    float: rnd.choice([0.0, 0.5, -1.0, 1e9]),
                    str: rnd.choice(["", "x", "job", "tcp://127.0.0.1:1", "../../x"]),
                    bool: rnd.random() < 0.5,
                    dict: {},
                    list: rnd.choice([[], [0], [0, 1]]),
                    bytes: rnd.choice([b"", bytes(16), b"x" * 33]),
                    type(None): None,
                }[t]
        if kind == "attach":
            fields["overwrite"] = False
        role = rnd.choice(ROLES)
        ident = rnd.choice([b"forger-%d" % i for i in range(4)])
        try:
            raw = M.encode(kind, **fields)
        except M.MessageError:  # not well formed (e.g. an error code outside the set): not a forgery of interest
            continue
        sim.coord.on_message([ident, raw], role)
        assert job.cut >= cut
        cut = job.cut
    assert not [r for r in sim.state.rejected if r.startswith(("handler_", "periodic_"))], dict(sim.state.rejected)
    assert [(w.id, w.ident, w.serve, w.data) for w in sim.state.workers] == slots
    assert sim.state.job is job and job.name == "job"
    assert sim.coord.persist.tiers["local"].complete == {}
    refused = sim.state.refused
    assert sum(n for (_, reason), n in refused.items() if reason == "role") > 300  # many forgeries: the wrong role
