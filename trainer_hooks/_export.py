"""Writing a checkpoint out in standard formats: a torch state-dict file, a
``torch.distributed.checkpoint`` directory, or the model weights as safetensors."""
from __future__ import annotations

import json
import os

import torch

from shadow.restore import Snapshot
from trainer_hooks._codec import unpack
from trainer_hooks._restore import state_dicts

FORMATS = ("torch", "dcp", "safetensors")


def _fqn_optimizer(sd: dict, names: list[str]) -> dict:
    """The optimizer state dict keyed by parameter name, as ``get_state_dict`` returns it
    (the form DCP saves and reshards)."""
    state = {names[i]: st for i, st in sd["optimizer"]["state"].items()}
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in sd["optimizer"]["param_groups"]]
    return {"state": state, "param_groups": groups}


def export(snap: Snapshot, out: str, fmt: str) -> str:
    """Write ``snap`` to ``out`` in ``fmt``; returns what was written."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not supported; choose one of {FORMATS}")
    sd = state_dicts(snap)
    if fmt == "torch":
        tmp = out + ".tmp"
        torch.save(sd, tmp)
        os.replace(tmp, out)
        return out
    aliases = (unpack(snap.blobs[0]).get("aliases") or {})
    if fmt == "safetensors":
        from safetensors.torch import save_file

        weights = {k: v.contiguous() for k, v in sd["model"].items() if k not in aliases}
        meta = {"job": snap.job, "iteration": str(snap.iteration), "aliases": json.dumps(aliases)}
        save_file(weights, out, metadata=meta)
        return out
    import torch.distributed.checkpoint as dcp

    names = [p.name for p in snap.layout.params]
    state = {"model": dict(sd["model"]), "optimizer": _fqn_optimizer(sd, names)}
    dcp.save(state, checkpoint_id=out, no_dist=True)
    with open(os.path.join(out, "shadow.json"), "w") as f:
        json.dump({"job": snap.job, "iteration": snap.iteration, "scheduler_in": "torch format only"}, f)
    return out
