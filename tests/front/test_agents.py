"""A shared cluster over several hosts: the front places each job on the host with the most
memory free (its own, or an agent's), the agent runs it (:class:`shadow.front.agent.Agent`),
and every rank is sent on to that host. Driven message by message, the job processes
stood in for."""

from __future__ import annotations

import time

import pytest

from shadow.config import AgentConfig
from shadow.front import agents as hosts
from shadow.front.admission import GB
from shadow.front.agent import Agent
from shadow.front.agents import RemoteProcs
from shadow.wire import messages as M
from tests.front.test_front import FakeProcs, _attach, _front


def _beat(name: str = "b", memory_gb: float = 10.0, cores: int = 4, jobs: list | None = None, **extra) -> bytes:
    fields = {
        "name": name,
        "host": f"{name}.example",
        "memory": int(memory_gb * GB),
        "cores": cores,
        "cores_per_job": 0,
        "jobs": jobs or [],
        **extra,
    }
    return M.encode("agent", **fields)


def _report(job: str, **row) -> dict:
    return {
        "time": time.time(),
        "pid": 4242,
        "status": {"job": {"name": job}},
        "jobs": [{"name": job, "status": "running", "held": True, **row}],
        "last_kept": False,
        "samples": {"shadow_committed_iteration": [[[], 7]]},
    }


def _wanted(f, ident: bytes = b"agent-b") -> list[dict]:
    return f.out.last("agent_jobs", ident)["jobs"]


def test_a_job_that_does_not_fit_the_front_goes_to_an_agent_and_its_ranks_follow_it_there():
    f = _front(memory_gb=0.1)  # nothing fits beside the front
    f.on_message([b"agent-b", _beat()], "worker")
    assert _wanted(f) == []
    f.on_message([b"r1", _attach("a", rank=1)], "trainer")
    f.on_message([b"r0", _attach("a")], "trainer")
    procs = f.jobs["a"]
    assert isinstance(procs, RemoteProcs) and procs.where == "b"
    for ident in (b"r0", b"r1"):  # told once the agent says where the job listens
        assert f.out.kinds(ident)[-1] == "waiting" and "starting on host b" in f.out.last("waiting", ident)["reason"]
    f.on_message([b"agent-b", _beat()], "worker")
    assert _wanted(f) == [{"job": "a", "workers": 2, "replicas": 1, "last": False}]
    row = {"job": "a", "port": 6001, "pid": 4242, "exited": None, "report": None}
    f.on_message([b"agent-b", _beat(jobs=[row])], "worker")
    f.tick()
    for ident in (b"r0", b"r1"):
        assert f.out.last("moved", ident) == {"job": "a", "to": "tcp://b.example:6001", "host": "b.example"}
    f.on_message([b"r2", _attach("a", rank=1)], "trainer")  # later ranks: at once
    assert f.out.last("moved", b"r2")["host"] == "b.example"

    f.on_message([b"agent-b", _beat(jobs=[{**row, "report": _report("a")}])], "worker")
    st = f.status()
    (job,) = st["jobs"]
    assert job["host"] == "b" and job["pid"] == 4242 and job["status"] == {"job": {"name": "a"}}
    (agent,) = st["front"]["agents"]
    assert agent["name"] == "b" and agent["alive"] and agent["jobs"] == ["a"]
    assert agent["used_bytes"] == procs.need.bytes and st["front"]["used_bytes"] == 0


def test_jobs_spread_over_the_hosts_with_the_most_memory_free_and_a_refusal_names_every_host():
    f = _front(memory_gb=1.2)
    f.on_message([b"agent-b", _beat(memory_gb=1.0)], "worker")
    f.on_message([b"a0", _attach("a")], "trainer")  # 0.52 GB: the front has the most free
    f.on_message([b"b0", _attach("b")], "trainer")  # then host b (1.0 GB free against 0.68)
    f.on_message([b"c0", _attach("c")], "trainer")  # then the front again (0.68 against 0.48)
    assert [type(f.jobs[j]).__name__ for j in "abc"] == ["FakeProcs", "RemoteProcs", "FakeProcs"]
    f.on_message([b"d0", _attach("d")], "trainer")
    env, msg, since = f.admitting["d"]
    f.admitting["d"] = (env, msg, since - 60)  # every job's next report awaited long enough (b sent none)
    f.tick()
    msg = f.out.last("error", b"d0")["message"]
    assert msg.startswith("attach of job 'd' refused: no host of this shared cluster has room for it (")
    assert "host b: it needs 0.52 GB of memory and 0.48 GB of 1.00 GB is free" in msg, msg
    assert "the front: it needs 0.52 GB of memory and 0.16 GB of 1.20 GB is free" in msg, msg


