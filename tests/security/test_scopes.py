"""Job-scoped roles: a trainer's or a client's key limited to named jobs (its public half in
a subdirectory of its role's allow directory named after the job, or a pattern of jobs).
The allow lists as the guard reads them; the scope a real CURVE connection carries; and the
coordinator refusing such a key on another job through every message type it could send,
answering what names no job with its own jobs only."""

from __future__ import annotations

import pytest
import zmq

from shadow import security
from shadow.config import KeygenConfig
from shadow.coordinator.queries import status_view
from shadow.coordinator.routes import ROUTES
from shadow.security import Peer
from shadow.wire import messages as M
from tests.coordinator.test_coordinator_parts import LAYOUT as SIM_LAYOUT
from tests.coordinator.test_coordinator_parts import Sim
from tests.persist.test_persist_units import _write_checkpoint
from tests.security.test_roles import _live, _message, _view, _with_tier


def _key(directory, name: str) -> bytes:
    public, _ = security.generate(directory, name)
    return security.load_public(public)


def test_a_key_in_a_jobs_directory_is_limited_to_that_job(tmp_path):
    trainers = tmp_path / "trainers"
    everyone = _key(trainers, "everyone")
    alone = _key(trainers / "team-a", "alone")
    pattern = _key(trainers / "team-b-*", "pattern")
    both = _key(trainers / "team-a", "both")
    (trainers / "team-c").mkdir()
    (trainers / "team-c" / "both.key").write_bytes((trainers / "team-a" / "both.key").read_bytes())
    wide = _key(trainers, "wide")  # also in a job's directory: its unscoped entry wins
    (trainers / "team-a" / "wide.key").write_bytes((trainers / "wide.key").read_bytes())
    reader = _key(tmp_path / "clients" / "team-a", "reader")  # a role with no key of its own at the top
    peers = security.load_peers({"trainer": trainers, "client": tmp_path / "clients"})
    assert peers[everyone] == Peer("trainer") and peers[wide] == Peer("trainer")
    assert peers[alone] == Peer("trainer", ("team-a",))
    assert peers[pattern] == Peer("trainer", ("team-b-*",))
    assert peers[both] == Peer("trainer", ("team-a", "team-c"))
    assert peers[reader] == Peer("client", ("team-a",))
    assert security.load_roles({"trainer": trainers})[alone] == "trainer"
    assert peers[pattern].may("team-b-7") and not peers[pattern].may("team-a")
    assert peers[both].may("team-c") and not peers[both].may(None)
    assert Peer("trainer").may(None) and Peer("trainer").may("anything")
    for peer in peers.values():
        assert Peer.parse(peer.user_id().decode()) == peer
    assert Peer.parse("admin:team-a") is None and Peer.parse("root") is None


def test_keys_that_cannot_be_scoped_are_refused_with_the_fix(tmp_path):
    _key(tmp_path / "admins", "admin")
    _key(tmp_path / "admins" / "team-a", "boss")
    with pytest.raises(security.SecurityError, match="an? admin key cannot be limited to jobs|admin keys in a job"):
        security.load_peers({"admin": tmp_path / "admins"})
    _key(tmp_path / "trainers" / "bad[name]", "t")
    with pytest.raises(security.SecurityError, match=r"names neither a job nor a pattern.*rename it"):
        security.load_peers({"trainer": tmp_path / "trainers"})
    (tmp_path / "empty" / "team-a").mkdir(parents=True)
    with pytest.raises(security.SecurityError, match="holds no \\*.key files"):
        security.load_peers({"client": tmp_path / "empty"})
    with pytest.raises(ValueError, match="an admin key cannot be limited to jobs"):
        KeygenConfig(role="admin", job="team-a")
    with pytest.raises(ValueError, match="names neither a job nor a pattern"):
        KeygenConfig(role="client", job="../x")
    assert KeygenConfig(role="trainer", job="team-a-*").dir == "keys/trainers/team-a-*"


def test_a_scoped_key_connects_with_its_scope(tmp_path):
    """Through a real CURVE handshake: the guard gives each message its sender's role and
    scope (``User-Id``), read back with :func:`shadow.security.peer_of`."""
    server_public, server_secret = security.generate(tmp_path, "server")
    _key(tmp_path / "trainers", "t")
    _key(tmp_path / "trainers" / "team-a", "a")
    ctx = zmq.Context()
    guard = security.Guard(server_secret, {"trainer": tmp_path / "trainers"})
    router = ctx.socket(zmq.ROUTER)
    guard.server(router, ("trainer",))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen = []
    try:
        for name, where in (("t", tmp_path / "trainers"), ("a", tmp_path / "trainers" / "team-a")):
            dealer = ctx.socket(zmq.DEALER)
            security.client_keys(server_public, where / f"{name}.key_secret").apply(dealer)
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealer.send(b"hello")
            assert router.poll(10_000), "the guard admitted no one"
            frames = router.recv_multipart(copy=False)
            seen.append(security.peer_of(frames[-1]))
            dealer.close(linger=0)
    finally:
        router.close(linger=0)
        guard.stop()
        ctx.term()
    assert seen == [Peer("trainer"), Peer("trainer", ("team-a",))]


