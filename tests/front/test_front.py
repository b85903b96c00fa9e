"""The shared cluster's front (:class:`shadow.front.front.Front`), driven message by message
with its job processes stood in for: admission with the figures, held ranks, scopes,
``moved`` answers, drop and a crashed job's cluster."""

from __future__ import annotations

import itertools
import time

import pytest

from shadow.config import ClusterConfig, PersistConfig
from shadow.config.tiers import LocalTierConfig
from shadow.coordinator.outbox import RecordingOutbox
from shadow.core.layout import Layout
from shadow.front.admission import GB, WORKER_FIXED_BYTES, Budget
from shadow.front.front import HOLD_S, Front
from shadow.wire import messages as M

OPTIM = {"kind": "adam", "impl": "fused", "vec_width": 8, "tail_width": 1}
_PORTS = itertools.count(40000)


class FakeProcs:
    """A job's processes, not started: an address, an exit code a test sets, a report."""

    def __init__(self, name, cfg, need, cores, workdir, slots=(), join="") -> None:
        self.name, self.need, self.cores, self.slots, self.join = name, need, cores, slots, join
        self.port, self.tries, self.reported, self.ended_why = 0, 0, True, ""
        self.code: int | None = None
        self.rows: list[dict] = []
        self.stopped = False
        self.since = 0.0
        self.proc = None
        self.asked_last = False
        self.last_kept = False

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.tries += 1
        self.port = next(_PORTS)

    def exited(self):
        return self.code

    def report(self):
        return {"time": time.time(), "status": {"job": self.name}, "jobs": self.rows, "last_kept": self.last_kept}

    def ask_last(self) -> None:
        self.asked_last = True

    def stop(self) -> None:
        self.stopped = True

    def kill(self) -> None:
        pass


def _front(
    memory_gb: float = 10.0, cores: int = 4, cores_per_job: int = 0, workers: int = 2, tier: bool = False
) -> Front:
    persist = PersistConfig(local=LocalTierConfig(dir="/nonexistent")) if tier else PersistConfig(durable=False)
    cfg = ClusterConfig(workers=workers, shared=True, persist=persist, cores_per_job=0)
    cfg.cores_per_job = cores_per_job  # (past the check against this machine's cores)
    return Front(cfg, RecordingOutbox(), Budget(int(memory_gb * GB), range(cores)), "/nonexistent", FakeProcs)


def _attach(job: str, rank: int = 0, world: int = 2, elements: int = 1 << 20) -> bytes:
    layout = Layout.build([("w", (elements,), 0, True)], 1)
    return M.encode(
        "attach",
        job=job,
        rank=rank,
        world=world,
        layout_hash=layout.hash,
        layout=layout.to_dict() if rank == 0 else None,
        optim=OPTIM,
        iteration=0,
        overwrite=False,
        restored=None,
    )


def test_rank_0_admits_its_job_and_every_rank_is_sent_to_its_coordinator():
    f = _front()
    f.on_message([b"r1", _attach("a", rank=1)], "trainer")
    assert f.out.kinds(b"r1") == ["waiting"] and "rank 0" in f.out.last("waiting")["reason"]
    f.on_message([b"r0", _attach("a", rank=0)], "trainer")
    to = f.jobs["a"].address
    assert f.out.last("moved", b"r0") == {"job": "a", "to": to}
    assert f.out.last("moved", b"r1") == {"job": "a", "to": to}  # the held rank too
    f.on_message([b"r2", _attach("a", rank=1)], "trainer")  # later: at once
    assert f.out.last("moved", b"r2")["to"] == to
    f.on_message([b"b0", _attach("b")], "trainer")
    assert f.jobs["b"].address != to  # a coordinator of its own
    for kind, fields in (("restore_info", {"job": "b"}), ("catalog", {"tier": "local", "job": "b"})):
        f.on_message([b"c", M.encode(kind, **fields)], "client")
        assert f.out.last("moved", b"c")["to"] == f.jobs["b"].address


