"""Persistence with real processes: tiers written while training, everything killed,
restore from disk bit for bit; torn writes; corruption; unwritable tiers; exports."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import pairwise

import pytest
import torch

from shadow.testing import LocalCluster, ServiceFaults
from tests.conftest import ROOT, rank_logs, run_ranks
from tests.helpers.tiny_trainer import build
from tests.slow.test_integration import assert_same_state

pytestmark = pytest.mark.slow
STEPS = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run (no shadow) that dumps every rank's state after every iteration."""
    tmp = tmp_path_factory.mktemp("ref")
    assert run_ranks(tmp, "--out", str(tmp / "out"), "--steps", str(STEPS), "--dump-dir", str(tmp / "dump")) == [
        0,
        0,
    ], rank_logs(tmp)

    def at(it: int, rank: int) -> dict:
        return torch.load(tmp / "dump" / f"it{it}-rank{rank}.pt", weights_only=True)

    at.final = [torch.load(tmp / "out" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    return at


def shadow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shadow", *args], capture_output=True, text=True, cwd=ROOT, timeout=180
    )


def restored_state(source: str, **kw) -> tuple[dict, object]:
    import trainer_hooks

    model, opt, sched = build(seed=123)
    kw.setdefault("rank", 0)  # a 2-rank checkpoint, read by this one process: rank 0's part unless told
    info = trainer_hooks.restore(model, opt, source=source, scheduler=sched, **kw)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": torch.get_rng_state(),
    }, info


def test_kill_everything_then_restore_from_disk(tmp_path, reference):
    local, remote = tmp_path / "local", tmp_path / "remote"
    args = (
        f"persist.local.dir={local}",
        "persist.local.every_n=3",
        "persist.local.keep=2",
        f"persist.remote.url=file://{remote}",
        "persist.remote.every_n=3",
        "persist.remote.keep=0",
    )
    cluster = LocalCluster(tmp_path, args=args)
    try:
        codes = run_ranks(
            tmp_path,
            "--coordinator",
            cluster.address,
            "--out",
            str(tmp_path / "dead"),
            "--steps",
            str(STEPS),
            "--kill-at",
            "8",
        )
        assert codes == [-9, -9], rank_logs(tmp_path)
        st = cluster.wait_quiet()  # where the killed ranks left it
        st = cluster.wait_status(
            lambda st: not st["persist"]["local"]["in_flight"] and not st["persist"]["remote"]["in_flight"],
            what="the checkpoints in flight",
        )
        k = st["persist"]["local"]["last_complete"]["iteration"]  # 6 unless the kill outran the sender
        assert 3 <= k <= 8 and st["persist"]["remote"]["last_complete"]["iteration"] == k, st["persist"]
    finally:
        cluster.kill_all()
    # everything is dead: restore straight from the local directory, then from the remote copy
    for source, tier in ((str(local), "local"), (f"file://{remote}", "remote")):
        state, info = restored_state(source, rank=1)
        assert (info.iteration, info.tier) == (k, tier)
        assert_same_state(state, reference(k, 0))
        assert torch.equal(state["rng"], reference(k, 1)["rng"])
    res = shadow("ls", f"source={local}", "json=true")
    assert res.returncode == 0, res.stderr
    complete = sorted(r["iteration"] for r in json.loads(res.stdout) if r["state"] == "complete")
    assert complete[-1] == k and len(complete) <= 2  # keep=2
    assert shadow("verify", f"source={local}").returncode == 0

    # a restarted cluster with the same persist dir serves the restore before any trainer attaches,
    # and the resumed run ends where the uninterrupted one did
    cluster = LocalCluster(tmp_path, args=args)
    try:
        state, info = restored_state(cluster.address)
        assert (info.iteration, info.tier) == (k, "local")
        out = tmp_path / "resumed"
        assert run_ranks(
            tmp_path, "--mode", "resume", "--coordinator", cluster.address, "--out", str(out), "--steps", str(STEPS)
        ) == [0, 0], rank_logs(tmp_path)
        for r in range(2):
            resumed = torch.load(out / f"rank{r}.pt", weights_only=True)
            assert resumed["start"] == k
            assert_same_state(resumed, reference.final[r])
            assert resumed["losses"] == reference.final[r]["losses"][k:]
    finally:
        cluster.stop()


