"""ShadowedRun refuses a model accelerate did not wrap in DDP with advice that fits how the
process was started (issue 52): under torchrun on a host without a GPU, ``Accelerator()``
without ``cpu=True`` runs every rank alone (the process group initialised, the model not
wrapped); the advice is then ``cpu=True``, not to launch with torchrun."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate.utils import DistributedType  # noqa: E402

from shadow.core.errors import ShadowUsageError  # noqa: E402
from tests.conftest import rank_logs, run_ranks  # noqa: E402
from trainer_hooks.integrations.accelerate import ShadowedRun  # noqa: E402

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _refusal(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], processes: int = 1, kind=DistributedType.NO) -> str:
    for var in LAUNCH_VARS + ("MV2_COMM_WORLD_SIZE",):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # a process group of this test process (another test's world1 fixture) is not the launch described
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    accelerator = SimpleNamespace(
        num_processes=processes, distributed_type=kind, device=torch.device("cpu"), scaler=None
    )
    with pytest.raises(ShadowUsageError) as ei:
        ShadowedRun(accelerator, torch.nn.Linear(2, 2), None, None, "tcp://127.0.0.1:1")
    return str(ei.value)


def _tells_to_launch(msg: str) -> bool:
    return "--num_processes" in msg or "--nproc" in msg or "or torchrun)" in msg


def test_under_torchrun_on_a_cpu_host_the_advice_is_cpu_true(monkeypatch):
    msg = _refusal(monkeypatch, {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert "Accelerator(cpu=True)" in msg and "among 2 processes" in msg, msg
    assert not _tells_to_launch(msg), msg
    msg = _refusal(monkeypatch, {"LOCAL_RANK": "0"})  # a launcher's rank without a size
    assert "Accelerator(cpu=True)" in msg and not _tells_to_launch(msg), msg


def test_a_process_started_alone_is_told_to_launch_several(monkeypatch):
    msg = _refusal(monkeypatch, {})
    assert _tells_to_launch(msg) and "cpu=True" not in msg, msg
    msg = _refusal(monkeypatch, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    assert "world size 1" in msg and "--nproc-per-node 2" in msg, msg


def test_several_processes_without_ddp_name_what_accelerate_runs(monkeypatch):
    msg = _refusal(monkeypatch, {"RANK": "0", "WORLD_SIZE": "2"}, processes=2, kind=DistributedType.FSDP)
    assert "2 processes as FSDP" in msg and not _tells_to_launch(msg), msg


RANK = textwrap.dedent("""
    import os, sys
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # as torchrun sets it
    import torch
    from accelerate import Accelerator
    from shadow.core.errors import ShadowUsageError
    from trainer_hooks.integrations.accelerate import ShadowedRun

    accelerator = Accelerator()  # no cpu=True, on a host without a GPU
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    print("process group", torch.distributed.is_initialized(), "accelerate", accelerator.distributed_type, flush=True)
    try:
        ShadowedRun(accelerator, model, None, None, "tcp://127.0.0.1:1")
    except ShadowUsageError as exc:
        print("REFUSED:", exc, flush=True)
        ok = "Accelerator(cpu=True)" in str(exc) and "or torchrun)" not in str(exc)
    else:
        ok = False
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(0 if ok else 3)
""")


@pytest.mark.slow
def test_two_torchrun_ranks_on_a_cpu_host_are_told_cpu_true(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("accelerate uses the GPU here: the case is a host without one")
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    codes = run_ranks(tmp_path, script=script, timeout=120)
    assert codes == [0, 0], rank_logs(tmp_path, 6000)
