"""A shared cluster (``shadow cluster shared=true``): several jobs at once behind one address,
each with a coordinator and workers of its own.

- Two jobs stream at once from one process, and each restores from memory bit for bit; a
  third that does not fit is refused at its attach with the figures.
- Three jobs at once (DDP, FSDP2, and DDP with trainer keys limited to it), each SIGKILLed
  at another iteration and brought back while the others train on, end bit for bit where
  an uninterrupted run ends; the scoped key reaches its own job only."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow import security
from shadow.core.errors import ShadowError
from shadow.testing import LocalCluster, assert_same_state, free_port, status
from tests.helpers.cli import shadow_cli
from tests.helpers.keys import role_keys
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build
from tests.slow import test_fsdp as fsdp
from tests.slow.test_recovery import CLIP, STEPS, _torchrun

pytestmark = pytest.mark.slow


def _same(model, params) -> None:
    for a, b in zip(params, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_two_jobs_train_at_once_and_each_restores_exactly(world1, tmp_path):
    metrics = free_port()
    # room for two jobs of 2 workers (0.5 GB each with their processes)
    args = ("shared=true", "memory_gb=1.2", f"metrics_port={metrics}")
    with LocalCluster(tmp_path, args=args) as cluster:
        jobs = {}
        for name, seed in (("alpha", 1), ("beta", 2)):
            model, opt, sched = build(seed=seed)
            ddp = DDP(model)
            session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job=name)
            jobs[name] = (model, ddp, opt, sched, session, {})
        for it in range(1, 5):  # interleaved: both jobs stream at once
            for model, ddp, opt, sched, _, states in jobs.values():
                train_step(ddp, opt, sched, it)
                states[it] = [p.detach().clone() for p in model.parameters()]
        st = status(cluster.address)
        assert sorted(j["name"] for j in st["jobs"]) == ["alpha", "beta"], st
        addresses = {j["address"] for j in st["jobs"]}
        assert len(addresses) == 2 and cluster.address not in addresses
        assert st["front"]["used_bytes"] == sum(j["memory_bytes"] for j in st["jobs"])

        out = shadow_cli("status", f"address={cluster.address}")
        assert out.returncode == 0 and "shared shadow cluster" in out.stdout, out
        assert "job alpha" in out.stdout and "job beta" in out.stdout and "2/2 workers ready" in out.stdout, out.stdout
        out = shadow_cli("status", f"address={cluster.address}", "job=beta")  # that job's cluster alone
        assert out.returncode == 0 and "shared" not in out.stdout and "2/2 workers ready" in out.stdout, out
        out = shadow_cli("jobs", f"address={cluster.address}")
        assert out.returncode == 0 and "alpha" in out.stdout and "beta" in out.stdout, out
        out = shadow_cli("ls", f"source={cluster.address}", "job=alpha")  # through the front to alpha's coordinator
        assert out.returncode == 0 and "alpha" in out.stdout and "memory" in out.stdout, out
        out = shadow_cli("ls", f"source={cluster.address}", "--json")  # every job, each from its own coordinator
        assert out.returncode == 0, out
        rows = json.loads(out.stdout)
        assert sorted((r["job"], r["tier"]) for r in rows) == [("alpha", "memory"), ("beta", "memory")], rows
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=30).read().decode()
        for name in ("alpha", "beta"):  # each job's coordinator metrics, labelled with its job
            assert f'shadow_workers_expected{{shadow_job="{name}"}} 2.0' in scrape, scrape[:2000]

        third, topt, _ = build(seed=3)  # no room for a third: refused at its attach, with the figures
        with pytest.raises(trainer_hooks.ShadowConnectionError, match=r"attach of job 'gamma' refused: it needs \d"):
            trainer_hooks.attach(DDP(third), topt, coordinator=cluster.address, job="gamma")

        for name, (*_, session, states) in jobs.items():
            assert session.close() == 4
            back, bopt, bsched = build(seed=9)
            info = trainer_hooks.restore(back, bopt, source=cluster.address, scheduler=bsched, job=name)
            assert info.iteration == 4 and info.tier == "memory", info
            _same(back, states[4])


def test_three_jobs_killed_and_restarted_at_once_end_exactly_and_a_scoped_key_reaches_its_job_only(
    world1, tmp_path, monkeypatch
):
    """A DDP job, an FSDP2 job and a DDP job whose trainer key is limited to it, at once on
    one shared cluster; each is SIGKILLed at another iteration and comes back (the DDP ones
    by torchrun's restart with resume='auto', the FSDP2 one restored by fresh ranks) while
    the others train on, and each ends where its uninterrupted run ends, bit for bit."""
    ref = tmp_path / "reference"
    ref.mkdir()
    code, text = _torchrun(ref, "--out", str(ref / "out"), "--steps", str(STEPS), *CLIP)
    assert code == 0, text
    reference = [torch.load(ref / "out" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    fsdp_out = str(tmp_path / "fsdp")
    fsdp._spawn(fsdp._uninterrupted, 2, free_port(), f"{fsdp_out}.uninterrupted", "fused")

    keys = role_keys(tmp_path / "keys", scoped={"c_trainer": ("trainer", "team-c"), "c_client": ("client", "team-c")})
    root = tmp_path / "keys"
    args = (*keys["args"], "shared=true", "workers=1")
    cluster = LocalCluster(tmp_path, workers=1, args=args, keys=keys["admin"], env={"SHADOW_WORKER_LOST_S": "3"})
    trainer_key = {
        "SHADOW_CURVE_SERVER_KEY": str(root / "server.key"),
        "SHADOW_CONNECT_TIMEOUT_S": "300",  # three jobs' workers start at once on a small machine
    }
    envs = {
        "team-a": {**trainer_key, "SHADOW_CURVE_CLIENT_KEY": str(root / "trainers" / "trainer.key_secret")},
        "team-c": {
            **trainer_key,
            "SHADOW_CURVE_CLIENT_KEY": str(root / "trainers" / "team-c" / "c_trainer.key_secret"),
        },
    }
    for k, v in envs["team-a"].items():  # the FSDP2 ranks (spawned from here): the unscoped trainer key
        monkeypatch.setenv(k, v)
    kills = {"team-a": "0:4:all", "team-c": "0:6:0"}  # at other iterations, other ranks
    results: dict[str, object] = {}

    def launch(job: str) -> None:
        run = tmp_path / job
        run.mkdir()
        results[job] = _torchrun(
            run,
            *("--mode", "auto", "--coordinator", cluster.address, "--out", str(run / "out")),
            *("--steps", str(STEPS), *CLIP, "--job", job, "--kill-in-round", kills[job]),
            restarts=4,
            env=envs[job],
        )

    def fsdp_job() -> None:
        try:
            fsdp._spawn(fsdp._trained, 2, free_port(), cluster.address, fsdp_out, "fused", killed=True)
            fsdp._spawn(fsdp._resumed, 2, free_port(), cluster.address, fsdp_out, "fused")
            results["fsdp"] = "done"
        except BaseException as exc:
            results["fsdp"] = exc

    try:
        threads = [threading.Thread(target=launch, args=(job,)) for job in envs]
        threads.append(threading.Thread(target=fsdp_job))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for job in envs:
            code, text = results[job]
            assert code == 0, f"{job}:\n{text}"
            for r in range(2):
                final = torch.load(tmp_path / job / "out" / f"rank{r}.pt", weights_only=True)
                assert final["round"] >= 1, (job, final["round"])  # killed once at least, restarted by torchrun
                assert_same_state(final, reference[r])
                assert final["losses"] == reference[r]["losses"][final["start"] :]
                assert final["committed"] == STEPS, (job, final["committed"])
        assert results["fsdp"] == "done", results["fsdp"]
        restored = torch.load(f"{fsdp_out}.restored")
        assert 1 <= restored["iteration"] <= fsdp.STEPS_BEFORE_KILL
        fsdp._equal(restored["state"], torch.load(f"{fsdp_out}.{restored['iteration']}"), "fsdp restored")
        resumed = torch.load(f"{fsdp_out}.resumed")
        assert resumed["committed"] == fsdp.STEPS
        fsdp._equal(resumed["state"], torch.load(f"{fsdp_out}.uninterrupted"), "the fsdp job's end")
        st = status(cluster.address, keys=keys["admin"])
        assert sorted(j["name"] for j in st["jobs"]) == ["fsdp", "team-a", "team-c"], st

        scoped = keys["c_client"]  # team-c's client key: its job only
        assert [j["name"] for j in status(cluster.address, keys=scoped)["jobs"]] == ["team-c"]
        security.set_client(scoped)
        fresh, fopt, fsched = build(seed=3)
        with pytest.raises(ShadowError, match="limited to jobs team-c: it may not restore job 'team-a'"):
            trainer_hooks.restore(fresh, fopt, source=cluster.address, scheduler=fsched, job="team-a", rank=0)
        info = trainer_hooks.restore(fresh, fopt, source=cluster.address, scheduler=fsched, job="team-c", rank=0)
        assert info.iteration == STEPS and info.tier == "memory", info
        security.set_client(keys["c_trainer"])
        with pytest.raises(ShadowError, match="limited to jobs team-c: it may not attach to job 'fsdp'"):
            other, oopt, _ = build(seed=5)
            trainer_hooks.attach(DDP(other), oopt, coordinator=cluster.address, job="fsdp")
    finally:
        security.reset_client()
        cluster.stop()


def test_an_ended_jobs_memory_goes_to_the_next_job_after_its_last_iteration_is_written(world1, tmp_path):
    """Room for one job: job a detaches; job b's attach waits while a's last iteration (off the
    tier's schedule) is written to the local tier, then takes a's memory; a restores from
    the tier through the cluster's address, bit for bit at its last iteration."""
    local = tmp_path / "local"
    args = ("shared=true", "memory_gb=0.8", f"persist.local.dir={local}", "persist.local.every_n=100")
    with LocalCluster(tmp_path, args=args) as cluster:
        model, opt, sched = build(seed=1)
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="a")
        for it in range(1, 4):
            train_step(ddp, opt, sched, it)
        last = [p.detach().clone() for p in model.parameters()]
        assert session.close() == 3

        other, oopt, osched = build(seed=2)
        oddp = DDP(other)
        session = trainer_hooks.attach(oddp, oopt, coordinator=cluster.address, scheduler=osched, job="b")
        train_step(oddp, oopt, osched, 1)
        assert [j["name"] for j in status(cluster.address)["jobs"]] == ["b"]
        assert "asking ended job 'a' for its memory" in cluster.log.read_text()

        back, bopt, bsched = build(seed=9)
        info = trainer_hooks.restore(back, bopt, source=cluster.address, scheduler=bsched, job="a")
        assert info.iteration == 3 and info.tier == "local", info
        _same(back, last)
        assert session.close() == 1
