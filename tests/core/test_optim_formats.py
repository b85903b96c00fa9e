"""The optimizer formats the registry must keep byte for byte: the descriptor ``describe``
sends at attach (keys, their order, the kind strings), the state arrays each descriptor
keeps (wire ``Field`` ids, on-disk entry names) and the optimizer state dict an export
builds (keys and their order per parameter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shadow.core.fields import Field
from shadow.core.optimizers import state_fields
from shadow.core.snapshot import Snapshot
from shadow.export import blob
from shadow.export.state import state_dicts
from trainer_hooks.capture.model import build_layout
from trainer_hooks.optim.describe import describe

P, M, V, X = Field.PARAM, Field.EXP_AVG, Field.EXP_AVG_SQ, Field.MAX_EXP_AVG_SQ


def test_field_ids_and_entry_names_are_fixed():
    assert [(f.name.lower(), int(f)) for f in Field] == [
        ("grad", 0),
        ("param", 1),
        ("exp_avg", 2),
        ("exp_avg_sq", 3),
        ("max_exp_avg_sq", 4),
    ]


@pytest.mark.parametrize(
    ("desc", "fields"),
    [
        ({"kind": "adam", "amsgrad_any": False, "momentum_any": False}, (P, M, V)),
        ({"kind": "adam", "amsgrad_any": True, "momentum_any": False}, (P, M, V, X)),
        ({"kind": "adam"}, (P, M, V)),
        ({"kind": "sgd", "amsgrad_any": False, "momentum_any": True}, (P, M)),
        ({"kind": "sgd", "amsgrad_any": False, "momentum_any": False}, (P,)),
        ({"kind": "sgd"}, (P,)),
    ],
)
def test_state_fields_per_descriptor(desc, fields):
    assert state_fields(desc) == fields


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))


KEYS = ["kind", "impl", "vec_width", "tail_width", "bit_exact", "amsgrad_any", "momentum_any"]


@pytest.mark.parametrize(
    ("make", "want"),
    [
        (lambda ps: torch.optim.AdamW(ps, fused=True), {"kind": "adam", "impl": "fused", "amsgrad_any": False}),
        (lambda ps: torch.optim.Adam(ps, amsgrad=True, fused=True), {"kind": "adam", "amsgrad_any": True}),
        (lambda ps: torch.optim.Adam(ps, foreach=True), {"kind": "adam", "impl": "foreach"}),
        (
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
            {"kind": "sgd", "impl": "fused", "momentum_any": True, "amsgrad_any": False},
        ),
        (
            lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
            {"kind": "sgd", "impl": "single", "momentum_any": False},
        ),
    ],
    ids=["adamw-fused", "adam-amsgrad-fused", "adam-foreach", "sgd-momentum-fused", "sgd-single"],
)
def test_descriptor_keys_order_and_values(make, want):
    d = describe(make(_model().parameters()))
    extra = [k for k in ("sqrt",) if k in d]  # the CPU's square root table, where it is not IEEE's
    assert list(d) == KEYS + extra
    assert d["bit_exact"] is True and isinstance(d["vec_width"], int) and isinstance(d["tail_width"], int)
    for k, v in want.items():
        assert d[k] == v, k
    if d["kind"] == "sgd" or d["impl"] == "fused":
        assert "sqrt" not in d
    if d["kind"] == "adam":
        assert d["momentum_any"] is False
    else:
        assert d["amsgrad_any"] is False


def _snapshot(opt: torch.optim.Optimizer, model: torch.nn.Module, desc: dict) -> Snapshot:
    layout, params = build_layout(model, opt)
    n = layout.total if hasattr(layout, "total") else sum(p.numel for p in layout.params)
    arrays = {f: np.arange(n, dtype=np.float32) + 10 * int(f) for f in state_fields(desc)}
    groups = opt.state_dict()["param_groups"]
    b = blob.pack({"param_groups": groups, "rng": None})
    return Snapshot(
        job="j",
        iteration=3,
        layout=layout,
        optim=desc,
        world=1,
        arrays=arrays,
        steps=np.full(len(params), 3.0),
        has_state=np.ones(len(params), dtype=bool),
        blobs={0: b},
        source="test",
    )


@pytest.mark.parametrize(
    ("make", "desc", "keys"),
    [
        (
            lambda ps: torch.optim.AdamW(ps),
            {"kind": "adam", "amsgrad_any": False, "momentum_any": False},
            ["step", "exp_avg", "exp_avg_sq"],
        ),
        (
            lambda ps: torch.optim.Adam(ps, amsgrad=True),
            {"kind": "adam", "amsgrad_any": True, "momentum_any": False},
            ["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
        ),
        (
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            {"kind": "sgd", "amsgrad_any": False, "momentum_any": True},
            ["momentum_buffer"],
        ),
    ],
    ids=["adamw", "adam-amsgrad", "sgd-momentum"],
)
def test_exported_optimizer_state_keys_and_values(make, desc, keys):
    model = _model()
    opt = make(model.parameters())
    snap = _snapshot(opt, model, desc)
    st = state_dicts(snap)["optimizer"]["state"]
    assert sorted(st) == list(range(len(snap.layout.params)))
    for i, spec in enumerate(snap.layout.params):
        assert list(st[i]) == keys
        for k in keys:
            if k == "step":
                assert st[i][k].dtype == torch.float32 and float(st[i][k]) == 3.0
                continue
            field = {"exp_avg": M, "exp_avg_sq": V, "max_exp_avg_sq": X, "momentum_buffer": M}[k]
            want = snap.arrays[field][spec.offset : spec.offset + spec.numel]
            assert np.array_equal(st[i][k].reshape(-1).numpy(), want)


def test_each_group_map_decodes_as_its_own_optimizer():
    from shadow.core import optimizers

    for spec in optimizers.SPECS.values():
        fields = {"number": 0.5, "flag": False, "pair": [0.9, 0.99]}
        d = {k: fields[kind] for k, kind in spec.group.WIRE.items()}
        g = optimizers.group_from_wire(d)
        assert type(g) is spec.group and g.to_wire() == d
    with pytest.raises(ValueError, match="Adam param group lacks key 'amsgrad'"):
        optimizers.ADAM.group.from_wire(
            {"lr": 1.0, "betas": [0.9, 0.99], "eps": 1.0, "weight_decay": 0.0, "maximize": False}
        )
    with pytest.raises(ValueError, match="not supported by this build"):
        optimizers.spec("rmsprop")
