"""A shared cluster over two hosts: a front, and a ``shadow agent`` serving it (here both on
this machine, the agent's jobs on its own ports). A job that does not fit beside the front
goes to the agent: its ranks are sent on there, it trains, and it restores from the agent's
memory bit for bit through the front's address; stopping the agent stops its jobs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.testing import LocalCluster
from shadow.testing.cluster import pid_alive
from shadow.testing.wait import wait_progressing, wait_until
from tests.helpers.cli import shadow_cli
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build
from tests.slow.test_shared_cluster import _same

pytestmark = pytest.mark.slow


def _agent(cluster: LocalCluster, tmp_path, *args: str, log_name: str = "agent.log"):
    """A ``shadow agent`` named cpu-b serving ``cluster``'s front, once the front lists it;
    (its process, its open log)."""
    path = tmp_path / log_name
    log = open(path, "w")
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shadow",
            "agent",
            f"front={cluster.address}",
            "name=cpu-b",
            "threads_per_worker=1",
            "persist.durable=false",
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, XDG_DATA_HOME=str(tmp_path / "data")),
    )

    def joined():
        if agent.poll() is not None:
            raise RuntimeError(f"shadow agent exited ({agent.returncode}): {path.read_text()}")
        return any(a["name"] == "cpu-b" and a["alive"] for a in cluster.status()["front"]["agents"])

    try:
        wait_progressing(joined, lambda: path.stat().st_size, 60, 300, "the agent to join")
    except BaseException:
        _stop(agent, log)
        raise
    return agent, log


def _committed(n: int):
    """A front's status shows a job whose coordinator reported iteration ``n`` committed."""

    def check(st: dict) -> bool:
        return any(((j["status"] or {}).get("job") or {}).get("committed") == n for j in st["jobs"])

    return check


def _train(ddp, opt, sched, states: dict, iterations) -> None:
    """Train ``iterations``, keeping each one's parameters in ``states``."""
    for it in iterations:
        train_step(ddp, opt, sched, it)
        states[it] = [p.detach().clone() for p in ddp.module.parameters()]


def _restores_exactly(cluster: LocalCluster, job: str, iteration: int, states: dict, seed: int) -> None:
    """A fresh model restored through the front is the trainer's state at ``iteration``, from memory."""
    back, bopt, bsched = build(seed=seed)
    info = trainer_hooks.restore(back, bopt, source=cluster.address, scheduler=bsched, job=job)
    assert info.iteration == iteration and info.tier == "memory", info
    _same(back, states[iteration])


def _stop(agent: subprocess.Popen, log) -> None:
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
    log.close()


def test_a_job_placed_on_an_agent_trains_there_and_restores_exactly_through_the_front(world1, tmp_path):
    # nothing fits beside the front: every job goes to the agent
    with LocalCluster(tmp_path, args=("shared=true", "memory_gb=0.05")) as cluster:
        agent, log = _agent(cluster, tmp_path, "memory_gb=1.2")
        try:
            model, opt, sched = build(seed=1)
            ddp = DDP(model)
            session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="alpha")
            states: dict = {}
            _train(ddp, opt, sched, states, range(1, 5))
            # the job's coordinator reports every second, through the agent
            st = cluster.wait_progress(_committed(4), "job alpha's iteration 4 reported through the agent")
            (job,) = st["jobs"]
            assert job["name"] == "alpha" and job["host"] == "cpu-b" and job["address"] != cluster.address, st
            (host,) = st["front"]["agents"]
            assert host["jobs"] == ["alpha"] and host["used_bytes"] == job["memory_bytes"], host
            out = shadow_cli("status", f"address={cluster.address}")
            assert out.returncode == 0 and "cpu-b" in out.stdout and "job alpha" in out.stdout, out

            assert session.close() == 4
            _restores_exactly(cluster, "alpha", 4, states, seed=9)
            # an agent killed outright takes its jobs down with it (no process left holding memory)
            agent.kill()
            agent.wait()
            wait_until(lambda: not pid_alive(job["pid"]), 120, f"job alpha's cluster (pid {job['pid']}) to stop")
        finally:
            _stop(agent, log)


def test_a_job_no_host_holds_alone_is_spread_over_two_and_restores_exactly(world1, tmp_path):
    """Each host has room for one of the job's two workers (each holds 0.25 GB beyond its
    shard): the coordinator and worker 0 run beside the front, worker 1 on the agent's host.
    The job trains and restores from both hosts' memory bit for bit. Its worker on the agent
    stops with the agent, and a new agent of that name starts it again: it rejoins."""
    with LocalCluster(tmp_path, args=("shared=true", "memory_gb=0.3")) as cluster:
        agent, log = _agent(cluster, tmp_path, "memory_gb=0.29")
        try:
            model, opt, sched = build(seed=2)
            ddp = DDP(model)
            session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="wide")
            states: dict = {}
            _train(ddp, opt, sched, states, range(1, 5))
            st = cluster.wait_progress(_committed(4), "job wide's iteration 4 reported")
            (job,) = st["jobs"]
            assert job["host"] == "" and [(p["host"], p["slots"]) for p in job["parts"]] == [("", [0]), ("cpu-b", [1])]
            (host,) = st["front"]["agents"]
            assert host["jobs"] == ["wide"] and 0 < host["used_bytes"] < job["memory_bytes"], (host, job)
            workers = job["status"]["workers"]
            assert len(workers) == 2 and all(w["ready"] for w in workers), workers
            out = shadow_cli("status", f"address={cluster.address}")
            assert out.returncode == 0 and "workers 0 on the front, 1 on cpu-b" in out.stdout, out.stdout

            _restores_exactly(cluster, "wide", 4, states, seed=9)

            # the agent killed outright: its part of the job stops with it
            part_pid = job["parts"][1]["pid"]
            agent.kill()
            agent.wait()
            wait_until(lambda: not pid_alive(part_pid), 120, f"job wide's workers on cpu-b (pid {part_pid}) to stop")
            log.close()
            # a new agent of that name is told to run the part again; worker 1 rejoins and the job trains on
            agent, log = _agent(cluster, tmp_path, "memory_gb=0.29", log_name="agent-2.log")

            lost = {w["pid"] for w in workers if w["id"] == 1}  # the agent's worker (slot 1)

            def whole(st: dict) -> bool:  # worker 1 ready again, a new process (the old one's row can linger)
                rows = [w for j in st["jobs"] for w in ((j["status"] or {}).get("workers") or [])]
                return len(rows) == 2 and all(w["ready"] and w["pid"] not in lost for w in rows)

            cluster.wait_progress(whole, "worker 1 back on the new agent")

            def epoch() -> int:
                return max(((j["status"] or {}).get("job") or {}).get("epoch") or 0 for j in cluster.status()["jobs"])

            # the trainer resyncs at a step boundary once it hears the cluster is whole: a new epoch
            it = 4
            while epoch() < 2:
                it += 1
                assert it < 1000, f"no resync after {it - 4} steps: {cluster.status()}"
                _train(ddp, opt, sched, states, [it])
                time.sleep(0.1)
            last = it + 4
            _train(ddp, opt, sched, states, range(it + 1, last + 1))
            cluster.wait_progress(_committed(last), f"job wide's iteration {last} reported")
            assert session.close() == last
            _restores_exactly(cluster, "wide", last, states, seed=11)
        finally:
            _stop(agent, log)
