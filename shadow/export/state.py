"""A :class:`~shadow.core.snapshot.Snapshot` as plain torch state dicts: what ``restore`` loads
into a live model and what every exporter writes. Imports torch: load it only where torch
is needed (see :mod:`shadow.export`)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from shadow.core import optimizers
from shadow.core.snapshot import Snapshot
from shadow.export import blob, extras
from shadow.wire.frames import Field


def _flat(snap: Snapshot, field: Field, i: int) -> torch.Tensor:
    spec = snap.layout.params[i]
    arr = snap.arrays[field][spec.offset : spec.offset + spec.numel]
    return torch.from_numpy(arr).view(spec.shape)


def state_dicts(snap: Snapshot) -> dict:
    """``{"model", "optimizer", "scheduler", "iteration", "rng", "extra_state", ...}``
    with ordinary torch state dicts, loadable with ``load_state_dict``."""
    blobs = {r: blob.unpack(b) for r, b in snap.blobs.items()}
    b0 = blobs[0]
    if snap.placed:  # received straight into the live model's parameters
        params = OrderedDict((spec.name, t) for spec, t in zip(snap.layout.params, snap.placed, strict=True))
    else:
        params = OrderedDict((spec.name, _flat(snap, Field.PARAM, i)) for i, spec in enumerate(snap.layout.params))
    model = extras.model_state(params, snap.extras, b0)  # with frozen params, buffers, aliases
    groups = b0["param_groups"]
    state: dict[int, dict] = {}
    optim = optimizers.spec_of(snap.optim)
    fields = optim.fields(snap.optim)
    for i, spec in enumerate(snap.layout.params):
        if not snap.has_state[i]:
            continue
        st = {"step": torch.tensor(float(snap.steps[i]), dtype=torch.float32)} if optim.has_step else {}
        for key, field in optim.export_keys(groups[spec.group], fields):
            st[key] = _flat(snap, field, i)
        state[i] = st
    param_groups = []
    for gi, g in enumerate(groups):
        g = dict(g)
        g["params"] = [i for i, spec in enumerate(snap.layout.params) if spec.group == gi]
        param_groups.append(g)
    ranks = [blobs[r] for r in sorted(blobs)]
    return {
        "model": model,
        "optimizer": {"state": state, "param_groups": param_groups},
        "scheduler": b0.get("scheduler"),
        "scaler": b0.get("scaler"),
        "iteration": snap.iteration,
        "rng": [b["rng"] for b in ranks],
        "extra_state": b0.get("extra_state"),
        "extra_state_by_rank": [b.get("extra_state") for b in ranks],
        "job": snap.job,
    }


def aliases(snap: Snapshot) -> dict[str, str]:
    """Every model state-dict key of ``snap`` that names an already-named tensor (tied
    weights): ``alias -> name``."""
    return extras.snapshot_aliases(snap.extras, blob.unpack(snap.blobs[0]))