def test_worker_dying_mid_write_leaves_previous_checkpoint(tmp_path, reference):
    local = tmp_path / "local"
    cluster = LocalCluster(
        tmp_path,
        args=(f"persist.local.dir={local}", "persist.local.every_n=3", "max_restarts=0"),
        faults=ServiceFaults(persist_die_at=6),
    )
    try:
        assert run_ranks(tmp_path, "--coordinator", cluster.address, "--out", str(tmp_path / "o"), "--steps", "9") == [
            0,
            0,
        ], rank_logs(tmp_path)
    finally:
        cluster.kill_all()
    rows = json.loads(shadow("ls", f"source={local}", "json=true").stdout)
    complete = sorted(r["iteration"] for r in rows if r["state"] == "complete")
    torn = [r["iteration"] for r in rows if r["state"] == "incomplete"]
    # the dead writer's checkpoint never completes; its directory is torn, or removed once the
    # coordinator finds the writer lost (the checkpoint then fails and the other shard is deleted)
    assert complete and max(complete) < 6 and len(torn) <= 1 and all(t >= 6 for t in torn), rows
    state, info = restored_state(str(local))
    assert info.iteration == max(complete)
    assert_same_state(state, reference(info.iteration, 0))


def test_corrupt_shard_is_caught_and_older_checkpoint_used(tmp_path, reference):
    from shadow.persist import checkpoints

    local = tmp_path / "local"
    cluster = LocalCluster(
        tmp_path, args=(f"persist.local.dir={local}", "persist.local.every_n=2", "persist.local.keep=0")
    )
    try:
        assert run_ranks(tmp_path, "--coordinator", cluster.address, "--out", str(tmp_path / "o"), "--steps", "8") == [
            0,
            0,
        ], rank_logs(tmp_path)
        cluster.wait_status(
            lambda st: st["job"]["committed"] == 8 and not st["persist"]["local"]["in_flight"],
            what="iteration 8 committed and no checkpoint in flight",
        )
    finally:
        cluster.stop()
    done = checkpoints.list_checkpoints(str(local))
    assert len(done) >= 2
    newest, older = done[-1].iteration, done[-2].iteration
    shard = next((local / "default" / f"iteration-{newest:010d}").glob("shard-00001-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    res = shadow("verify", f"source={local}")
    assert res.returncode == 1 and f"iteration {newest}: CORRUPT" in res.stdout and "shard 1" in res.stdout
    assert f"iteration {older}: OK" in res.stdout
    state, info = restored_state(str(local))  # newest intact
    assert info.iteration == older
    assert_same_state(state, reference(older, 0))
    import trainer_hooks

    model, opt, sched = build(seed=5)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(trainer_hooks.ShadowError, match="shard 1 .*checksum"):
        trainer_hooks.restore(model, opt, source=str(local), iteration=newest)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    res = shadow("restore", f"source={local}", f"out={tmp_path / 'x.pt'}", f"iteration={newest}")
    assert res.returncode == 1 and "shard 1" in res.stderr


def test_unwritable_tier_is_reported_and_training_goes_on(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    cluster = LocalCluster(tmp_path, args=(f"persist.local.dir={blocker}", "persist.local.every_n=2"))
    try:
        assert run_ranks(tmp_path, "--coordinator", cluster.address, "--out", str(tmp_path / "o"), "--steps", "6") == [
            0,
            0,
        ], rank_logs(tmp_path)
        st = cluster.wait_status(
            lambda st: st["job"]["committed"] == 6 and st["persist"]["local"]["last_error"],
            what="iteration 6 committed and the tier's error reported",
        )
        assert st["job"]["committed"] == 6  # replay went on
        local = st["persist"]["local"]
        assert local["last_complete"] is None and "NotADirectoryError" in local["last_error"]
        assert "ERROR" in shadow("status", f"address={cluster.address}").stdout
    finally:
        cluster.stop()


def test_exports_load_with_standard_tools(tmp_path, shared_cluster, job):
    assert run_ranks(
        tmp_path, "--coordinator", shared_cluster.address, "--out", str(tmp_path / "o"), "--steps", "5", "--job", job
    ) == [
        0,
        0,
    ], rank_logs(tmp_path)
    trained = torch.load(tmp_path / "o" / "rank0.pt", weights_only=True)
    # DCP: load into the state dicts torch.distributed.checkpoint.state_dict produces
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dcp_out = tmp_path / "dcp"
    assert (
        shadow("restore", f"source={shared_cluster.address}", f"job={job}", f"out={dcp_out}", "format=dcp").returncode
        == 0
    )
    model, opt, _ = build(seed=77)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for k, v in trained["model"].items():
        assert torch.equal(model.state_dict()[k], v), k
    for i, st in trained["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(opt.state_dict()["state"][i][k], v), (i, k)
    # safetensors: the model weights
    from safetensors.torch import load_file

    assert (
        shadow(
            "restore",
            f"source={shared_cluster.address}",
            f"job={job}",
            f"out={tmp_path / 'w.safetensors'}",
            "format=safetensors",
        ).returncode
        == 0
    )
    weights = load_file(tmp_path / "w.safetensors")
    assert weights.keys() == trained["model"].keys()
    assert all(torch.equal(weights[k], trained["model"][k]) for k in weights)
    res = shadow("restore", f"source={shared_cluster.address}", "out=/tmp/x", "format=onnx")
    assert res.returncode == 2 and "torch" in res.stderr


def test_token_schedule(tmp_path):
    local = tmp_path / "local"
    # the tiny trainer reports 48 tokens per rank per iteration: 96 per iteration on 2 ranks
    cluster = LocalCluster(
        tmp_path,
        args=(
            f"persist.local.dir={local}",
            "persist.local.every_n=0",
            "persist.local.every_tokens=192",
            "persist.local.keep=0",
        ),
    )
    try:
        assert run_ranks(tmp_path, "--coordinator", cluster.address, "--out", str(tmp_path / "o"), "--steps", "6") == [
            0,
            0,
        ], rank_logs(tmp_path)
        cluster.wait_status(
            lambda st: st["job"]["committed"] == 6 and not st["persist"]["local"]["in_flight"],
            what="iteration 6 committed and no checkpoint in flight",
        )
    finally:
        cluster.stop()
    from shadow.persist import checkpoints

    done = checkpoints.list_checkpoints(str(local))
    tokens = [c.manifest["tokens"] for c in done]
    assert [c.iteration * 96 for c in done] == tokens  # the trainer's count, recorded per checkpoint
    assert len(done) >= 2 and tokens[0] == 192  # the first at the first threshold
    assert all(b - a >= 192 for a, b in pairwise(tokens))


def test_a_new_job_keeps_the_ended_jobs_last_iteration_on_the_tier(world1, tmp_path):
    """A job ends between two of its tier's checkpoints (every 100 iterations) and another
    job attaches: before the memory is reused, the ended job's last iteration is written to
    the local tier, and a relaunch of it restores that iteration bit for bit."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_hooks
    from shadow.persist import checkpoints
    from tests.helpers.loop import train_step

    local = tmp_path / "local"
    cluster = LocalCluster(tmp_path, args=(f"persist.local.dir={local}", "persist.local.every_n=100"))
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        first = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="first")
        for it in range(1, 6):
            train_step(ddp, opt, sched, it)
        trained = [p.detach().clone() for p in model.parameters()]
        assert first.close() == 5
        assert 5 not in [c.iteration for c in checkpoints.list_checkpoints(str(local), job="first")]
        other, oopt, osched = build(seed=2)
        oddp = DDP(other)
        second = trainer_hooks.attach(oddp, oopt, coordinator=cluster.address, scheduler=osched, job="second")
        assert 5 in [c.iteration for c in checkpoints.list_checkpoints(str(local), job="first")]
        train_step(oddp, oopt, osched, 1)
        assert second.close() == 1
        back, bopt, bsched = build(seed=3)
        info = trainer_hooks.restore(back, bopt, source=cluster.address, scheduler=bsched, job="first")
        assert info.iteration == 5 and info.tier == "local"
        for a, b in zip(trained, back.parameters(), strict=True):
            assert torch.equal(a, b)
    finally:
        cluster.stop()


def test_a_crashed_job_blocks_no_other_job_and_keeps_its_last_iteration(tmp_path, reference):
    """Both ranks SIGKILLed: the job never detaches. Once its ranks are silent past the
    liveness window, another job name attaches without ``overwrite`` and without ``shadow
    drop``; the crashed job's last committed iteration is written to the local tier first
    (its schedule, every 100 iterations, took none), and restores bit for bit from there."""
    local = tmp_path / "local"
    cluster = LocalCluster(tmp_path, args=(f"persist.local.dir={local}", "persist.local.every_n=100"))
    try:
        codes = run_ranks(
            tmp_path, "--coordinator", cluster.address, "--out", str(tmp_path / "dead"), "--steps", str(STEPS),
            "--kill-at", "8", "--job", "crashed",
        )  # fmt: skip
        assert codes == [-9, -9], rank_logs(tmp_path)
        k = cluster.wait_quiet()["job"]["committed"]
        assert 4 <= k <= 8
        out = tmp_path / "next"
        assert run_ranks(
            tmp_path, "--coordinator", cluster.address, "--out", str(out), "--steps", "3", "--job", "next"
        ) == [0, 0], rank_logs(tmp_path)
        logs = rank_logs(tmp_path)
        assert "took the cluster's memory over from job 'crashed'" in logs, logs
        state, info = restored_state(cluster.address, job="crashed")
        assert (info.iteration, info.tier) == (k, "local")
        assert_same_state(state, reference(k, 0))
    finally:
        cluster.stop()
