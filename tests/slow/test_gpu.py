"""On a CUDA device (skipped without one): attach -> SIGKILL -> restore, end to end, with
bf16 autocast, GradScaler over fused AdamW (a step skipped on the device), the session's
clip and gradient accumulation; and the copy stream's ordering on real streams."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shadow.testing import LocalCluster, free_port
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
HELPER = ROOT / "tests" / "helpers" / "gpu_trainer.py"


def _run(tmp_path, *args: str) -> int:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    with open(tmp_path / "trainer.log", "a") as log:
        return subprocess.run(
            [sys.executable, str(HELPER), *args], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=240
        ).returncode


def _ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    from shadow.testing import ulp_report

    return ulp_report(a, b)["max_ulp"]


def test_the_copy_stream_orders_after_the_current_stream_and_the_sender_waits():
    from trainer_hooks.session.transfer import CopyStream, HostCopy

    copier = CopyStream(torch.device("cuda"))
    src = torch.zeros(1 << 24, device="cuda")
    host = torch.empty(1 << 24, pin_memory=True)
    for value in (1.0, 2.0, 3.0):
        torch.cuda._sleep(10_000_000)  # the current stream is busy...
        src.fill_(value)  # ...then writes: the copy must see this value, not an older one
        ev = copier.copy(host, src)
        ev.synchronize()
        assert torch.equal(host[:4], torch.full((4,), value)) and host[-1].item() == value
        copier.fence()  # the next fill waits for the copy on the device
    scalar = torch.tensor(5.0, device="cuda")
    snap = HostCopy({"s": scalar})
    scalar.add_(1)
    assert torch.equal(snap.get()["s"], torch.tensor(5.0))


def test_copy_all_orders_every_copy_after_the_current_stream():
    from trainer_hooks.session.transfer import CopyStream

    copier = CopyStream(torch.device("cuda"))
    srcs = [torch.zeros(n, device="cuda") for n in (1 << 22, 3, 1 << 20)]
    host = torch.empty(sum(s.numel() for s in srcs), pin_memory=True)
    for value in (1.0, 2.0):
        torch.cuda._sleep(10_000_000)  # the current stream is busy...
        for s in srcs:
            s.fill_(value)  # ...then writes: every copy must see this value
        pairs, at = [], 0
        for s in srcs:
            pairs.append((host[at : at + s.numel()], s))
            at += s.numel()
        copier.copy_all(pairs).synchronize()
        assert torch.equal(host, torch.full_like(host, value))
        copier.fence()


def test_attach_kill_restore_on_cuda(tmp_path):
    cluster = LocalCluster(tmp_path, workers=2)
    try:
        assert _run(tmp_path, "train", cluster.address, str(tmp_path), "12", "7") == -9, (
            tmp_path / "trainer.log"
        ).read_text()
        live = torch.load(tmp_path / "live.pt", weights_only=True)
        assert _run(tmp_path, "resume", cluster.address, str(tmp_path), "12") == 0, (
            tmp_path / "trainer.log"
        ).read_text()
        final = torch.load(tmp_path / "final.pt", weights_only=True)
        assert final["restored"] == 7 and final["iteration"] == 12
        assert cluster.wait_caught_up(12)["job"]["committed"] == 12

        # what was restored is the live state at the kill: bit for bit where the calibration says so
        import trainer_hooks
        from tests.helpers.gpu_trainer import build

        model, opt, sched, scaler = build()
        info = trainer_hooks.restore(
            model, opt, source=cluster.address, scheduler=sched, scaler=scaler, iteration=7, job="gpu", rank=0
        )
        assert info.iteration == 7 and scaler.state_dict() == live["scaler"]
        assert sched.state_dict()["last_epoch"] == live["sched"]["last_epoch"]
        worst = 0
        for k, v in model.state_dict().items():
            worst = max(worst, _ulp(v.cpu(), live["model"][k]))
        for p, st in zip(model.parameters(), live["opt"], strict=True):
            for key, v in st.items():
                worst = max(worst, _ulp(opt.state[p][key].cpu(), v))
        desc = live["optim"]  # what the calibration at attach chose, and whether it reproduced the device
        assert desc["impl"] == "cuda_fused"
        if desc["bit_exact"]:
            assert worst == 0, f"calibrated bit-exact, yet the restored state is {worst} ulp from the live one"
        else:
            assert worst <= 64, f"restored state is {worst} ulp from the live one"
    finally:
        cluster.stop()