def test_a_lost_agent_takes_no_job_and_its_jobs_show_no_report(monkeypatch):
    f = _front(memory_gb=0.1)
    f.on_message([b"agent-b", _beat()], "worker")
    f.agents["b"].heard -= hosts.AGENT_LOST_S + 1
    f.on_message([b"a0", _attach("a")], "trainer")
    f.tick()
    msg = f.out.last("error", b"a0")["message"]  # the front's own host alone is left
    assert "a" not in f.jobs and "it needs 0.52 GB of memory and 0.10 GB of 0.10 GB is free" in msg, msg
    f.on_message([b"agent-b", _beat()], "worker")
    f.on_message([b"a1", _attach("a")], "trainer")
    row = {"job": "a", "port": 6001, "pid": 4242, "exited": None, "report": _report("a")}
    f.on_message([b"agent-b", _beat(jobs=[row])], "worker")
    assert f.jobs["a"].report() is not None
    f.agents["b"].heard -= hosts.AGENT_LOST_S + 1
    assert f.jobs["a"].report() is None and f.jobs["a"].exited() is None and "a" in f.jobs
    assert not f.status()["front"]["agents"][0]["alive"]


def test_a_dropped_or_exited_remote_job_leaves_the_agents_list_and_frees_its_memory():
    f = _front(memory_gb=0.1)
    f.on_message([b"agent-b", _beat()], "worker")
    for job in ("a", "c"):
        f.on_message([job.encode(), _attach(job)], "trainer")
    row = {"job": "a", "port": 6001, "pid": 4242, "exited": None, "report": _report("a", trainers_gone=True)}
    f.on_message([b"agent-b", _beat(jobs=[row, {**row, "job": "c", "port": 6002, "report": None}])], "worker")
    f.tick()
    f.on_message([b"adm", M.encode("drop", job="a", force=False)], "admin")
    assert f.out.last("drop_reply", b"adm")["job"] == "a" and "a" not in f.jobs
    f.on_message([b"agent-b", _beat(jobs=[{**row, "job": "c", "port": 6002, "exited": 1, "report": None}])], "worker")
    f.tick()  # c's cluster exited on the agent: ended, its memory free
    assert "c" not in f.jobs and f.agents["b"].budget.used() == 0
    f.on_message([b"agent-b", _beat()], "worker")
    assert _wanted(f) == []


def test_an_ended_job_on_an_agent_gives_its_memory_after_its_last_iteration_is_on_the_tier():
    f = _front(memory_gb=0.1, tier=True)
    f.on_message([b"agent-b", _beat(memory_gb=1.0)], "worker")
    f.on_message([b"a0", _attach("a")], "trainer")
    gone = {"job": "a", "port": 6001, "pid": 4242, "exited": None, "report": _report("a", trainers_gone=True)}
    f.on_message([b"agent-b", _beat(memory_gb=1.0, jobs=[gone])], "worker")
    f.tick()
    assert f.jobs["a"].ended_why.startswith("no rank heard")
    f.on_message([b"n0", _attach("n", elements=3 << 20)], "trainer")  # fits on b once a's memory is back
    env, msg, since = f.admitting["n"]
    f.admitting["n"] = (env, msg, since - 60)  # every job's next report awaited long enough
    f.tick()
    assert "memory of ended job 'a'" in f.out.last("waiting", b"n0")["reason"]
    f.on_message([b"agent-b", _beat(memory_gb=1.0, jobs=[gone])], "worker")
    assert _wanted(f) == [{"job": "a", "workers": 2, "replicas": 1, "last": True}]
    kept = {**gone, "report": {**_report("a", trainers_gone=True), "last_kept": True}}
    f.on_message([b"agent-b", _beat(memory_gb=1.0, jobs=[kept])], "worker")
    f.tick()
    assert "a" not in f.jobs and f.jobs["n"].where == "b"


