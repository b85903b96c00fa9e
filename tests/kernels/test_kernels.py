"""Replay kernels vs torch's own optimizers, bit for bit (``torch.equal``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tests.kernel_harness import run_pair, run_pair_sgd, update_ulps
from trainer_hooks.optim.describe import calibrate, cpu_sqrt_table

SIZES = [1, 15, 17, 31, 33, 1000, 1000003]
CASES = list(itertools.product((torch.optim.Adam, torch.optim.AdamW), (0.0, 0.1), (False, True), (False, True)))


def test_calibration_matches_this_cpu():
    vec, tail, exact = calibrate()
    assert exact, f"no kernel widths reproduce torch's fused Adam on {torch.backends.cpu.get_cpu_capability()}"
    assert vec % tail == 0


@pytest.mark.parametrize(
    "cls,wd,amsgrad,maximize", CASES, ids=[f"{c.__name__}-wd{w}-ams{a}-max{m}" for c, w, a, m in CASES]
)
def test_fused_bit_identical(cls, wd, amsgrad, maximize):
    theirs, ours = run_pair(cls, "fused", SIZES, steps=3, lr=1e-3, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    for key in theirs:
        for n, a, b in zip(SIZES, theirs[key], ours[key], strict=True):
            assert torch.equal(a, b), f"{key} of a {n}-element tensor differs in {(a != b).sum()} elements"


@pytest.mark.parametrize("scale", [65536.0, 0.25, 3000.0, 1e-3], ids=["pow2", "pow2-below-1", "other", "other-below-1"])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_fused_grad_scale(cls, scale):
    """The fused step divides by GradScaler's scale; the replay multiplies by the
    reciprocal where that rounds alike (a power of two) and divides otherwise."""
    theirs, ours = run_pair(
        cls, "fused", [7, 100, 4099], steps=3, clip=0.5, grad_scale=scale, lr=1e-2, weight_decay=0.1
    )
    for key in theirs:
        for a, b in zip(theirs[key], ours[key], strict=True):
            assert torch.equal(a, b), f"{key} differs in {(a != b).sum()} elements"


def test_exact_reciprocal():
    from shadow.kernels.replay import exact_reciprocal

    assert exact_reciprocal(65536.0) == np.float32(2.0**-16)
    assert exact_reciprocal(2.0**-126) == np.float32(2.0**126)
    assert exact_reciprocal(2.0**127) == np.float32(2.0**-127)  # subnormal, still exact
    for x in (3000.0, 0.0, float("inf"), float("nan"), 1.5, 2.0**-149):  # 2**149 overflows float32
        assert exact_reciprocal(x) is None, x
    assert exact_reciprocal(-4.0) == np.float32(-0.25)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.95)], ids=["small-lerp-weight", "large-lerp-weight"])
def test_fused_hyperparameters_and_clip(betas):
    theirs, ours = run_pair(
        torch.optim.AdamW, "fused", [7, 100, 4099], steps=4, clip=0.5, lr=3e-2, betas=betas, eps=1e-6, weight_decay=0.01
    )
    for key in theirs:
        for a, b in zip(theirs[key], ours[key], strict=True):
            assert torch.equal(a, b), key


def test_fused_across_shard_boundaries():
    # a parameter split across three workers replays exactly as a whole
    theirs, ours = run_pair(torch.optim.AdamW, "fused", [5, 12345, 77], steps=3, shards=3, weight_decay=0.1)
    for key in theirs:
        for a, b in zip(theirs[key], ours[key], strict=True):
            assert torch.equal(a, b), key


UNFUSED_SIZES = [1, 15, 17, 33, 1000, 100003]


@pytest.mark.parametrize("impl", ["single", "foreach"])
@pytest.mark.parametrize(
    "cls,wd,amsgrad,maximize", CASES, ids=[f"{c.__name__}-wd{w}-ams{a}-max{m}" for c, w, a, m in CASES]
)
def test_unfused_bit_identical(impl, cls, wd, amsgrad, maximize):
    """torch's single-tensor (its default on CPU) and foreach paths, with this CPU's square
    roots measured at attach (``shadow.core.sqrttab``)."""
    theirs, ours = run_pair(
        cls, impl, UNFUSED_SIZES, steps=4, clip=0.5, lr=1e-3, weight_decay=wd, amsgrad=amsgrad, maximize=maximize
    )
    for key in theirs:
        for n, a, b in zip(UNFUSED_SIZES, theirs[key], ours[key], strict=True):
            assert torch.equal(a, b), f"{key} of a {n}-element tensor differs in {(a != b).sum()} elements"


@pytest.mark.parametrize("impl", ["single", "foreach"])
def test_unfused_needs_the_cpu_s_square_roots(impl):
    """Without the table (IEEE square roots) the parameters drift where torch's sqrt is not
    correctly rounded; the moments, which take no square root, match either way."""
    table, note = cpu_sqrt_table()
    if table is None:
        pytest.skip(f"torch's CPU sqrt is IEEE's on this machine ({note}): no table to need")
    theirs, ours = run_pair(
        torch.optim.AdamW, impl, [17, 1000, 100003], steps=3, lr=1e-3, weight_decay=0.1, sqrt_table=False
    )
    for key in ("exp_avg", "exp_avg_sq"):
        for a, b in zip(theirs[key], ours[key], strict=True):
            assert torch.equal(a, b), key
    differing = sum(int((a != b).sum()) for a, b in zip(theirs["param"], ours["param"], strict=True))
    worst = max(update_ulps(a, b, 1e-3) for a, b in zip(theirs["param"], ours["param"], strict=True))
    assert differing > 0 and worst <= 8.0, (differing, worst)


SGD_CASES = [
    dict(momentum=0.0),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.1, weight_decay=0.01),
    dict(momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(momentum=0.5, dampening=0.3, maximize=True),
]


@pytest.mark.parametrize("impl", ["fused", "foreach", "single"])
@pytest.mark.parametrize("case", SGD_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sgd_bit_identical(impl, case):
    theirs, ours = run_pair_sgd(impl, SIZES, steps=4, lr=0.05, **case)
    for key in theirs:
        for n, a, b in zip(SIZES, theirs[key], ours[key], strict=True):
            assert torch.equal(a, b), f"{key} of a {n}-element tensor differs in {(a != b).sum()} elements"


def test_interleave_gives_each_thread_every_t_th_row():
    """numba's static schedule hands thread t the t-th contiguous block of rows;
    interleaved, those are rows t, t + T, ... of the original order."""
    from shadow.kernels.replay import interleave

    work = np.arange(5 * 5, dtype=np.int64).reshape(5, 5)
    assert np.array_equal(interleave(work, 2)[:, 0], [0, 10, 20, 5, 15])
    assert np.array_equal(interleave(work, 3)[:, 0], [0, 15, 5, 20, 10])
    assert interleave(work, 1) is work and np.array_equal(interleave(work[:2], 4), work[:2])
    for t in (2, 3, 4):
        assert sorted(interleave(work, t)[:, 0].tolist()) == work[:, 0].tolist()
