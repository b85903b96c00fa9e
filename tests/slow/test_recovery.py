"""Recovery without a person (issue 52): the same command line serves the first launch and
every relaunch, torchrun's elastic restarts bring a killed job back by itself, a second
launch never takes over a live job, and a changed world size is refused on every rank.

Each run is the tiny trainer (tests/helpers/tiny_trainer.py) on gloo ranks, against a
cluster of its own; the final states are compared with ``torch.equal`` against an
uninterrupted run without the shadow."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from shadow.testing import LocalCluster, assert_same_state
from tests.conftest import ROOT, TRAINER, rank_logs, run_ranks

pytestmark = pytest.mark.slow
STEPS = 12
CLIP = ("--clip", "0.05")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, without any shadow attached."""
    tmp = tmp_path_factory.mktemp("reference")
    assert run_ranks(tmp, "--out", str(tmp / "out"), "--steps", str(STEPS), *CLIP) == [0, 0], rank_logs(tmp)
    return [torch.load(tmp / "out" / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _log(tmp: Path, rank: int) -> str:
    return "".join(p.read_text() for p in sorted(tmp.glob(f"rank{rank}-*.log")))


def _torchrun(tmp: Path, *args: str, restarts: int = 0, env: dict | None = None) -> tuple[int, str]:
    """The tiny trainer under ``torchrun --standalone`` on 2 ranks with ``restarts`` elastic
    restarts: its exit code, and its log with each rank's of every round. ``env``: more
    environment for the ranks."""
    log = tmp / "torchrun.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={restarts}",
        "--monitor-interval=0.2",
        f"--log-dir={tmp / 'ranks'}",
        "--redirects=3",
        str(TRAINER),
        *args,
    ]
    with open(log, "w") as f:
        proc = subprocess.run(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=600, env={**_env(), **(env or {})}, check=False
        )
    ranks = "".join(f"--- {p}\n{p.read_text()[-4000:]}" for p in sorted((tmp / "ranks").rglob("*.log")))
    return proc.returncode, log.read_text()[-10000:] + ranks


def test_torchrun_elastic_restarts_bring_a_twice_killed_job_back_by_itself(tmp_path, job):
    """torchrun --max-restarts with resume='auto': round 0 loses rank 1 at iteration 5,
    round 1 loses every rank of the node at iteration 9; round 2 finishes. Nobody relaunches
    anything, and the final state is the uninterrupted run's (the same launcher, no
    shadow, no failure), bit for bit."""
    ref_tmp, run_tmp = tmp_path / "reference", tmp_path / "run"
    ref_tmp.mkdir()
    run_tmp.mkdir()
    code, text = _torchrun(ref_tmp, "--out", str(ref_tmp / "out"), "--steps", str(STEPS), *CLIP)
    assert code == 0, text
    reference = [torch.load(ref_tmp / "out" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    cluster = LocalCluster(tmp_path, workers=2)
    out = run_tmp / "out"
    try:
        code, text = _torchrun(
            run_tmp,
            "--mode",
            "auto",
            "--coordinator",
            cluster.address,
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            *CLIP,
            "--job",
            job,
            "--kill-in-round",
            "0:5:1,1:9:all",
            restarts=4,  # a round that fails to rendezvous (gloo under load) costs one more
        )
        assert code == 0, text
        finals = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
        for r in range(2):
            assert finals[r]["round"] >= 2, finals[r]["round"]  # two failures at least: restarted, by nobody
            assert 5 <= finals[r]["start"] <= 9, finals[r]["start"]  # resumed from what round 1 left
            assert_same_state(finals[r], reference[r])
            assert torch.equal(finals[r]["rng"], reference[r]["rng"])
            assert finals[r]["losses"] == reference[r]["losses"][finals[r]["start"] :]
            assert finals[r]["committed"] == STEPS and finals[r]["stats"]["unprotected_steps_total"] == 0
        # each later round took over the job at once, never held until the earlier round's ranks
        # fell silent: as the same launch's next round while they were still heard, or, when its
        # start took longer than SHADOW_WORKER_LOST_S (a loaded machine), from ranks already silent
        events = cluster.log.read_text()
        assert re.search(r"attach of job \S+ held: ", events) is None, events[-5000:]
        takeovers = events.count("takes over from round") + events.count("took over job")
        assert takeovers >= 2, events[-5000:]
    finally:
        cluster.stop()


def _env() -> dict:
    import os

    # torchrun's rendezvous store shared with the ranks' process group hands a restarted
    # round the previous round's gloo addresses now and then (pytorch/pytorch#135712):
    # deploy/torchrun.sh sets this too
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def test_a_second_launch_is_refused_while_the_first_trains_and_the_first_stays_protected(tmp_path, job):
    cluster = LocalCluster(tmp_path, workers=2)
    first_tmp, second_tmp = tmp_path / "first", tmp_path / "second"
    first_tmp.mkdir()
    second_tmp.mkdir()
    # the first run steps every 2 s for 40 s: the second launch's restore from its live memory
    # (retried when a new cut lands during the fetch) succeeds, and the first run is still
    # training when the second gives up
    steps = 20
    result: dict = {}

    def first() -> None:
        result["codes"] = run_ranks(
            first_tmp,
            "--mode",
            "auto",
            "--coordinator",
            cluster.address,
            "--out",
            str(first_tmp / "out"),
            "--steps",
            str(steps),
            "--step-sleep",
            "2.0",
            "--job",
            job,
            timeout=400,
        )

    try:
        t = threading.Thread(target=first)
        t.start()
        cluster.wait_status(
            lambda st: ((st.get("job") or {}).get("committed") or 0) >= 3, 300, "the first run's iteration 3"
        )
        # the same command line again (a double submission, a requeue race): it restores the
        # live job's iteration, and its attach is held, then refused, naming the live owner (at
        # once when its ranks restored different iterations, as the live job moved on between
        # their restores: the message names the live owner then too)
        codes = run_ranks(
            second_tmp,
            "--mode",
            "auto",
            "--coordinator",
            cluster.address,
            "--out",
            str(second_tmp / "out"),
            "--steps",
            str(steps),
            "--job",
            job,
            env={"SHADOW_CONNECT_TIMEOUT_S": "6"},
        )
        assert all(c != 0 for c in codes), (codes, rank_logs(second_tmp))
        for r in range(2):
            text = _log(second_tmp, r)
            assert "is owned by a live run" in text and "overwrite=True neither" in text, text[-3000:]
        t.join(timeout=400)
        assert result.get("codes") == [0, 0], rank_logs(first_tmp)
        for r in range(2):
            final = torch.load(first_tmp / "out" / f"rank{r}.pt", weights_only=True)
            assert final["committed"] == steps and final["epochs"] == 1  # never replaced, never resynced
            assert final["stats"]["degraded"] is None and final["stats"]["unprotected_steps_total"] == 0
            assert "degraded" not in _log(first_tmp, r)
        time.sleep(1.0)  # the withdrawn attach must not start once the first run detached
        st = cluster.status()
        assert st["job"]["name"] == job and st["job"]["committed"] == steps and st["job"]["epoch"] == 1
    finally:
        cluster.stop()


def test_a_changed_world_size_is_refused_on_every_rank_unless_asked(tmp_path, job):
    cluster = LocalCluster(tmp_path, workers=2)
    try:
        trained = tmp_path / "trained"
        trained.mkdir()
        common = ("--coordinator", cluster.address, "--steps", "10", "--job", job)
        assert run_ranks(trained, *common, "--out", str(trained / "out"), "--kill-at", "6") == [-9, -9], rank_logs(
            trained
        )
        held = cluster.wait_quiet()["job"]["committed"]
        for world in (1, 3):
            tmp = tmp_path / f"world{world}"
            tmp.mkdir()
            codes = run_ranks(tmp, "--mode", "auto", *common, "--out", str(tmp / "out"), world=world)
            assert all(c != 0 for c in codes), (world, codes, rank_logs(tmp))
            for r in range(world):  # every rank refuses, naming both sizes
                text = _log(tmp, r)
                assert f"was taken with 2 ranks, and this run has {world}" in text, (world, r, text[-3000:])
                assert "resize=True" in text
            assert cluster.status()["job"]["committed"] == held  # nothing changed
        tmp = tmp_path / "resized"
        tmp.mkdir()
        assert run_ranks(tmp, "--mode", "auto", "--resize", *common, "--out", str(tmp / "out"), world=1) == [0], (
            rank_logs(tmp)
        )
        final = torch.load(tmp / "out" / "rank0.pt", weights_only=True)
        assert final["start"] == held and final["committed"] == 10
        assert "restoring a 2-rank checkpoint onto 1 ranks (resize=True)" in _log(tmp, 0)
    finally:
        cluster.stop()


def test_a_default_cluster_keeps_its_checkpoints_on_disk_and_resumes_after_a_restart(tmp_path, job):
    """Durable by default: a cluster started with no persistence settings writes a local
    tier in the user's data directory (here under tmp, XDG_DATA_HOME) and says where; the
    whole cluster restarted, the same command line resumes the job from that tier."""
    data = tmp_path / "data"
    schedule = ("persist.local.every_s=1",)  # the default tier's place, a test-sized schedule
    cluster = LocalCluster(tmp_path, workers=2, durable=True, args=schedule)
    port = cluster.port
    first = tmp_path / "first"
    first.mkdir()
    try:
        common = ("--coordinator", cluster.address, "--job", job, "--steps", "12")
        codes = run_ranks(first, "--mode", "auto", *common, "--out", str(first / "out"), "--kill-at", "8")
        assert codes == [-9, -9], rank_logs(first)
        st = cluster.wait_status(
            lambda s: (s.get("restorable") or {}).get("local") is not None, 120, "a local checkpoint"
        )
        root = st["persist"]["local"]["root"]
        assert root == str(data / "shadow" / f"cluster-{port}"), root
        on_disk = st["restorable"]["local"]
        text = cluster.log.read_text()
        assert "no persistence tier configured: checkpoints are kept in " + root in text
        assert "persist.durable=false" in text
    finally:
        cluster.kill_all()
    cluster = LocalCluster(tmp_path, workers=2, durable=True, args=schedule, port=port)
    again = tmp_path / "again"
    again.mkdir()
    try:
        assert cluster.status()["persist"]["local"]["root"] == root
        codes = run_ranks(again, "--mode", "auto", *common, "--out", str(again / "out"))
        assert codes == [0, 0], rank_logs(again)
        for r in range(2):
            final = torch.load(again / "out" / f"rank{r}.pt", weights_only=True)
            assert final["start"] == on_disk and final["committed"] == 12
    finally:
        cluster.stop()