@pytest.mark.parametrize(
    "change, why",
    [
        ({"name": "b c"}, "agent name"),
        ({"host": "b;rm -rf"}, "is not a host name"),
        ({"cores_per_job": 9}, "out of range"),
        ({"jobs": [{"job": "a", "port": 99999}]}, "a malformed job row"),
        ({"jobs": [{"job": "../x", "port": 1}]}, "a malformed job row"),
        ({"jobs": ["a"]}, "a malformed job row"),
    ],
)
def test_a_malformed_agent_message_is_answered_and_changes_nothing(change, why):
    f = _front()
    raw = M.decode(_beat())
    raw.pop("t"), raw.pop("v")
    f.on_message([b"agent-x", M.encode("agent", **{**raw, **change})], "worker")
    err = f.out.last("error", b"agent-x")
    assert err["code"] == "malformed" and why in err["message"], err
    assert f.agents == {}


def test_a_forwarded_report_that_is_not_one_is_dropped_and_only_worker_keys_speak_for_agents():
    f = _front(memory_gb=0.1)
    f.on_message([b"agent-b", _beat()], "worker")
    f.on_message([b"a0", _attach("a")], "trainer")
    for bad in ({"time": "now"}, {**_report("a"), "jobs": [{"name": 3}]}, [1, 2]):
        row = {"job": "a", "port": 6001, "pid": 4242, "exited": None, "report": bad}
        f.on_message([b"agent-b", _beat(jobs=[row])], "worker")
        assert f.jobs["a"].report() is None
        f.tick()  # nothing it holds stops the loop
    bad_samples = {**_report("a"), "samples": {"x": [["not a list", 1]]}}
    f.on_message([b"agent-b", _beat(jobs=[{**row, "report": bad_samples}])], "worker")
    assert f.jobs["a"].report()["samples"] == {}
    f.on_message([b"t", _beat(name="t")], "trainer")
    assert f.out.last("error", b"t")["code"] == "refused" and "t" not in f.agents
    f.on_message([b"agent-b2", _beat()], "worker")  # the same name from another connection
    assert f.out.last("error", b"agent-b2")["code"] == "busy"


class _Started(FakeProcs):
    started: list = []

    def __init__(self, name, cfg, need, cores, workdir, slots=(), join="") -> None:
        super().__init__(name, cfg, need, cores, workdir, slots, join)
        self.cfg = cfg
        _Started.started.append(self)


def test_an_agent_runs_exactly_the_jobs_its_front_lists():
    _Started.started = []
    cfg = AgentConfig(front="tcp://127.0.0.1:5555", name="b", host="127.0.0.1")
    agent = Agent(cfg, "b.example", "/nonexistent", spawn=_Started, memory=int(4 * GB))
    beat = agent.beat()
    assert beat["name"] == "b" and beat["host"] == "b.example" and beat["memory"] == int(4 * GB)
    assert beat["jobs"] == []
    agent.reconcile([{"job": "a", "workers": 4, "replicas": 2, "last": False}, {"job": "../x"}, "junk"])
    (a,) = _Started.started
    assert set(agent.jobs) == {"a"} and a.cfg.workers == 4 and a.cfg.replicas == 2 and not a.cfg.shared
    (row,) = agent.beat()["jobs"]
    assert row["job"] == "a" and row["port"] == a.port and row["exited"] is None
    M.encode("agent", **agent.beat())  # what it sends checks against the schema
    agent.reconcile([{"job": "a", "workers": 4, "replicas": 2, "last": True}])
    agent.reconcile([{"job": "a", "workers": 4, "replicas": 2, "last": True}])
    assert a.asked_last and len(_Started.started) == 1  # asked once, started once
    agent.reconcile([])
    assert a.stopped and agent.jobs == {}
    agent.reconcile([{"job": "b", "workers": 3, "replicas": 2, "last": False}])  # 3 workers, 2 replicas: no
    assert agent.jobs == {}


