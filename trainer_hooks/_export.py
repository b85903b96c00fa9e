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
WEIGHT_FORMATS = ("safetensors", "torch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def export_weights(snap: Snapshot, out: str, fmt: str = "safetensors", dtype: str = "float32") -> dict:
    """Write the model weights of ``snap`` (no optimizer state) to ``out`` as safetensors
    or a torch state-dict file, floating tensors cast to ``dtype``. Tied weights are
    written once (safetensors refuses shared storage) and named in the metadata.
    Returns ``{"tensors", "bytes", "aliases"}``."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"format={fmt!r} is not supported for weights; choose one of {WEIGHT_FORMATS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {tuple(DTYPES)}")
    sd = state_dicts(snap)["model"]
    aliases = unpack(snap.blobs[0]).get("aliases") or {}
    cast = DTYPES[dtype]
    weights = {k: (v.to(cast) if v.is_floating_point() else v).contiguous() for k, v in sd.items() if k not in aliases}
    tmp = out + ".tmp"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(weights, tmp, metadata={"job": snap.job, "iteration": str(snap.iteration), "dtype": dtype,
                                          "aliases": json.dumps(aliases)})
    else:
        full = dict(weights)
        for alias, name in aliases.items():
            full[alias] = full[name]  # torch.save keeps the tie
        torch.save(full, tmp)
    os.replace(tmp, out)
    return {"tensors": len(weights), "bytes": sum(v.numel() * v.element_size() for v in weights.values()),
            "aliases": aliases}
