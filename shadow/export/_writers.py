"""Writing a checkpoint out in standard formats: a torch state-dict file, a
``torch.distributed.checkpoint`` directory, or the model weights as safetensors.

torch (and the modules here that need it) is imported inside the writers, after the
arguments are checked: importing this module costs nothing on a host without torch, and
a writer called there raises :class:`~shadow.export.TorchMissingError`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable

from shadow.choices import Dtype, Format, WeightFormat
from shadow.export._torch import require_torch
from shadow.snapshot import Snapshot

FORMATS = Format.values()
WEIGHT_FORMATS = WeightFormat.values()
DTYPES = Dtype.values()  # what export_weights casts floating tensors to


def _fqn_optimizer(sd: dict, names: list[str]) -> dict:
    """The optimizer state dict keyed by parameter name, as ``get_state_dict`` returns it
    (the form DCP saves and reshards)."""
    state = {names[i]: st for i, st in sd["optimizer"]["state"].items()}
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in sd["optimizer"]["param_groups"]]
    return {"state": state, "param_groups": groups}


def check_out(out: str) -> None:
    """Refuse an ``out`` whose parent directory does not exist, before any work is done
    (the write would otherwise fail only at the end, after reading the whole checkpoint)."""
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise FileNotFoundError(
            f"cannot write {out}: the directory {parent} does not exist; create it first "
            f"(mkdir -p {parent}) or choose another out="
        )


def _via_tmp(out: str, write: Callable[[str], object]) -> None:
    """``write(tmp)``, then rename ``tmp`` onto ``out``: ``out`` is whole or untouched, and
    the temporary file is removed on any failure."""
    tmp = out + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def export(snap: Snapshot, out: str, fmt: str | Format) -> str:
    """Write ``snap`` to ``out`` in ``fmt`` (a :class:`~shadow.choices.Format` or its name);
    returns what was written."""
    fmt = Format.parse(fmt, "format")
    check_out(out)
    torch = require_torch(f"writing a checkpoint in format={fmt}")
    from shadow.export import state

    sd = state.state_dicts(snap)
    if fmt == "torch":
        _via_tmp(out, lambda tmp: torch.save(sd, tmp))
        return out
    aliases = state.aliases(snap)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        weights = {k: v.contiguous() for k, v in sd["model"].items() if k not in aliases}
        meta = {"job": snap.job, "iteration": str(snap.iteration), "aliases": json.dumps(aliases)}
        _via_tmp(out, lambda tmp: save_file(weights, tmp, metadata=meta))
        return out
    import torch.distributed.checkpoint as dcp

    names = [p.name for p in snap.layout.params]
    tensors = {"model": dict(sd["model"]), "optimizer": _fqn_optimizer(sd, names)}
    created = not os.path.exists(out)
    try:
        dcp.save(tensors, checkpoint_id=out, no_dist=True)
        with open(os.path.join(out, "shadow.json"), "w") as f:
            json.dump({"job": snap.job, "iteration": snap.iteration, "scheduler_in": "torch format only"}, f)
    except BaseException:
        if created:  # a half-written directory is not a checkpoint
            shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def export_weights(
    snap: Snapshot,
    out: str,
    fmt: str | WeightFormat = WeightFormat.safetensors,
    dtype: str | Dtype = Dtype.float32,
) -> dict:
    """Write the model weights of ``snap`` (no optimizer state) to ``out`` as safetensors
    or a torch state-dict file, floating tensors cast to ``dtype``. Tied weights are
    written once (safetensors refuses shared storage) and named in the metadata.
    Returns ``{"tensors", "bytes", "aliases"}``."""
    fmt = WeightFormat.parse(fmt, "format", "weights only; export() writes the whole training state")
    dtype = Dtype.parse(dtype, "dtype")
    check_out(out)
    torch = require_torch(f"writing model weights in format={fmt}")
    from shadow.export import state

    sd = state.state_dicts(snap)["model"]
    aliases = state.aliases(snap)
    cast = getattr(torch, dtype.value)
    weights = {k: (v.to(cast) if v.is_floating_point() else v).contiguous() for k, v in sd.items() if k not in aliases}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        meta = {"job": snap.job, "iteration": str(snap.iteration), "dtype": dtype.value, "aliases": json.dumps(aliases)}
        _via_tmp(out, lambda tmp: save_file(weights, tmp, metadata=meta))
    else:
        full = dict(weights)
        for alias, name in aliases.items():
            full[alias] = full[name]  # torch.save keeps the tie
        _via_tmp(out, lambda tmp: torch.save(full, tmp))
    return {
        "tensors": len(weights),
        "bytes": sum(v.numel() * v.element_size() for v in weights.values()),
        "aliases": aliases,
    }
