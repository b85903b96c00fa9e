"""torch.optim.Adamax at attach: described through the optimizer registry alone (kind
``adamax``, its two state tensors), replayed bit for bit on this CPU by both of torch's
implementations, and refused where the replay cannot be exact."""

from __future__ import annotations

import pytest
import torch

from shadow.core import optimizers
from shadow.wire.frames import Field
from trainer_hooks.optim.describe import UnsupportedOptimizerError, describe, wire_groups


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))


@pytest.mark.parametrize("flags", [{"foreach": False}, {"foreach": True}, {}], ids=["single", "foreach", "default"])
def test_adamax_is_described_and_calibrated_exact(flags):
    opt = torch.optim.Adamax(_model().parameters(), lr=0.01, weight_decay=0.1, maximize=True, **flags)
    d = describe(opt)
    assert d == {"kind": "adamax", "impl": d["impl"], "vec_width": 16, "tail_width": 8, "bit_exact": True}
    assert d["impl"] == ("foreach" if flags.get("foreach") else "single")
    assert optimizers.state_fields(d) == (Field.PARAM, Field.EXP_AVG, Field.EXP_AVG_SQ)
    assert optimizers.spec_of(d).torch_key(Field.EXP_AVG_SQ) == "exp_inf"
    assert wire_groups(opt) == [{"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1, "maximize": True}]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: torch.optim.Adamax(ps, capturable=True), "capturable"),
        (lambda ps: torch.optim.Adamax(ps, differentiable=True), "capturable/differentiable"),
        (lambda ps: torch.optim.Adamax(ps, lr=torch.tensor(0.01)), "lr and betas given as tensors"),
        (lambda ps: torch.optim.Adamax(ps, betas=(torch.tensor(0.9), 0.999)), "lr and betas given as tensors"),
    ],
    ids=["capturable", "differentiable", "tensor-lr", "tensor-beta"],
)
def test_adamax_settings_the_replay_cannot_follow_are_refused(make, match):
    with pytest.raises(UnsupportedOptimizerError, match=match) as caught:
        describe(make(_model().parameters()))
    assert "torch.optim.Adamax" in str(caught.value)  # the refusal names what is replayed


def test_adamax_is_refused_when_calibration_finds_no_exact_rule(monkeypatch):
    from shadow.kernels import adamax

    # the CUDA rounding in place of the CPU's: the replay no longer matches torch here
    monkeypatch.setitem(adamax.RULES, "single", adamax.RULE_CUDA_FOREACH)
    with pytest.raises(UnsupportedOptimizerError, match=r"CPU Adamax \(single\).*deviates by up to \d+ ulp"):
        describe(torch.optim.Adamax(_model().parameters(), foreach=False))
    with pytest.warns(UserWarning, match="exact=False"):
        d = describe(torch.optim.Adamax(_model().parameters(), foreach=False), exact=False)
    assert d["kind"] == "adamax" and d["bit_exact"] is False


def test_an_adamax_subclass_is_not_replayed():
    class Mine(torch.optim.Adamax):
        pass

    with pytest.raises(UnsupportedOptimizerError, match="Mine is not supported"):
        describe(Mine(_model().parameters()))
