"""A restore into an optimizer that already holds state (a trained one, rolled back in the
same process) fills its live tensors in place: nothing new is allocated, and the result is
bit for bit what a restore into a fresh optimizer gives."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

import tests
import trainer_hooks
from tests.helpers.tiny_trainer import build

FIXTURE = Path(tests.__file__).resolve().parent / "data" / "format"


def test_a_trained_optimizer_is_restored_into_its_own_tensors(tmp_path):
    root = tmp_path / "none"
    shutil.copytree(FIXTURE / "none", root)
    with np.load(FIXTURE / "expected.npz", allow_pickle=False) as f:
        want = {k: f[k] for k in f.files}
    model, opt, sched = build(seed=13)
    for _ in range(2):  # some training: the optimizer holds state for every trained parameter
        opt.zero_grad()
        model(torch.randint(0, 16, (4, 8))).float().pow(2).mean().backward()
        opt.step()
    before = {(p, k): t for p, st in opt.state.items() for k, t in st.items() if isinstance(t, torch.Tensor)}
    assert before, "the optimizer holds no state to restore into"
    info = trainer_hooks.restore(model, opt, source=str(root), scheduler=sched, job="format")
    assert info.iteration == 4
    kept = 0
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), torch.from_numpy(want[f"param/{name}"])), name
        for k in ("exp_avg", "exp_avg_sq", "step"):
            if f"{k}/{name}" not in want:
                continue
            got = opt.state[p][k]
            assert torch.equal(
                got.detach().to(torch.float32).reshape(want[f"{k}/{name}"].shape), torch.from_numpy(want[f"{k}/{name}"])
            )
            kept += got is before.get((p, k))
    assert kept == len([k for k in before if f"{k[1]}/" + _name(model, k[0]) in want])


def _name(model: torch.nn.Module, p: torch.Tensor) -> str:
    return next(n for n, q in model.named_parameters() if q is p)
