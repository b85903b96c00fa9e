"""A shared cluster over two hosts: a front, and a ``shadow agent`` serving it (here both on
this machine, the agent's jobs on its own ports). A job that does not fit beside the front
goes to the agent: its ranks are sent on there, it trains, and it restores from the agent's
memory bit for bit through the front's address; stopping the agent stops its jobs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

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


def test_a_job_placed_on_an_agent_trains_there_and_restores_exactly_through_the_front(world1, tmp_path):
    # nothing fits beside the front: every job goes to the agent
    with LocalCluster(tmp_path, args=("shared=true", "memory_gb=0.05")) as cluster:
        log = open(tmp_path / "agent.log", "w")
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shadow",
                "agent",
                f"front={cluster.address}",
                "name=cpu-b",
                "memory_gb=1.2",
                "threads_per_worker=1",
                "persist.durable=false",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, XDG_DATA_HOME=str(tmp_path / "data")),
        )
        try:

            def joined():
                if agent.poll() is not None:
                    text = (tmp_path / "agent.log").read_text()
                    raise RuntimeError(f"shadow agent exited ({agent.returncode}): {text}")
                return any(a["name"] == "cpu-b" and a["alive"] for a in cluster.status()["front"]["agents"])

            wait_progressing(joined, lambda: (tmp_path / "agent.log").stat().st_size, 60, 300, "the agent to join")
            model, opt, sched = build(seed=1)
            ddp = DDP(model)
            session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="alpha")
            states = {}
            for it in range(1, 5):
                train_step(ddp, opt, sched, it)
                states[it] = [p.detach().clone() for p in model.parameters()]

            def reported(st: dict) -> bool:  # the job's coordinator reports every second, through the agent
                return any(((j["status"] or {}).get("job") or {}).get("committed") == 4 for j in st["jobs"])

            st = cluster.wait_progress(reported, "job alpha's iteration 4 reported through the agent")
            (job,) = st["jobs"]
            assert job["name"] == "alpha" and job["host"] == "cpu-b" and job["address"] != cluster.address, st
            (host,) = st["front"]["agents"]
            assert host["jobs"] == ["alpha"] and host["used_bytes"] == job["memory_bytes"], host
            out = shadow_cli("status", f"address={cluster.address}")
            assert out.returncode == 0 and "cpu-b" in out.stdout and "job alpha" in out.stdout, out

            assert session.close() == 4
            back, bopt, bsched = build(seed=9)
            info = trainer_hooks.restore(back, bopt, source=cluster.address, scheduler=bsched, job="alpha")
            assert info.iteration == 4 and info.tier == "memory", info
            _same(back, states[4])
            # an agent killed outright takes its jobs down with it (no process left holding memory)
            agent.kill()
            agent.wait()
            wait_until(lambda: not pid_alive(job["pid"]), 120, f"job alpha's cluster (pid {job['pid']}) to stop")
        finally:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
                agent.wait(timeout=60)
            log.close()
