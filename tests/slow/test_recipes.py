"""The examples users copy from, run as written: a nanoGPT-style plain loop (prefetching,
accumulation by ``require_backward_grad_sync``, a disabled GradScaler, torch's clipping, the
learning rate set by hand, torch's default AdamW on CPU) SIGKILLed mid-run on 2 gloo ranks,
resumed from the shadow, and compared bit for bit with a run that never failed."""

from __future__ import annotations

import pytest
import torch

from shadow.testing import assert_same_state
from tests.conftest import ROOT, rank_logs, run_ranks

pytestmark = pytest.mark.slow

NANOGPT = ROOT / "examples" / "nanogpt_train.py"
ITERS = 12


def test_nanogpt_style_loop_resumes_bit_for_bit(shared_cluster, job, tmp_path):
    common = (f"--max_iters={ITERS}", f"--job={job}")

    def run(*args: str) -> list[int]:
        return run_ranks(tmp_path, *common, *args, script=NANOGPT)

    assert run(f"--out_dir={tmp_path / 'ref'}") == [0, 0], rank_logs(tmp_path)
    addr = f"--coordinator={shared_cluster.address}"
    assert run(addr, f"--out_dir={tmp_path / 'dead'}", "--kill_at=7") == [-9, -9], rank_logs(tmp_path)
    quiet = shared_cluster.wait_quiet()["job"]
    assert quiet["name"] == job
    committed = quiet["committed"]
    assert 4 <= committed <= 7
    assert run(addr, f"--out_dir={tmp_path / 'resumed'}", "--resume=True") == [0, 0], rank_logs(tmp_path)
    for r in range(2):
        a = torch.load(tmp_path / "ref" / f"rank{r}.pt", weights_only=True)
        b = torch.load(tmp_path / "resumed" / f"rank{r}.pt", weights_only=True)
        assert b["iter_num"] == a["iter_num"] == ITERS
        assert_same_state({"model": b["model"], "optimizer": b["optimizer"]}, a)
        assert b["losses"] == a["losses"][committed:]
        assert torch.equal(a["rng"], b["rng"])