def test_a_job_that_does_not_fit_is_refused_with_the_figures_and_its_held_ranks_too():
    f = _front(memory_gb=1.2)  # a job of 2 workers and 1 M elements holds about 0.52 GB
    f.on_message([b"a0", _attach("a")], "trainer")
    f.on_message([b"b0", _attach("b")], "trainer")
    f.on_message([b"c1", _attach("c", rank=1)], "trainer")
    f.on_message([b"c0", _attach("c")], "trainer")
    assert "error" not in f.out.kinds(b"c0")  # refused once every job's next report is in: none ended
    f.tick()
    for ident in (b"c0", b"c1"):
        err = f.out.last("error", ident)
        assert err["code"] == "refused", err
        msg = err["message"]
        assert "attach of job 'c' refused: it needs 0.52 GB of memory and 0.16 GB of 1.20 GB is free" in msg, msg
        assert "jobs holding it: a 0.52 GB, b 0.52 GB" in msg and "ended jobs among them: none" in msg, msg
    assert "c" not in f.jobs and f.budget.used() == 2 * f.jobs["a"].need.bytes
    need = f.jobs["a"].need
    assert need.bytes == (1 << 20) * 4 * (3 + 2) + 2 * WORKER_FIXED_BYTES  # 3 arrays, 2 in flight, no tier


def test_an_ended_jobs_memory_goes_to_a_new_job_once_its_last_iteration_is_on_the_tier():
    f = _front(memory_gb=1.2, tier=True)
    for job in ("a", "b"):
        f.on_message([job.encode(), _attach(job)], "trainer")
    a = f.jobs["a"]
    a.rows = [{"name": "a", "held": True, "status": "running", "trainers_gone": True, "last_heard_s": 40}]
    f.tick()
    assert a.ended_why == "no rank heard for 40 s"
    f.on_message([b"d0", _attach("d", elements=1 << 30)], "trainer")  # more than every ended job frees
    f.tick()
    msg = f.out.last("error", b"d0")["message"]
    assert "ended jobs among them: a (no rank heard for 40 s): `shadow drop job=NAME` frees one" in msg, msg
    assert not a.asked_last
    f.on_message([b"c0", _attach("c")], "trainer")  # fits once a's memory is back: held meanwhile
    f.tick()
    assert f.out.kinds(b"c0") == ["waiting"] and "memory of ended job 'a'" in f.out.last("waiting", b"c0")["reason"]
    assert a.asked_last and "a" in f.jobs
    f.tick()  # its last iteration not on the tier yet
    assert "a" in f.jobs and "c" not in f.jobs
    a.last_kept = True
    f.tick()
    assert "a" not in f.jobs and a.stopped and f.out.last("moved", b"c0")["job"] == "c"


def test_an_ended_job_whose_trainers_come_back_keeps_its_memory():
    f = _front(memory_gb=1.2)
    for job in ("a", "b"):
        f.on_message([job.encode(), _attach(job)], "trainer")
    a = f.jobs["a"]
    a.rows = [{"name": "a", "held": True, "status": "detached"}]
    f.tick()
    f.on_message([b"c0", _attach("c")], "trainer")
    f.tick()
    assert a.asked_last and f.reclaiming == {"a": f.reclaiming["a"]}
    a.rows = [{"name": "a", "held": True, "status": "running", "trainers_gone": False}]  # relaunched
    f.tick()
    assert "a" in f.jobs and not a.stopped and not f.reclaiming
    err = f.out.last("error", b"c0")
    assert "attach of job 'c' refused" in err["message"], err


def test_a_drop_frees_a_jobs_memory_at_once():
    f = _front(memory_gb=1.2)
    for job in ("a", "b"):
        f.on_message([job.encode(), _attach(job)], "trainer")
    f.jobs["a"].rows = [{"name": "a", "held": True, "status": "running", "trainers_gone": True, "last_heard_s": 9}]
    f.tick()
    f.on_message([b"x", M.encode("drop", job="a", force=False)], "admin")
    assert f.out.last("drop_reply", b"x")["job"] == "a" and "a" not in f.jobs
    f.on_message([b"c0", _attach("c")], "trainer")
    assert f.out.last("moved", b"c0")["job"] == "c"


