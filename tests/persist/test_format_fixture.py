"""The on-disk format holds: checkpoints an earlier build's cluster wrote (tests/data/format,
made by tools/make_format_fixture.py: the tiny model, 2 workers, both shard encodings)
restore bit for bit into a freshly built trainer, by directory and through the CLI, and
verify clean. A change that leaves them unreadable, or reads them into another state, fails
here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer_hooks
from shadow.persist import checkpoints
from tests.helpers.tiny_trainer import build

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "format"
ENCODINGS = ("none", "zstd")


def _expected() -> dict[str, np.ndarray]:
    with np.load(FIXTURE / "expected.npz", allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def _tier(tmp_path: Path, enc: str) -> Path:
    root = tmp_path / enc
    shutil.copytree(FIXTURE / enc, root)  # a tier elsewhere than where it was written
    return root


@pytest.mark.parametrize("enc", ENCODINGS)
def test_a_checkpoint_of_an_earlier_build_restores_bit_for_bit(tmp_path, enc):
    want = _expected()
    model, opt, sched = build(seed=11)  # other weights than those trained
    info = trainer_hooks.restore(model, opt, source=str(_tier(tmp_path, enc)), scheduler=sched, job="format")
    assert info.iteration == 4
    names = dict(model.named_parameters())
    assert {k.split("/", 1)[1] for k in want if k.startswith("param/")} == set(names)
    for name, p in names.items():
        assert torch.equal(p.detach(), torch.from_numpy(want[f"param/{name}"])), name
        for k in ("exp_avg", "exp_avg_sq", "step"):
            if f"{k}/{name}" in want:
                got = opt.state[p][k].detach().to(torch.float32).reshape(want[f"{k}/{name}"].shape)
                assert torch.equal(got, torch.from_numpy(want[f"{k}/{name}"])), (k, name)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_an_earlier_builds_tier_lists_verifies_and_picks_by_iteration(tmp_path, enc):
    root = _tier(tmp_path, enc)
    found = checkpoints.list_checkpoints(str(root), job="format")
    assert [c.iteration for c in found] == [2, 4]
    for c in found:
        assert checkpoints.verify(c) == [], c.path
    model, opt, _ = build(seed=12)
    assert trainer_hooks.restore(model, opt, source=str(root), job="format", iteration=2).iteration == 2
    snap = checkpoints.load(found[-1])
    assert snap.iteration == 4


@pytest.mark.slow
def test_the_cli_restores_an_earlier_builds_checkpoint(tmp_path):
    root = _tier(tmp_path, "zstd")
    out = tmp_path / "ckpt.pt"
    res = subprocess.run(
        [sys.executable, "-m", "shadow", "restore", f"source={root}", f"out={out}", "job=format"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    state = torch.load(out, weights_only=True)
    want = _expected()
    for name, t in state["model"].items():
        if f"param/{name}" in want:
            assert torch.equal(t, torch.from_numpy(want[f"param/{name}"])), name
    res = subprocess.run(
        [sys.executable, "-m", "shadow", "verify", f"source={root}"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
