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
import tempfile
from collections.abc import Callable
from typing import BinaryIO

from shadow.config.choices import Dtype, Format, WeightFormat
from shadow.core.snapshot import Snapshot
from shadow.export._torch import require_torch

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
    if not isinstance(out, str) or not out.strip():
        raise ValueError("out= is empty: name the file (or directory) to write, e.g. out=ckpt.pt")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise FileNotFoundError(
            f"cannot write {out}: the directory {parent} does not exist; create it first "
            f"(mkdir -p {parent}) or choose another out="
        )


def _umask_mode(base: int) -> int:
    """``base`` (0o666 for a file, 0o777 for a directory) under this process's umask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return base & ~mask


def _via_tmp(out: str, write: Callable[[BinaryIO], object]) -> None:
    """``write(f)`` into a fresh temporary file beside ``out`` (created exclusively, never
    through a link someone left at a predictable name), then renamed onto ``out``: ``out``
    is whole or untouched (a link at ``out`` is replaced, not followed), and the temporary
    file is removed on any failure."""
    parent, base = os.path.split(os.path.abspath(out))
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{base}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), _umask_mode(0o666))
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _into_dir(out: str, what: str, write: Callable[[str], object]) -> str:
    """``write(tmp)`` into a fresh private directory beside ``out`` (no one else can enter
    it while it fills), then renamed onto ``out``, which must be missing or an empty
    directory; the temporary directory is removed on any failure."""
    if os.path.lexists(out) and (os.path.islink(out) or not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(
            f"cannot write {what} to {out}: it exists and is not an empty directory; remove it or choose another out="
        )
    parent, base = os.path.split(os.path.abspath(out.rstrip("/") or out))
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{base}.", suffix=".tmp")
    try:
        write(tmp)
        os.chmod(tmp, _umask_mode(0o777))
        if os.path.isdir(out) and not os.path.islink(out):
            os.rmdir(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export(snap: Snapshot, out: str, fmt: str | Format) -> str:
    """Write ``snap`` to ``out`` in ``fmt`` (a :class:`~shadow.config.choices.Format` or its name);
    returns what was written."""
    fmt = Format.parse(fmt, "format")
    check_out(out)
    torch = require_torch(f"writing a checkpoint in format={fmt}")
    from shadow.export import state

    sd = state.state_dicts(snap)
    if fmt == "torch":
        _via_tmp(out, lambda f: torch.save(sd, f))
        return out
    aliases = state.aliases(snap)
    if fmt == "hf_trainer":
        return _hf_trainer(torch, sd, aliases, snap, out)
    if fmt == "lightning":
        return _lightning(torch, sd, snap, out)
    if fmt == "safetensors":
        from safetensors.torch import save

        weights = {k: v.contiguous() for k, v in sd["model"].items() if k not in aliases}
        meta = {"job": snap.job, "iteration": str(snap.iteration), "aliases": json.dumps(aliases)}
        _via_tmp(out, lambda f: f.write(save(weights, metadata=meta)))
        return out
    import torch.distributed.checkpoint as dcp

    names = [p.name for p in snap.layout.params]
    tensors = {"model": dict(sd["model"]), "optimizer": _fqn_optimizer(sd, names)}

    def write(tmp: str) -> None:
        dcp.save(tensors, checkpoint_id=tmp, no_dist=True)
        with open(os.path.join(tmp, "shadow.json"), "w") as f:
            json.dump({"job": snap.job, "iteration": snap.iteration, "scheduler_in": "torch format only"}, f)

    return _into_dir(out, "a DCP checkpoint", write)


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
        from safetensors.torch import save

        meta = {"job": snap.job, "iteration": str(snap.iteration), "dtype": dtype.value, "aliases": json.dumps(aliases)}
        _via_tmp(out, lambda f: f.write(save(weights, metadata=meta)))
    else:
        full = dict(weights)
        for alias, name in aliases.items():
            full[alias] = full[name]  # torch.save keeps the tie
        _via_tmp(out, lambda f: torch.save(full, f))
    return {
        "tensors": len(weights),
        "bytes": sum(v.numel() * v.element_size() for v in weights.values()),
        "aliases": aliases,
    }


#: the extra state's entry trainer_hooks.integrations.hf records the Trainer's state in
HF_KEY = "transformers"
#: the extra state's entry trainer_hooks.integrations.lightning records the loops' state in
LIGHTNING_KEY = "lightning"


def _lightning(torch, sd: dict, snap: Snapshot, out: str) -> str:
    """A Lightning checkpoint file at ``out`` (what ``Trainer.fit(ckpt_path=...)`` loads):
    the module's state dict, the optimizer's and the scheduler's, the precision plugin's
    scaler and the loops' state as Lightning's own checkpoint of that batch holds them (taken
    at the end of the batch, where Lightning saves)."""
    extra = sd["extra_state"]
    rec = extra.get(LIGHTNING_KEY) if isinstance(extra, dict) else None
    if not isinstance(rec, dict) or not isinstance(rec.get("loops"), dict):
        raise ValueError(
            f"iteration {snap.iteration} of job {snap.job!r} was not recorded by trainer_hooks.integrations.lightning "
            "(its extra state holds no loop state); format=lightning writes Lightning runs only: use format=torch"
        )
    ckpt = {
        "epoch": rec["epoch"],
        "global_step": snap.iteration,
        "pytorch-lightning_version": rec["version"],
        "state_dict": sd["model"],
        "loops": rec["loops"],
        "callbacks": {},
        "optimizer_states": [sd["optimizer"]],
        "lr_schedulers": [sd["scheduler"]] if sd["scheduler"] is not None else [],
    }
    if sd["scaler"] is not None and rec.get("precision"):
        ckpt[rec["precision"]] = sd["scaler"]  # the precision plugin's own key: its scaler's state
    _via_tmp(out, lambda f: torch.save(ckpt, f))
    return out


def _hf_trainer(torch, sd: dict, aliases: dict, snap: Snapshot, out: str) -> str:
    """A transformers ``Trainer`` checkpoint directory at ``out`` (created; an existing one
    must be empty): ``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``
    (with a GradScaler), ``trainer_state.json`` and every rank's ``rng_state_{r}.pth``
    (``rng_state.pth`` for one rank), as the Trainer saves them; ``resume_from_checkpoint``
    then skips the batches the run consumed and sets each rank's RNGs where they were."""
    import numpy as np
    from safetensors.torch import save_file

    extra = sd["extra_state"]
    rec = extra.get(HF_KEY) if isinstance(extra, dict) else None
    if not isinstance(rec, dict) or not isinstance(rec.get("state"), str):
        raise ValueError(
            f"iteration {snap.iteration} of job {snap.job!r} was not recorded by trainer_hooks.integrations.hf "
            "(its extra state holds no Trainer state); format=hf_trainer writes Trainer runs only: use "
            "format=torch"
        )
    trainer_state = json.loads(rec["state"])
    k = snap.iteration
    trainer_state["global_step"] = k
    per_epoch, steps_in_epoch, accum = rec["updates_per_epoch"], rec["steps_in_epoch"], rec["accumulation"]
    if per_epoch and steps_in_epoch:  # the Trainer's own formula, after its step k
        epoch, u = divmod(k, per_epoch)
        done = min(u * accum, steps_in_epoch) if u else steps_in_epoch
        trainer_state["epoch"] = (epoch if u else epoch - 1) + done / steps_in_epoch if k else 0.0

    def write(tmp: str) -> None:
        weights = {n: v.contiguous() for n, v in sd["model"].items() if n not in aliases}
        save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        torch.save(sd["optimizer"], os.path.join(tmp, "optimizer.pt"))
        if sd["scheduler"] is not None:
            torch.save(sd["scheduler"], os.path.join(tmp, "scheduler.pt"))
        if sd["scaler"] is not None:
            torch.save(sd["scaler"], os.path.join(tmp, "scaler.pt"))
        with open(os.path.join(tmp, "trainer_state.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
        world = len(sd["rng"])
        for r, rng in enumerate(sd["rng"]):
            n = rng["numpy"]
            hf = {
                "python": rng["python"],
                "numpy": (
                    n["bit_generator"],
                    n["key"].numpy().astype(np.uint32),
                    n["pos"],
                    n["has_gauss"],
                    n["cached_gaussian"],
                ),
                "cpu": rng["torch"],
            }
            if "cuda" in rng:
                hf["cuda"] = rng["cuda"]
            torch.save(hf, os.path.join(tmp, f"rng_state_{r}.pth" if world > 1 else "rng_state.pth"))

    return _into_dir(out, "a Trainer checkpoint", write)
