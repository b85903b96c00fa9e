"""The replay reproduces CUDA's optimizers bit for bit, on CPU: every array of every step of
what torch 2.11's CUDA kernels computed on an H200 (``tests/data/cuda_optim.npz``, the
first 2048 elements of a 32768-element capture: the band of magnitudes from 1e-12 to 1e4
and the zero gradients are elements 0..1039)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shadow.core.optimizers import AdamGroup, SgdGroup
from shadow.kernels import ReplayPlan, segments_for_range

DATA = np.load(Path(__file__).resolve().parents[1] / "data" / "cuda_optim.npz")
N = DATA["p0"].shape[0]
ADAM = {  # config -> (impl, lr, betas, eps, weight decay, decoupled)
    "adamw_fused": ("cuda_fused", 3e-4, (0.9, 0.95), 1e-8, 0.1, True),
    "adamw_foreach": ("cuda_foreach", 3e-4, (0.9, 0.95), 1e-8, 0.1, True),
    "adamw_single": ("cuda_single", 3e-4, (0.9, 0.95), 1e-8, 0.1, True),
    "adam_fused_l2": ("cuda_fused", 3e-4, (0.9, 0.999), 1e-8, 0.01, False),
    "adam_foreach_l2": ("cuda_foreach", 3e-4, (0.9, 0.999), 1e-8, 0.01, False),
}
SGD = {"sgd_nesterov_foreach": "cuda_foreach", "sgd_nesterov_fused": "cuda_fused"}


def _same(got: np.ndarray, name: str) -> None:
    want = DATA[name]
    diff = int(np.count_nonzero(got.view(np.uint32) != want.view(np.uint32)))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{name}: {diff} of {len(want)} elements differ"


@pytest.mark.parametrize("config", sorted(ADAM))
def test_adam_replay_matches_cuda_bit_for_bit(config):
    impl, lr, betas, eps, wd, decoupled = ADAM[config]
    plan = ReplayPlan(segments_for_range([0], [N], [0], 0, N, impl, 16, 8), impl, 512)
    group = AdamGroup(lr=lr, betas=betas, eps=eps, weight_decay=wd, amsgrad=False, maximize=False, decoupled=decoupled)
    p, m, v = DATA["p0"].copy(), np.zeros(N, np.float32), np.zeros(N, np.float32)
    for k in (1, 2, 3):
        plan.prepare([group], np.array([float(k)]), set(), None)
        plan.apply(p, m, v, np.zeros(0, np.float32), DATA[f"g{k}"].copy(), threads=False)
        _same(p, f"{config}.s{k}.param")
        _same(m, f"{config}.s{k}.exp_avg")
        _same(v, f"{config}.s{k}.exp_avg_sq")


@pytest.mark.parametrize("config", sorted(SGD))
def test_sgd_replay_matches_cuda_bit_for_bit(config):
    impl = SGD[config]
    plan = ReplayPlan(segments_for_range([0], [N], [0], 0, N, impl, 16, 8), impl, 512, "sgd")
    group = SgdGroup(lr=0.01, momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=True, maximize=False)
    p, buf = DATA["p0"].copy(), np.zeros(N, np.float32)
    for k in (1, 2, 3):
        plan.fill([group], np.zeros(1), np.array([k > 1]), set())
        plan.apply(p, buf, DATA[f"g{k}"].copy(), threads=False)
        _same(p, f"{config}.s{k}.param")
        _same(buf, f"{config}.s{k}.momentum_buffer")


def test_the_fused_l2_lane_rule_counts_from_the_parameters_first_element():
    """A worker's range may start inside a parameter: the lane (element index % 4) is
    the parameter's, not the range's."""
    impl, lr, betas, eps, wd, decoupled = ADAM["adam_fused_l2"]
    group = AdamGroup(lr=lr, betas=betas, eps=eps, weight_decay=wd, amsgrad=False, maximize=False, decoupled=decoupled)
    for start in (1, 3, 6):  # the range [start, N) of the one parameter
        n = N - start
        plan = ReplayPlan(segments_for_range([0], [N], [0], start, N, impl, 16, 8), impl, 512)
        p, m, v = DATA["p0"][start:].copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
        for k in (1, 2, 3):
            plan.prepare([group], np.array([float(k)]), set(), None)
            plan.apply(p, m, v, np.zeros(0, np.float32), DATA[f"g{k}"][start:].copy(), threads=False)
        want = DATA["adam_fused_l2.s3.param"][start:]
        assert np.array_equal(p.view(np.uint32), want.view(np.uint32)), start


@pytest.mark.parametrize(
    "make, impl, want",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True), "fused", "fused"),
        (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01, amsgrad=True, fused=True), "fused", "fused"),
        (
            lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, dampening=0.1, nesterov=False, foreach=True),
            "foreach",
            "foreach",
        ),
    ],
)
def test_device_calibration_picks_the_rule_that_reproduces_the_optimizer(make, impl, want):
    """The calibration machinery, run on CPU tensors: the trainer's optimizer steps the
    probes (several tensors, sizes not multiples of 4, a view at an odd offset, a large
    lr * wd, a step count of 5000); the rule that reproduces every element is chosen and
    one that does not is measured in ulp."""
    from trainer_hooks.optim.calibrate import calibrate_device
    from trainer_hooks.optim.describe import calibrate

    opt = make([torch.nn.Parameter(torch.zeros(3))])
    kind = "sgd" if isinstance(opt, torch.optim.SGD) else "adam"
    wrong = "cuda_fused" if kind == "adam" else "fused"
    cal = calibrate_device(opt, torch.device("cpu"), kind, impl, candidates=(wrong, want), widths=calibrate()[:2])
    assert cal.impl == want and cal.bit_exact and cal.max_ulp == 0
    # the other rule does not reproduce it (CUDA's rounding; for SGD the CPU fused kernel's tail rule)
    assert cal.tried[wrong] > 0
    only_wrong = calibrate_device(opt, torch.device("cpu"), kind, impl, candidates=(wrong,), widths=calibrate()[:2])
    assert only_wrong.impl == wrong and not only_wrong.bit_exact and only_wrong.max_ulp == cal.tried[wrong]


def test_powers_come_from_the_device_table_not_the_workers_powf():
    from fractions import Fraction

    from shadow.kernels import powtab
    from shadow.kernels.replay import cuda_fused_scalars

    beta = 0.999
    ks = np.arange(1, 400)
    ref = powtab.reference(beta, ks)
    exact = [np.float32(float(Fraction(float(np.float32(beta))) ** int(k))) for k in ks[:40]]
    assert np.array_equal(ref[:40], np.asarray(exact, np.float32))  # the reference rounds close to exact
    assert powtab.limit(0.9) < powtab.limit(0.999) < powtab.limit(0.9999) <= powtab.MAX_STEPS
    assert powtab.reference(beta, [powtab.limit(beta)])[0] < powtab.TINY
    # a device whose powf is an ulp off at k = 7 and 300: exactly those travel, and are used
    device = ref.copy()
    device[[6, 299]] = np.nextafter(device[[6, 299]], np.float32(1))
    entries = [[powtab.bits(beta), powtab.exceptions(beta, device), powtab.limit(beta)]]
    assert [k for k, _ in entries[0][1]] == [7, 300] and powtab.check_entries(entries) is None
    table = powtab.PowTable(entries)
    assert table.pow(beta, 7) == device[6] and table.pow(beta, 8) == ref[7]
    one = cuda_fused_scalars(3e-4, 0.9, beta, 1e-8, 0.1, 7, powtab.PowTable())
    other = cuda_fused_scalars(3e-4, 0.9, beta, 1e-8, 0.1, 7, table)
    assert one[3] != other[3]  # bc2s follows the device's power


@pytest.mark.parametrize(
    "bad",
    [
        "x",
        [[1, [], 5, 0]],
        [["1", [], 5]],
        [[1, [[0, 5]], 5]],
        [[1, [[3, -1]], 5]],
        [[1, [[3]], 5]],
        [[1, [], 0]],
        [[1 << 33, [], 5]],
    ],
)
def test_a_malformed_power_table_is_refused_at_configure(bad):
    from shadow.core.layout import Layout
    from shadow.kernels import powtab
    from shadow.worker.configure import configure_problem

    assert powtab.check_entries(bad) is not None
    msg = {
        "layout": Layout.build([], 1).to_dict(),
        "start": 0,
        "stop": 0,
        "world": 1,
        "persist": {},
        "optim": {"kind": "adam", "impl": "cuda_fused", "pow": bad},
    }
    problem = configure_problem(msg)
    assert problem is not None and "replay descriptor is malformed" in problem
