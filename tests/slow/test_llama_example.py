"""examples/llama_parallel.py run as written on 4 gloo ranks (issue 55): a Llama-style model
trained with FSDP2 over tensor parallel (2D) and with 2 pipeline stages over FSDP2 (1F1B),
SIGKILLed mid-run, resumed from the shadow, and compared bit for bit (every rank's local
parameters and moments, and the losses) with a run that never failed."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ROOT, rank_logs, run_ranks

pytestmark = pytest.mark.slow

LLAMA = ROOT / "examples" / "llama_parallel.py"
STEPS = 6


@pytest.mark.parametrize("parallel", ["2d", "pp"])
def test_llama_example_resumes_bit_for_bit(shared_cluster, job, tmp_path, parallel):
    common = (f"--parallel={parallel}", f"--steps={STEPS}", f"--job={job}")

    def run(*args: str) -> list[int]:
        return run_ranks(tmp_path, *common, *args, world=4, script=LLAMA, timeout=300)

    assert run(f"--out_dir={tmp_path / 'ref'}") == [0] * 4, rank_logs(tmp_path)
    addr = f"--coordinator={shared_cluster.address}"
    assert run(addr, "--kill_at=4") == [-9] * 4, rank_logs(tmp_path)
    committed = shared_cluster.wait_quiet()["job"]["committed"]
    assert 1 <= committed <= 4
    assert run(addr, f"--out_dir={tmp_path / 'resumed'}", "--resume") == [0] * 4, rank_logs(tmp_path)
    for r in range(4):
        a = torch.load(tmp_path / "ref" / f"rank{r}.pt", weights_only=True)
        b = torch.load(tmp_path / "resumed" / f"rank{r}.pt", weights_only=True)
        assert sorted(a["state"]) == sorted(b["state"])
        bad = [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
        assert not bad, f"rank {r}: {bad} differ"
        assert b["losses"] == a["losses"][committed:], f"rank {r}'s losses after the restore"
    assert shared_cluster.status()["job"]["committed"] == STEPS