def test_a_drop_of_a_job_whose_trainers_are_heard_needs_force_and_only_an_admin_drops():
    f = _front()
    f.on_message([b"a0", _attach("a")], "trainer")
    f.jobs["a"].rows = [{"name": "a", "held": True, "status": "running", "trainers_gone": False}]
    f.tick()
    f.on_message([b"c", M.encode("drop", job="a", force=False)], "client")
    assert "a client may not send 'drop'" in f.out.last("error", b"c")["message"]
    f.on_message([b"x", M.encode("drop", job="a", force=False)], "admin")
    assert "still heard from" in f.out.last("error", b"x")["message"] and "a" in f.jobs
    f.on_message([b"x", M.encode("drop", job="a", force=True)], "admin")
    assert f.out.last("drop_reply", b"x")["forced"] and "a" not in f.jobs


def test_cores_per_job_are_given_apart_and_run_out():
    f = _front(cores=4, cores_per_job=2)
    f.on_message([b"a0", _attach("a")], "trainer")
    f.on_message([b"b0", _attach("b")], "trainer")
    assert f.jobs["a"].cores == (0, 1) and f.jobs["b"].cores == (2, 3)
    f.on_message([b"c0", _attach("c")], "trainer")
    f.tick()
    assert "it needs 2 cores of its own and 0 of 4 are free" in f.out.last("error", b"c0")["message"]
    f.on_message([b"x", M.encode("drop", job="a", force=True)], "admin")
    f.on_message([b"c0", _attach("c")], "trainer")
    assert f.jobs["c"].cores == (0, 1)


def test_a_scoped_key_reaches_its_jobs_only():
    f = _front()
    for job in ("team-a", "team-b"):
        f.on_message([job.encode(), _attach(job)], "trainer")
    scope = ("team-a",)
    f.on_message([b"t", _attach("team-b", rank=1)], "trainer", scope)
    assert "limited to jobs team-a: it may not attach to job 'team-b'" in f.out.last("error", b"t")["message"]
    for kind, fields in (
        ("restore_info", {"job": "team-b"}),
        ("catalog", {"tier": "local", "job": "team-b"}),
        ("status", {"job": "team-b"}),
    ):
        f.on_message([b"c", M.encode(kind, **fields)], "client", scope)
        assert f.out.kinds(b"c")[-1] == "error" and "limited to jobs team-a" in f.out.last("error", b"c")["message"]
    f.on_message([b"c", M.encode("restore_info", job=None)], "client", scope)  # its one job, by omission
    assert f.out.last("moved", b"c")["job"] == "team-a"
    f.on_message([b"c", M.encode("status")], "client", scope)
    assert [j["name"] for j in f.out.last("status_reply", b"c")["status"]["jobs"]] == ["team-a"]
    f.jobs["team-b"].rows = [{"name": "team-b", "held": True, "status": "running"}]
    f.on_message([b"c", M.encode("jobs")], "client", scope)
    assert [r["name"] for r in f.out.last("jobs_reply", b"c")["jobs"]] == ["team-a"]
    f.on_message([b"c", M.encode("jobs")], "client")
    assert [r["name"] for r in f.out.last("jobs_reply", b"c")["jobs"]] == ["team-a", "team-b"]


def test_what_a_front_does_not_take_is_refused_and_a_malformed_message_answered():
    f = _front()
    f.on_message([b"w", M.encode("fetch", epoch=1, iteration=1)], "client")
    assert "front: it does not take 'fetch'" in f.out.last("error", b"w")["message"]
    f.on_message([b"m", b"\x93garbage"], "client")
    assert f.out.last("error", b"m")["code"] == "malformed"
    f.on_message([b"n", _attach("bad/name")], "trainer")
    assert f.out.last("error", b"n")["code"] == "refused"
    f.on_message([b"r", M.encode("restore_info", job="nowhere")], "client")  # not running: its tiers, read directly
    info = f.out.last("restore_info_reply", b"r")["info"]
    assert info["memory"] is None and "does not run on this shared cluster now" in info["memory_error"], info
    f.on_message([b"r", M.encode("catalog", tier="local", job="nowhere")], "client")
    assert "does not run on this shared cluster" in f.out.last("error", b"r")["message"]


