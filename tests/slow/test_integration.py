"""Real processes: a local shadow cluster (coordinator + 2 workers), 2-rank gloo DDP
trainers, SIGKILL, restore in a fresh process group; bit-exact comparisons."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from shadow.testing import assert_same_state
from tests.conftest import ROOT, rank_logs, run_ranks
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow
STEPS = 12
CLIP = ("--clip", "0.05")  # small enough to clip every step: torch's clip (reference) vs session.clip_grad_norm_


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, without any shadow attached."""
    tmp = tmp_path_factory.mktemp("reference")
    assert run_ranks(tmp, "--out", str(tmp / "out"), "--steps", str(STEPS), *CLIP) == [0, 0], rank_logs(tmp)
    return [torch.load(tmp / "out" / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_attached_run_matches_plain_run_and_restores_exactly(transport_cluster, job, reference, tmp_path):
    out = tmp_path / "out"
    assert run_ranks(
        tmp_path,
        "--coordinator",
        transport_cluster.address,
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        *CLIP,
        "--job",
        job,
    ) == [
        0,
        0,
    ], rank_logs(tmp_path)
    trained = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
    # the hook does not change training numerics
    for r in range(2):
        assert_same_state(trained[r], reference[r])
        assert trained[r]["losses"] == reference[r]["losses"]
        assert trained[r]["committed"] == STEPS
    st = transport_cluster.status()
    assert (
        st["job"]["name"] == job and st["job"]["committed"] == STEPS and all(w["health"] == "ok" for w in st["workers"])
    )
    assert sum(w["stop"] - w["start"] for w in st["workers"]) == st["job"]["elements"]

    # restore into a fresh, differently initialised model in this process (no DDP)
    import trainer_hooks

    model, opt, sched = build(seed=99)
    info = trainer_hooks.restore(model, opt, source=transport_cluster.address, scheduler=sched, job=job, rank=1)
    assert info.iteration == STEPS and info.extra_state == {"it": STEPS} and info.tier == "memory"
    assert_same_state(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, trained[0]
    )
    assert torch.equal(torch.get_rng_state(), trained[1]["rng"])  # rank 1's RNG

    # the CLI writes a plain torch file that loads with weights_only=True
    ckpt = tmp_path / "ckpt.pt"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "shadow",
            "restore",
            f"source={transport_cluster.address}",
            f"job={job}",
            f"out={ckpt}",
            "format=torch",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    sd = torch.load(ckpt, weights_only=True)
    assert sd["iteration"] == STEPS and sd["extra_state"] == {"it": STEPS} and len(sd["rng"]) == 2
    m2, o2, s2 = build(seed=7)
    m2.load_state_dict(sd["model"])
    o2.load_state_dict(sd["optimizer"])
    s2.load_state_dict(sd["scheduler"])
    assert_same_state(
        {"model": m2.state_dict(), "optimizer": o2.state_dict(), "scheduler": s2.state_dict()}, trained[0]
    )
    assert torch.equal(sd["rng"][0]["torch"], trained[0]["rng"])


@pytest.mark.parametrize("seed", [11, 22, 33])
def test_sigkill_restore_resume_is_bit_identical(shared_cluster, job, reference, tmp_path, seed):
    kill_at = random.Random(seed).randint(2, STEPS - 2)
    codes = run_ranks(
        tmp_path,
        "--coordinator",
        shared_cluster.address,
        "--out",
        str(tmp_path / "dead"),
        "--steps",
        str(STEPS),
        "--kill-at",
        str(kill_at),
        *CLIP,
        "--job",
        job,
    )
    assert codes == [-9, -9], rank_logs(tmp_path)
    quiet = shared_cluster.wait_quiet()["job"]
    assert quiet["name"] == job
    committed = quiet["committed"]  # where the killed ranks left it
    assert kill_at - 3 <= committed <= kill_at
    # a fresh process group restores from the shadow and finishes the run
    out = tmp_path / "resumed"
    assert run_ranks(
        tmp_path,
        "--mode",
        "resume",
        "--coordinator",
        shared_cluster.address,
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        *CLIP,
        "--job",
        job,
    ) == [0, 0], rank_logs(tmp_path)
    for r in range(2):
        resumed = torch.load(out / f"rank{r}.pt", weights_only=True)
        assert resumed["start"] == committed
        assert_same_state(resumed, reference[r])
        assert resumed["losses"] == reference[r]["losses"][committed:]
        assert torch.equal(resumed["rng"], reference[r]["rng"])
        assert resumed["stats"]["base_kept"]  # the workers kept the restored iteration: nothing re-sent


def test_a_state_changed_between_restore_and_attach_is_caught_and_sent_whole(shared_cluster, job, tmp_path):
    """The attach after a restore from the cluster's memory lets the workers keep what they
    hold instead of taking the state again; the ranks prove theirs equal by digests. A loop
    that changes the model in between (here every rank, the same way) is caught: the workers
    go stale, the resync sends the state whole, and the shadow holds the trainer's state,
    not the restored one."""
    assert run_ranks(
        tmp_path,
        *("--coordinator", shared_cluster.address, "--out", str(tmp_path / "dead"), "--steps", "5"),
        *("--kill-at", "4", *CLIP, "--job", job),
    ) == [-9, -9], rank_logs(tmp_path)
    shared_cluster.wait_quiet()
    common = ("--mode", "resume", "--coordinator", shared_cluster.address, "--steps", str(STEPS), *CLIP, "--job", job)
    changed = tmp_path / "changed"
    assert run_ranks(
        tmp_path, *common, "--out", str(changed), "--tamper-after-restore", "--until-resynced", "1200"
    ) == [0, 0], rank_logs(tmp_path)
    trained = [torch.load(changed / f"rank{r}.pt", weights_only=True) for r in range(2)]
    end = trained[0]["committed"]
    assert trained[0]["stats"]["degraded"] is None and not trained[0]["stats"]["base_kept"], trained[0]["stats"]
    assert end == trained[0]["start"] + len(trained[0]["losses"]), (end, trained[0]["start"], rank_logs(tmp_path))
    workers = shared_cluster.wait_status(
        lambda st: sum(w["rejected"].get("kept_mismatch", 0) for w in st["workers"]) >= 1,
        what="a worker counting the refused proof (its next heartbeat)",
    )["workers"]
    assert sum(w["rejected"]["kept_mismatch"] for w in workers if "kept_mismatch" in w["rejected"]) <= 2
    again = tmp_path / "again"
    assert run_ranks(tmp_path, *common, "--out", str(again)) == [0, 0], rank_logs(tmp_path)
    for r in range(2):
        restored = torch.load(again / f"rank{r}.pt", weights_only=True)
        assert restored["start"] == end
        assert_same_state(restored, trained[r])  # the trainer's state, not the restored one


def test_trainer_dying_mid_send_leaves_previous_iteration(transport_cluster, job, reference, tmp_path):
    k = 6
    # iteration 6 sends one message normally, then the rest (commit included) only to worker 0, then dies
    codes = run_ranks(
        tmp_path,
        "--coordinator",
        transport_cluster.address,
        "--out",
        str(tmp_path / "dead"),
        "--steps",
        str(STEPS),
        *CLIP,
        "--job",
        job,
        env={"SHADOW_FAULT_DIE_AT": f"{k}:1"},
    )
    assert 137 in codes, rank_logs(tmp_path)
    st = transport_cluster.wait_status(
        lambda st: (
            st["workers"][0]["prepared"] == k
            and all(w["applied"] == k - 1 for w in st["workers"])
            and transport_cluster.heard_after_cut(st)
        ),
        what=f"worker 0 holding all of {k}",
    )
    assert st["job"]["name"] == job and st["job"]["committed"] == k - 1
    assert st["workers"][0]["prepared"] == k  # worker 0 had all of k, yet nobody applied it
    assert all(w["applied"] == k - 1 for w in st["workers"])
    out = tmp_path / "resumed"
    assert run_ranks(
        tmp_path,
        "--mode",
        "resume",
        "--coordinator",
        transport_cluster.address,
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        *CLIP,
        "--job",
        job,
    ) == [0, 0], rank_logs(tmp_path)
    for r in range(2):
        resumed = torch.load(out / f"rank{r}.pt", weights_only=True)
        assert resumed["start"] == k - 1
        assert_same_state(resumed, reference[r])
