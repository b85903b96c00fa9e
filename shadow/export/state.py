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


def param_groups(blobs: dict, count: int) -> list[dict]:
    """The optimizer's param groups (without their parameters) from the commit records:
    rank 0's, or, for pipeline stages, each stage's at its place (``groups_at``)."""
    staged = {r: b for r, b in blobs.items() if "groups_at" in b and "param_groups" in b}
    if not staged:
        return blobs[0]["param_groups"]
    out: list = [None] * count
    for _, b in sorted(staged.items()):
        at = b["groups_at"]
        for k, g in enumerate(b["param_groups"]):
            if isinstance(at, int) and 0 <= at + k < count and out[at + k] is None:
                out[at + k] = g
    missing = [i for i, g in enumerate(out) if g is None]
    if missing:
        raise ValueError(
            f"the checkpoint holds no settings for param groups {missing} (a pipeline stage's record is missing)"
        )
    return out


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
    groups = param_groups(blobs, snap.layout.num_groups)
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
    out_groups = []
    for gi, g in enumerate(groups):
        g = dict(g)
        g["params"] = [i for i, spec in enumerate(snap.layout.params) if spec.group == gi]
        out_groups.append(g)
    ranks = [blobs[r] for r in sorted(blobs)]
    return {
        "model": model,
        "optimizer": {"state": state, "param_groups": out_groups},
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