def test_a_job_whose_cluster_died_is_ended_and_admitted_again_at_its_next_attach(monkeypatch):
    f = _front()
    f.on_message([b"a0", _attach("a")], "trainer")
    procs = f.jobs["a"]
    procs.reported, procs.code = False, 1  # exited before it came up: started again (a port taken)
    f.tick()
    assert f.jobs["a"] is procs and procs.tries == 2
    procs.reported = True
    f.tick()  # exited after it came up: a crash; its memory is free
    assert "a" not in f.jobs and procs.stopped and f.budget.used() == 0
    f.on_message([b"a0", _attach("a")], "trainer")
    assert f.jobs["a"] is not procs


def test_a_held_rank_whose_rank_0_never_comes_is_answered(monkeypatch):
    f = _front()
    f.on_message([b"r1", _attach("a", rank=1)], "trainer")
    import shadow.front.front as front_mod

    now = front_mod.time.monotonic()
    monkeypatch.setattr(front_mod.time, "monotonic", lambda: now + HOLD_S + 1)
    f.tick()
    assert f.out.last("error", b"r1")["code"] == "timeout" and not f.held


@pytest.mark.parametrize("bad", [{"num_groups": 1, "params": [["w", [4], 0, -4, 0, True]]}, {"x": 1}])
def test_a_malformed_layout_is_refused_not_admitted(bad):
    f = _front()
    raw = M.decode(_attach("a"))
    raw.pop("t"), raw.pop("v")
    raw["layout"] = bad
    f.on_message([b"a0", M.encode("attach", **raw)], "trainer")
    assert f.out.last("error", b"a0")["code"] == "refused" and "a" not in f.jobs


def test_a_moved_answer_is_followed_on_the_host_the_front_was_reached_at():
    from shadow.core.errors import ShadowConnectionError
    from shadow.transport.client import moved_to

    msg = {"job": "a", "to": "tcp://0.0.0.0:6003"}  # a front bound to every interface names its own bind
    assert moved_to("tcp://shadow-coordinator:5555", msg) == "tcp://shadow-coordinator:6003"
    assert moved_to("tcp://10.0.0.5:5555", {"job": "a", "to": "tcp://10.0.0.5:7"}) == "tcp://10.0.0.5:7"
    for address, to in (("ipc:///tmp/x", "tcp://h:1"), ("tcp://h:5555", "tcp://h:99999"), ("tcp://h:1", "nowhere")):
        with pytest.raises(ShadowConnectionError, match="cannot follow"):
            moved_to(address, {"job": "a", "to": to})


def test_job_ports_is_a_range_apart_from_the_front_and_runs_out_with_a_clear_error():
    import socket

    from shadow.core.errors import ShadowError
    from shadow.front.jobs import free_port

    for bad in ("6000", "6000-", "7000-6000", "0-10", "x-y"):
        with pytest.raises(ValueError, match="job_ports=.* must be a range of ports LO-HI"):
            ClusterConfig(shared=True, job_ports=bad)
    with pytest.raises(ValueError, match="holds port=5555"):
        ClusterConfig(shared=True, job_ports="5550-5560")
    assert ClusterConfig(shared=True, job_ports="6000-6015").port_range() == range(6000, 6016)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with pytest.raises(ShadowError, match=f"every port of job_ports={port}-{port} is taken"):
            free_port("127.0.0.1", range(port, port + 1))


def test_the_ranks_held_for_their_rank_0_are_bounded(monkeypatch):
    import shadow.front.front as front_mod

    monkeypatch.setattr(front_mod, "MAX_HELD", 3)
    f = _front()
    for i in range(4):
        f.on_message([b"r%d" % i, _attach(f"job{i}", rank=1)], "trainer")
    assert f.out.last("error", b"r3")["code"] == "busy" and sum(map(len, f.held.values())) == 3


def test_restore_info_without_a_job_names_the_jobs_for_ls_and_other_asks_are_refused():
    f = _front()
    for job in ("a", "b"):
        f.on_message([job.encode(), _attach(job)], "trainer")
    f.on_message([b"c", M.encode("restore_info", job=None)], "client")
    info = f.out.last("restore_info_reply", b"c")["info"]
    assert info["memory"] is None and info["jobs"] == ["a", "b"] and "name the job (job=NAME)" in info["memory_error"]
    f.on_message([b"c", M.encode("catalog", tier="local", job=None)], "client")
    assert "name the job" in f.out.last("error", b"c")["message"]