def _scoped_sim() -> Sim:
    sim = Sim()
    sim.running()  # job "job", epoch 1
    return sim


#: what a job-scoped key may send, by role (admins and workers are never scoped)
SCOPED_SENDS = sorted((role, k) for k, r in ROUTES.items() for role in ("trainer", "client") if role in r.roles)


@pytest.mark.parametrize(("role", "kind"), SCOPED_SENDS)
def test_a_scoped_key_is_refused_on_another_jobs_every_message(role, kind):
    """A key of job ``other`` sends each message type it may send, naming the held job
    ``job`` (its name, its epoch or its id, as the type has it): each is refused as out of
    its scope, or (what names no job) answered without the held job; nothing changes."""
    sim = _scoped_sim()
    live = _live(sim)
    before = _view(sim)
    sim.coord.on_message([b"t0", _message(kind, live)], role, ("other",))
    if kind in ("status", "jobs"):  # name no job: answered with its jobs only
        assert not sim.state.refused
        if kind == "status":
            st = sim.out.last("status_reply")["status"]
            assert st["job"] is None and "restorable" not in st
            assert all(w["applied"] is None and w["start"] is None for w in st["workers"])
        if kind == "jobs":
            assert sim.out.last("jobs_reply")["jobs"] == []
    else:
        assert sim.state.refused == {(role, "scope"): 1}, sim.out.kinds()
        err = sim.out.last("error")
        assert err["code"] == "refused" and "limited to jobs other" in err["message"]
        assert "'job'" in err["message"]
    assert _view(sim) == before
    sim.coord.on_message([b"t0", _message(kind, live)], role, ("jo*",))  # a key of the held job goes on
    assert sum(sim.state.refused.values()) == (0 if kind in ("status", "jobs") else 1)


@pytest.mark.parametrize("kind", ["status", "restore_info", "jobs"])
def test_a_scoped_key_of_the_held_job_sees_it(kind):
    sim = _scoped_sim()
    sim.coord.on_message([b"c", _message(kind, {**_live(sim), "job": None})], "client", ("job",))
    assert not sim.state.refused
    reply = sim.out.last(f"{kind}_reply")
    if kind == "status":
        view = status_view(sim.state, sim.coord.persist)
        assert reply["status"]["job"] == view["job"] and reply["status"]["restorable"] == view["restorable"]
        assert [w["applied"] for w in reply["status"]["workers"]] == [w["applied"] for w in view["workers"]]
    elif kind == "restore_info":
        assert reply["info"]["job"] == "job"
    else:
        assert [r["name"] for r in reply["jobs"]] == ["job"]


def test_a_scoped_attach_is_refused_before_anything_is_held():
    sim = Sim()
    for i in range(2):
        sim.register(i)
    raw = _message("attach", {"job": "job", "rank": 0, "world": 1})
    sim.coord.on_message([b"t0", raw], "trainer", ("team-a",))
    assert sim.state.job is None and not sim.state.pending
    assert sim.state.refused == {("trainer", "scope"): 1}
    assert "may not attach to job 'job'" in sim.out.last("error")["message"]
    assert M.peek_type(raw) == "attach"


def test_a_scoped_catalog_of_every_job_lists_its_jobs_only(tmp_path):
    sim = _with_tier(tmp_path)
    for job in ("job", "team-a-1", "team-a-2", "team-b"):
        _write_checkpoint(str(tmp_path), job, 3, SIM_LAYOUT)

    def listed(jobs) -> set[str]:
        sim.coord.on_message([b"reader", M.encode("catalog", tier="local", job=None)], "client", jobs)
        return {e[0].split("/")[0] for e in sim.out.last("catalog_reply")["checkpoints"]}

    assert listed(None) == {"job", "team-a-1", "team-a-2", "team-b"}
    assert listed(("team-a-*",)) == {"team-a-1", "team-a-2"}
    assert listed(("team-b", "job")) == {"team-b", "job"}
    assert listed(None) == {"job", "team-a-1", "team-a-2", "team-b"}  # the shared reply is whole
    sim.coord.on_message([b"reader", M.encode("catalog", tier="local", job="team-b")], "client", ("team-a-*",))
    assert sim.state.refused == {("client", "scope"): 1}
