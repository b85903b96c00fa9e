"""The frameworks users train with, used as their documentation says, with the shadow attached
through trainer_hooks.integrations: 2 gloo ranks SIGKILLed mid-epoch (or right after an
epoch's last step), resumed from the shadow, and compared bit for bit with a run that never
failed. Lightning also under its own launcher. Each framework is an optional extra; its test
is skipped where it is not installed."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from shadow.testing import assert_same_state
from tests.conftest import ROOT, rank_logs, run_ranks

pytestmark = pytest.mark.slow

HELPERS = ROOT / "tests" / "helpers"

# what a launcher tells a rank: Lightning's own launcher must find none of it, as under `python train.py`
LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)
_RUNS = itertools.count()


def _kill_and_resume(
    tmp_path,
    cluster,
    job: str,
    script,
    kill_at: int,
    *extra: str,
    ref: tuple[str, ...] = (),
    dead: tuple[str, ...] = (),
    resumed: tuple[str, ...] = (),
    resumed_env: dict | None = None,
    launch: Callable[..., list[int]] | None = None,
) -> tuple[list, list, int]:
    """Reference run, a shadowed run SIGKILLed after optimizer step ``kill_at``, its resume:
    ``(reference states, resumed states, committed iteration)``. ``ref``, ``dead``,
    ``resumed``: more arguments of that run; ``resumed_env``: more environment of the resumed
    one; ``launch``: how the ranks are started (default :func:`run_ranks`)."""

    def run(*args: str, env: dict | None = None) -> list[int]:
        if launch is not None:
            return launch(tmp_path, *args, *extra, script=script, env=env)
        return run_ranks(tmp_path, *args, *extra, script=script, env=env)

    assert run("--out", str(tmp_path / "ref"), *ref) == [0, 0], rank_logs(tmp_path)
    addr = ("--coordinator", cluster.address, "--job", job)
    assert run(*addr, "--out", str(tmp_path / "dead"), "--kill-at", str(kill_at), *dead) == [-9, -9], rank_logs(
        tmp_path
    )
    quiet = cluster.wait_quiet()["job"]
    assert quiet["name"] == job
    out = run(*addr, "--out", str(tmp_path / "resumed"), "--resume", *resumed, env=resumed_env)
    assert out == [0, 0], rank_logs(tmp_path)
    load = lambda d, r: torch.load(tmp_path / d / f"rank{r}.pt", weights_only=True)  # noqa: E731
    return [load("ref", r) for r in range(2)], [load("resumed", r) for r in range(2)], quiet["committed"]


def _own_launcher(tmp_path, *args: str, script, env: dict | None = None, timeout: float = 300) -> list[int]:
    """``script`` run as ``python script --own-launcher ...`` with no launcher's environment:
    Lightning's own launcher starts rank 1 inside ``fit()``. Rank 0 (this process's child)
    waits for rank 1; its exit code stands for both (a SIGKILL of either ends both: Lightning
    kills the main process when another rank dies), ``[code, code]``. Whatever of the
    launch is left at the end is SIGKILLed (its own process group)."""
    e = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    e.update(PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1", **(env or {}))
    with open(tmp_path / f"rank-own-launcher-{next(_RUNS)}.log", "a") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script), "--own-launcher", *args],
            env=e,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"Lightning's launch outlived {timeout:.0f} s\n{rank_logs(tmp_path)}") from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # rank 1, if it outlived rank 0
            except ProcessLookupError:
                pass
            proc.wait()
    return [code, code]


def _no_resume_dirs(tmp: os.PathLike, job: str) -> list[str]:
    return sorted(p for p in os.listdir(tmp) if p.startswith(f"shadow-{job}-"))


def test_accelerate_resumes_mid_epoch_bit_for_bit(shared_cluster, job, tmp_path):
    pytest.importorskip("accelerate")
    refs, outs, committed = _kill_and_resume(tmp_path, shared_cluster, job, HELPERS / "accelerate_trainer.py", 9)
    assert committed >= 6
    for a, b in zip(refs, outs, strict=True):
        assert 0 < b["start"] < len(a["losses"])  # resumed inside an epoch, not at its start
        assert_same_state(b, a)
        assert b["losses"] == a["losses"][b["start"] :]
        assert b["draws"] == a["draws"][b["start"] :]
        assert torch.equal(a["rng"], b["rng"])


def test_accelerate_resumes_after_an_epochs_last_step_with_the_next_epoch(shared_cluster, job, tmp_path):
    """Killed right after the commit of epoch 0's last optimizer step (step 6 of 3 epochs of 6),
    resumed with ``resume="auto"``: epoch 0 yields nothing more, epochs 1 and 2 are trained whole."""
    pytest.importorskip("accelerate")
    refs, outs, committed = _kill_and_resume(
        tmp_path,
        shared_cluster,
        job,
        HELPERS / "accelerate_trainer.py",
        6,
        dead=("--kill-committed",),
        resumed=("--resume-auto",),
    )
    assert committed == 6
    for a, b in zip(refs, outs, strict=True):
        assert a["epochs"] == {0: 12, 1: 12, 2: 12}  # 12 micro-batches, 6 optimizer steps, each epoch
        assert b["start"] == 12  # epoch 0 done, whole
        assert b["epochs"] == {0: 0, 1: 12, 2: 12}  # no batch of epoch 0 again, no epoch skipped
        assert_same_state(b, a)
        assert b["losses"] == a["losses"][12:]
        assert b["draws"] == a["draws"][12:]
        assert torch.equal(a["rng"], b["rng"])


def test_hf_trainer_resumes_mid_epoch_bit_for_bit(shared_cluster, job, tmp_path):
    pytest.importorskip("transformers")
    tmp = tmp_path / "tmp"  # the resumed ranks' $TMPDIR: the checkpoint they resume from is written there
    tmp.mkdir()
    refs, outs, committed = _kill_and_resume(
        tmp_path,
        shared_cluster,
        job,
        HELPERS / "hf_trainer.py",
        9,
        resumed=("--resume-tmp",),
        resumed_env={"TMPDIR": str(tmp)},
    )
    assert committed >= 6
    for a, b in zip(refs, outs, strict=True):
        assert a["global_step"] == b["global_step"] == 18  # 3 epochs of 6 optimizer steps
        assert_same_state(b, a)
        after = {s: v for s, v in a["losses"].items() if s > committed}
        assert after and {s: b["losses"][s] for s in after} == after  # the resumed run's own losses
        assert torch.equal(a["rng"], b["rng"])
        # every step's entry, the checkpointed step's and the one before included (logging_steps=1)
        assert [e["step"] for e in a["log_history"]] == list(range(1, 19))
        assert b["log_history"] == a["log_history"]
    assert _no_resume_dirs(tmp, job) == []  # each rank removed the checkpoint it had written, once loaded


def test_hf_trainer_resumes_after_an_epochs_last_step_with_the_next_epoch(shared_cluster, job, tmp_path):
    """Killed right after the commit of epoch 0's last optimizer step (step 6 of 3 epochs of 6),
    once its log entry is in: the Trainer goes on with epoch 1, whole, as from its own
    checkpoint of that step."""
    pytest.importorskip("transformers")
    refs, outs, committed = _kill_and_resume(
        tmp_path,
        shared_cluster,
        job,
        HELPERS / "hf_trainer.py",
        6,
        ref=("--hf-ckpt-at", "6"),
        dead=("--kill-committed",),
    )
    assert committed == 6
    for a, b in zip(refs, outs, strict=True):
        assert a["global_step"] == b["global_step"] == 18  # 3 epochs of 6 optimizer steps
        assert a["epoch"] == b["epoch"] == 3
        assert a["epochs"] == [0, 1, 2]
        assert b["epochs"] == [1, 2]  # epoch 0 not again, epoch 1 not skipped
        assert_same_state(b, a)
        assert sorted(b["losses"]) == list(range(1, 19))
        after = {s: v for s, v in a["losses"].items() if s > committed}
        assert len(after) == 12 and {s: b["losses"][s] for s in after} == after  # the resumed run's own
        assert torch.equal(a["rng"], b["rng"])
        assert [e["step"] for e in a["log_history"]] == list(range(1, 19))
        assert b["log_history"] == a["log_history"]
    # the checkpoint the shadow wrote says what the Trainer's own checkpoint of that step says
    own_dir = tmp_path / "ref" / "trainer" / "checkpoint-6"
    own = json.loads((own_dir / "trainer_state.json").read_text())
    for r in range(2):
        ours_dir = tmp_path / "resumed" / "resume" / f"rank{r}" / "checkpoint-6"
        ours = json.loads((ours_dir / "trainer_state.json").read_text())
        assert (ours["global_step"], ours["epoch"]) == (own["global_step"], own["epoch"]) == (6, 1.0)
        assert ours["log_history"] == own["log_history"]
        for k in ("max_steps", "num_train_epochs", "logging_steps", "train_batch_size"):
            assert ours[k] == own[k], k
        theirs = torch.load(own_dir / f"rng_state_{r}.pth", weights_only=False)
        mine = torch.load(ours_dir / f"rng_state_{r}.pth", weights_only=False)
        assert torch.equal(mine["cpu"], theirs["cpu"])


def test_lightning_resumes_mid_epoch_bit_for_bit(shared_cluster, job, tmp_path):
    pytest.importorskip("lightning")
    refs, outs, committed = _kill_and_resume(tmp_path, shared_cluster, job, HELPERS / "lightning_trainer.py", 9)
    assert committed >= 6
    for r, (a, b) in enumerate(zip(refs, outs, strict=True)):
        assert a["global_step"] == b["global_step"] == 18  # 3 epochs of 6 optimizer steps
        assert_same_state(b, a)
        # the resumed run trained each remaining batch once, on the batch the uninterrupted run had there
        assert len(b["losses"]) == len(a["losses"]) - 2 * committed
        assert b["losses"] == {k: a["losses"][k] for k in b["losses"]}
        assert torch.equal(a["rng"], b["rng"])
        assert b["extra"] == {"rank": r}  # the rank's own extra state
        # a directory the caller named is the caller's: kept
        assert (tmp_path / "resumed" / "resume" / f"rank{r}" / f"iteration-{committed}.ckpt").is_file()


def test_lightning_resumes_after_an_epochs_last_step_with_the_next_epoch(shared_cluster, job, tmp_path):
    """Killed right after the commit of epoch 0's last optimizer step (step 6 of 3 epochs of 6):
    the resume goes on with epoch 1, whole, as from Lightning's own checkpoint of that step."""
    pytest.importorskip("lightning")
    refs, outs, committed = _kill_and_resume(
        tmp_path,
        shared_cluster,
        job,
        HELPERS / "lightning_trainer.py",
        6,
        ref=("--lightning-ckpt-at", "6"),
        dead=("--kill-committed",),
    )
    assert committed == 6
    for r, (a, b) in enumerate(zip(refs, outs, strict=True)):
        assert a["global_step"] == b["global_step"] == 18  # 3 epochs of 6 optimizer steps
        assert a["epoch"] == b["epoch"] == 3
        assert_same_state(b, a)
        # epochs 1 and 2 trained whole, each batch once, on the batch the uninterrupted run had there
        assert sorted(b["losses"]) == sorted(k for k in a["losses"] if not k.startswith("0:"))
        assert len(b["losses"]) == 24
        assert b["losses"] == {k: a["losses"][k] for k in b["losses"]}
        assert torch.equal(a["rng"], b["rng"])
        assert b["extra"] == {"rank": r}
    # the checkpoint the shadow wrote says what Lightning's own checkpoint of that step says
    own = torch.load(tmp_path / "ref" / "lightning" / "epoch=0-step=6.ckpt", weights_only=False)
    for r in range(2):
        ours = torch.load(tmp_path / "resumed" / "resume" / f"rank{r}" / "iteration-6.ckpt", weights_only=False)
        assert (ours["epoch"], ours["global_step"]) == (own["epoch"], own["global_step"]) == (0, 6)
        assert ours["loops"] == own["loops"]
        assert ours["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] is True


def test_lightning_own_launcher_resumes_each_rank_bit_for_bit(shared_cluster, job, tmp_path):
    """``Trainer(devices=2, strategy="ddp")`` run as ``python train.py``: rank 1 is started
    by Lightning inside ``fit()``, with no ``$RANK``; ``resume_checkpoint()`` runs before
    the process group exists in both. Each rank seeds its own RNG, so a rank given another's
    RNG would train other dropout masks."""
    pytest.importorskip("lightning")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    refs, outs, committed = _kill_and_resume(
        tmp_path,
        shared_cluster,
        job,
        HELPERS / "lightning_trainer.py",
        9,
        "--rank-seed",
        resumed=("--resume-tmp",),
        resumed_env={"TMPDIR": str(tmp)},
        launch=_own_launcher,
    )
    assert committed >= 6
    assert not torch.equal(refs[0]["rng"], refs[1]["rng"])  # the ranks' RNGs differ
    for r, (a, b) in enumerate(zip(refs, outs, strict=True)):
        assert a["global_step"] == b["global_step"] == 18
        assert_same_state(b, a)
        assert len(b["losses"]) == len(a["losses"]) - 2 * committed
        assert b["losses"] == {k: a["losses"][k] for k in b["losses"]}
        assert torch.equal(a["rng"], b["rng"])
        assert b["extra"] == {"rank": r}
    assert _no_resume_dirs(tmp, job) == []