def test_a_moved_answer_naming_a_host_is_followed_there_and_only_to_a_host():
    from shadow.core.errors import ShadowConnectionError
    from shadow.transport.client import moved_to

    msg = {"job": "a", "to": "tcp://b.example:6001", "host": "b.example"}
    assert moved_to("tcp://front:5555", msg) == "tcp://b.example:6001"
    assert moved_to("tcp://front:5555", {**msg, "host": "fd00::7"}) == "tcp://[fd00::7]:6001"
    for bad in ("b.example:7/x", "a b", "x;y"):
        with pytest.raises(ShadowConnectionError, match="is not a host name or address"):
            moved_to("tcp://front:5555", {**msg, "host": bad})


# -- a job bigger than any one host: spread over several


def _job_bytes(workers: int = 4, replicas: int = 1) -> int:
    """What the test job (:func:`_attach`'s layout, adam) holds with ``workers``."""
    f = _front(workers=workers)
    f.cfg.replicas = replicas
    f.on_message([b"r0", _attach("probe")], "trainer")
    return f.jobs["probe"].need.bytes


def test_a_job_no_host_holds_alone_is_spread_over_hosts_and_its_parts_join_its_coordinator():
    whole = _job_bytes(4)
    fits = (whole * 0.6) / GB  # each host holds a bit more than half of it
    f = _front(memory_gb=fits, workers=4)
    f.on_message([b"agent-b", _beat(memory_gb=fits * 1.01)], "worker")
    f.on_message([b"r0", _attach("big")], "trainer")
    head = f.jobs["big"]
    (part,) = f.parts["big"]
    assert isinstance(head, RemoteProcs) and head.where == "b"  # the coordinator on the host with most room
    assert head.slots == (0, 1) and part.slots == (2, 3) and part.join == ""  # the front's own two slots
    assert f.budget.held["big"][0] + f.agents["b"].budget.held["big"][0] == whole
    # the front's part starts once the agent says where the coordinator listens
    f.on_message([b"agent-b", _beat(memory_gb=fits * 1.01)], "worker")
    assert _wanted(f) == [{"job": "big", "workers": 4, "replicas": 1, "last": False, "slots": [0, 1], "join": ""}]
    f.tick()
    assert part.tries == 0
    row = {"job": "big", "port": 6001, "pid": 77, "exited": None, "report": _report("big")}
    f.on_message([b"agent-b", _beat(memory_gb=fits * 1.01, jobs=[row])], "worker")
    f.tick()
    assert part.join == "tcp://b.example:6001" and part.tries == 1
    assert f.out.kinds(b"r0")[-1] == "moved" and f.out.last("moved", b"r0")["host"] == "b.example"
    # its part exiting ends the job everywhere: its memory is no longer whole
    part.code = 1
    f.tick()
    assert "big" not in f.jobs and "big" not in f.parts and part.stopped
    assert "big" not in f.budget.held and "big" not in f.agents["b"].budget.held


def test_a_spread_job_keeps_each_shards_replicas_on_different_hosts():
    whole = _job_bytes(4, replicas=2)
    f = _front(memory_gb=whole * 0.8 / GB, workers=4)
    f.cfg.replicas = 2
    f.on_message([b"agent-b", _beat(memory_gb=whole * 0.8 / GB)], "worker")
    f.on_message([b"r0", _attach("r")], "trainer")
    parts = [f.jobs["r"], *f.parts["r"]]
    assert sorted(p.slots for p in parts) == [(0, 1), (2, 3)]  # shard i % 2: one replica of each per host


def test_a_job_all_hosts_together_cannot_hold_is_refused_with_each_hosts_figures():
    whole = _job_bytes(4)
    f = _front(memory_gb=whole * 0.3 / GB, workers=4)
    f.on_message([b"agent-b", _beat(memory_gb=whole * 0.3 / GB)], "worker")
    f.on_message([b"r0", _attach("huge")], "trainer")
    f.tick()
    f.admit([b"r0"], "huge", M.decode(_attach("huge")), settled=True)
    why = f.out.last("error", b"r0")["message"]
    assert "no host of this shared cluster has room for it" in why and "host b:" in why and "the front:" in why
    assert "nor have all of them together: each of its 4 workers needs" in why
    assert "huge" not in f.jobs and f.budget.held == {} and f.agents["b"].budget.held == {}


