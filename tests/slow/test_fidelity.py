"""Training-loop features, each replayed exactly: a 2-rank gloo run with the feature is
SIGKILLed at a random iteration, restored in a new process group, finished, and compared
bit for bit with an uninterrupted run without the shadow."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from shadow.testing import assert_same_state
from tests.conftest import rank_logs, run_ranks

pytestmark = pytest.mark.slow
STEPS = 10

FEATURES = {
    "grad-accumulation-no-sync": ("--accum", "3"),
    "onecycle-lr": ("--sched", "onecycle"),
    "sequential-lr": ("--sched", "sequential"),
    "chained-lr": ("--sched", "chained"),
    "unused-parameters": ("--unused",),
    "adam-l2-amsgrad-clip": ("--optim", "adam", "--amsgrad", "--clip", "0.05"),
    "fp16-compress-hook": ("--compress", "fp16"),
    "grad-scaler-skipped-steps": ("--amp", "step"),
    "sgd-momentum-nesterov": ("--optim", "sgd"),
    "sgd-foreach-clip": ("--optim", "sgd", "--impl", "foreach", "--clip", "0.05"),
    # Adamax, added through the optimizer registry alone (shadow/core/optimizers/adamax.py)
    "adamax-foreach-clip": ("--optim", "adamax", "--impl", "foreach", "--clip", "0.05"),
    "grad-scaler-unscale-clip": ("--amp", "unscale", "--clip", "0.05"),
    # torch's own clip_grad_norm_ in the loop (as frameworks call it), recorded
    "torch-clip-in-loop": ("--clip", "0.05", "--clip-via", "torch"),
    # optimizer.step(closure) with forward, backward and torch's clip inside (Lightning)
    "closure-torch-clip": ("--closure", "--clip", "0.05", "--clip-via", "torch"),
    # GradScaler(enabled=False), always built by nanoGPT-style scripts
    "disabled-grad-scaler-clip": ("--disabled-scaler", "--clip", "0.05", "--clip-via", "torch"),
    # a scheduler stepped twice per optimizer step (accelerate's AcceleratedScheduler); the inner one attached
    "scheduler-twice-per-step": ("--sched-steps", "2"),
    # torch's default AdamW on CPU (single-tensor: MKL's square roots, measured at attach)
    "adamw-default-impl-clip": ("--impl", "default", "--clip", "0.05", "--clip-via", "torch"),
    # the scheduler's wrapper attached, stepping it twice per optimizer step
    "scheduler-wrapper-twice-per-step": ("--sched-steps", "2", "--sched-wrap"),
    # nanoGPT: batches drawn from torch's RNG, the next fetched before the step; the resume restores
    # (defer_rng=True) into the bare model before init_process_group, each rank's state found from $RANK
    "prefetch-defer-rng-restore-before-pg": ("--prefetch", "--restore-before-pg"),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_feature_survives_kill_and_resume(feature, shared_cluster, job, tmp_path):
    args = ("--steps", str(STEPS), "--job", job, *FEATURES[feature])
    ref = tmp_path / "ref"
    assert run_ranks(tmp_path, "--out", str(ref), *args) == [0, 0], rank_logs(tmp_path)
    kill_at = random.Random(zlib.crc32(feature.encode())).randint(3, STEPS - 2)
    codes = run_ranks(
        tmp_path,
        "--coordinator",
        shared_cluster.address,
        "--out",
        str(tmp_path / "dead"),
        "--kill-at",
        str(kill_at),
        *args,
    )
    assert codes == [-9, -9], rank_logs(tmp_path)
    quiet = shared_cluster.wait_quiet()["job"]
    assert quiet["name"] == job
    committed = quiet["committed"]  # where the killed ranks left it
    out = tmp_path / "resumed"
    assert run_ranks(
        tmp_path, "--mode", "resume", "--coordinator", shared_cluster.address, "--out", str(out), *args
    ) == [
        0,
        0,
    ], rank_logs(tmp_path)
    for r in range(2):
        a = torch.load(ref / f"rank{r}.pt", weights_only=True)
        b = torch.load(out / f"rank{r}.pt", weights_only=True)
        assert b["start"] == committed and committed >= kill_at - 3
        assert_same_state(b, a)
        assert b["losses"] == a["losses"][committed:]
        assert b["draws"] == a["draws"][committed:]  # Python random and numpy RNG restored per rank
        assert torch.equal(a["rng"], b["rng"])
        assert a["scaler"] == b["scaler"]
        if feature.startswith("grad-scaler"):  # the overflowing first step really was skipped
            assert float(a["optimizer"]["state"][0]["step"]) == STEPS - 2 and a["scaler"]["scale"] != 2.0**16
