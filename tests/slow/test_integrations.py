"""The frameworks users train with, used as their documentation says, with the shadow attached
through trainer_hooks.integrations: 2 gloo ranks SIGKILLed mid-epoch, resumed from the shadow,
and compared bit for bit with a run that never failed. Each framework is an optional extra;
its test is skipped where it is not installed."""

from __future__ import annotations

import pytest
import torch

from shadow.testing import assert_same_state
from tests.conftest import ROOT, rank_logs, run_ranks

pytestmark = pytest.mark.slow

HELPERS = ROOT / "tests" / "helpers"


def _kill_and_resume(tmp_path, cluster, job: str, script, kill_at: int, *extra: str) -> tuple[list, list, int]:
    """Reference run, a shadowed run SIGKILLed after optimizer step ``kill_at``, its resume:
    ``(reference states, resumed states, committed iteration)``."""

    def run(*args: str) -> list[int]:
        return run_ranks(tmp_path, *args, *extra, script=script)

    assert run("--out", str(tmp_path / "ref")) == [0, 0], rank_logs(tmp_path)
    addr = ("--coordinator", cluster.address, "--job", job)
    assert run(*addr, "--out", str(tmp_path / "dead"), "--kill-at", str(kill_at)) == [-9, -9], rank_logs(tmp_path)
    quiet = cluster.wait_quiet()["job"]
    assert quiet["name"] == job
    assert run(*addr, "--out", str(tmp_path / "resumed"), "--resume") == [0, 0], rank_logs(tmp_path)
    load = lambda d, r: torch.load(tmp_path / d / f"rank{r}.pt", weights_only=True)  # noqa: E731
    return [load("ref", r) for r in range(2)], [load("resumed", r) for r in range(2)], quiet["committed"]


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


def test_hf_trainer_resumes_mid_epoch_bit_for_bit(shared_cluster, job, tmp_path):
    pytest.importorskip("transformers")
    refs, outs, committed = _kill_and_resume(tmp_path, shared_cluster, job, HELPERS / "hf_trainer.py", 9)
    assert committed >= 6
    for a, b in zip(refs, outs, strict=True):
        assert a["global_step"] == b["global_step"] == 18  # 3 epochs of 6 optimizer steps
        assert_same_state(b, a)
        after = {s: v for s, v in a["losses"].items() if s > committed}
        assert after and {s: b["losses"][s] for s in after} == after  # the resumed run's own losses
        assert torch.equal(a["rng"], b["rng"])


def test_lightning_resumes_mid_epoch_bit_for_bit(shared_cluster, job, tmp_path):
    pytest.importorskip("lightning")
    refs, outs, committed = _kill_and_resume(tmp_path, shared_cluster, job, HELPERS / "lightning_trainer.py", 9)
    assert committed >= 6
    for a, b in zip(refs, outs, strict=True):
        assert a["global_step"] == b["global_step"] == 18  # 3 epochs of 6 optimizer steps
        assert_same_state(b, a)
        # the resumed run trained each remaining batch once, on the batch the uninterrupted run had there
        assert len(b["losses"]) == len(a["losses"]) - 2 * committed
        assert b["losses"] == {k: a["losses"][k] for k in b["losses"]}
        assert torch.equal(a["rng"], b["rng"])