def test_an_agent_runs_a_spread_jobs_slots_for_a_coordinator_elsewhere_and_follows_it():
    _Started.started = []
    cfg = AgentConfig(front="tcp://127.0.0.1:5555", name="b", host="127.0.0.1")
    agent = Agent(cfg, "b.example", "/nonexistent", spawn=_Started, memory=int(4 * GB))
    entry = {"job": "a", "workers": 4, "replicas": 1, "last": False, "slots": [2, 3], "join": "tcp://a.example:6000"}
    agent.reconcile([entry])
    (first,) = _Started.started
    assert first.slots == (2, 3) and first.join == "tcp://a.example:6000" and first.need.workers == 2
    agent.reconcile([entry])
    assert len(_Started.started) == 1
    agent.reconcile([{**entry, "join": "tcp://a.example:6009"}])  # its coordinator started again elsewhere
    assert first.stopped and _Started.started[-1].join == "tcp://a.example:6009"
    for bad in ({"slots": [4]}, {"slots": [1, 1]}, {"slots": "0-1"}, {"join": "tcp://a b:1"}, {"join": 7}):
        agent.reconcile([{**entry, "job": "c", **bad}])
        assert "c" not in agent.jobs


def test_slots_and_coordinator_name_a_spread_jobs_part_or_say_what_is_wrong():
    from shadow.config import ClusterConfig

    assert ClusterConfig(workers=4).slot_list() == [0, 1, 2, 3]
    assert ClusterConfig(workers=8, slots="0-2,5").slot_list() == [0, 1, 2, 5]
    part = ClusterConfig(workers=4, slots="3", coordinator="tcp://a.example:6000")
    assert part.slot_list() == [3] and part.threads() >= 1
    for bad in ("x", "1-", "2-1", "0,3-2", "0,0", "4", "-1", ","):
        with pytest.raises(ValueError, match="slots="):
            ClusterConfig(workers=4, slots=bad)
    with pytest.raises(ValueError, match="coordinator='a.example:6000' is not a ZeroMQ endpoint"):
        ClusterConfig(workers=4, coordinator="a.example:6000")


def test_ended_jobs_on_several_hosts_give_their_memory_to_a_job_spread_over_them():
    from shadow.front.admission import WORKER_FIXED_BYTES

    x = _job_bytes(2)  # one small job: 2 workers of 2^20 elements
    f = _front(memory_gb=1.1 * x / GB, workers=2)
    f.on_message([b"agent-b", _beat(memory_gb=1.2 * x / GB)], "worker")
    f.on_message([b"a0", _attach("a")], "trainer")  # on b, which has the most room
    f.on_message([b"c0", _attach("c")], "trainer")  # then beside the front
    assert f.jobs["a"].where == "b" and not isinstance(f.jobs["c"], RemoteProcs)
    gone = {"job": "a", "port": 6001, "pid": 4242, "exited": None, "report": _report("a", trainers_gone=True)}
    f.on_message([b"agent-b", _beat(memory_gb=1.2 * x / GB, jobs=[gone])], "worker")
    f.jobs["c"].rows = [{"name": "c", "held": True, "status": "detached"}]
    f.tick()
    assert f.jobs["a"].ended_why and f.jobs["c"].ended_why
    # 1.8x: no host holds it, even with its ended job gone; both hosts together do, once both are
    elements = int((1.8 * x - 2 * WORKER_FIXED_BYTES) / 20)  # 20 bytes an element: adam, no tier
    f.on_message([b"n0", _attach("n", elements=elements)], "trainer")
    env, msg, since = f.admitting["n"]
    f.admitting["n"] = (env, msg, since - 60)  # every job's next report awaited long enough
    f.tick()
    reason = f.out.last("waiting", b"n0")["reason"]
    assert "'a'" in reason and "'c'" in reason, reason
    f.tick()  # no tier: their memory is free at once
    assert "a" not in f.jobs and "c" not in f.jobs
    head, (part,) = f.jobs["n"], f.parts["n"]
    assert head.where == "b" and head.slots == (0,) and part.slots == (1,)
    assert f.out.kinds(b"n0")[-1] in ("waiting", "moved")
