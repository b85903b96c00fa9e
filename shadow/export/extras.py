"""The read side of the model state outside the optimizer ("extras"): the chunks a
snapshot holds turned back into tensors, and the key scheme and index format the trainer
writes them in (``trainer_hooks.capture.extras`` captures and sends them). Imports torch: load
it only where torch is needed (see :mod:`shadow.export`).

Chunk ``c`` of tensor ``j`` is stored under :func:`key` ``(j, c)``. Tensor :data:`INDEX`
is the index (names, dtypes, shapes, aliases, state-dict order), a msgpack map of format
:data:`FORMAT` behind its 8-byte length.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from shadow.core.errors import LayoutMismatchError
from shadow.export import blob

INDEX = 0  # tensor number of the index
FORMAT = 1


def key(j: int, c: int) -> int:
    """The chunk key of chunk ``c`` of tensor ``j``."""
    return (j << 32) | c


def _assemble(chunks: dict[int, Any], j: int, nbytes: int, chunk: int, what: str) -> torch.Tensor:
    out = torch.empty(nbytes, dtype=torch.uint8)
    dst = out.numpy()
    for c, lo in enumerate(range(0, nbytes, chunk)):
        part = chunks.get(key(j, c))
        want = min(chunk, nbytes - lo)
        if part is None or len(part) != want:
            raise LayoutMismatchError(f"the checkpoint lacks part {c} of {what} (or it has the wrong size)")
        dst[lo : lo + want] = np.frombuffer(part, dtype=np.uint8)
    return out


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise LayoutMismatchError(f"the checkpoint holds a tensor of unknown dtype {name!r}")
    return dt


def read_index(chunks: dict[int, Any]) -> dict | None:
    """The index of a snapshot's extras; None for a checkpoint taken without them."""
    first = chunks.get(key(INDEX, 0))
    if first is None:
        return None
    (n,) = struct.unpack_from("<Q", first)
    # one chunk, or several of which all but the last are full: the first one's size is the chunk size
    raw = _assemble(chunks, INDEX, n + 8, len(first), "the extras index").numpy()[8:].tobytes()
    index = blob.unpack(raw)
    if index.get("format") != FORMAT:
        raise LayoutMismatchError(f"the checkpoint's extras are in format {index.get('format')!r}, not {FORMAT}")
    return index


def decode(chunks: dict[int, Any]) -> tuple[OrderedDict, dict, list] | None:
    """``(name -> tensor, alias -> name, state-dict order)`` from a snapshot's extras
    chunks, or None when the checkpoint has none (taken before they were recorded)."""
    index = read_index(chunks)
    if index is None:
        return None
    out: OrderedDict = OrderedDict()
    for j, (name, dtype, shape) in enumerate(index["tensors"], start=1):
        dt = _dtype(dtype)
        numel = 1
        for s in shape:
            numel *= int(s)
        raw = _assemble(chunks, j, numel * dt.itemsize, index["chunk"], repr(name))
        out[name] = raw.view(dt).reshape(shape) if numel else torch.empty(shape, dtype=dt)
    return out, dict(index["aliases"]), list(index["order"])


def model_state(params: OrderedDict, chunks: dict[int, Any], blob0: dict) -> OrderedDict:
    """The whole model state dict of a snapshot: its layout ``params`` (name -> tensor),
    the extras decoded from ``chunks`` (or, for a checkpoint taken without them, the
    buffers rank 0's blob carried) and every alias, in the model's own key order."""
    model = OrderedDict(params)
    decoded = decode(chunks)
    aliases = dict(blob0.get("aliases") or {})
    if decoded is None:
        model.update(blob0.get("buffers") or {})
    else:
        model.update(decoded[0])
        aliases.update(decoded[1])
    for alias, name in aliases.items():
        model[alias] = model[name]  # tied weights: the same tensor under both keys
    if decoded is not None and set(decoded[2]) == set(model):
        model = OrderedDict((k, model[k]) for k in decoded[2])
    return model


def snapshot_aliases(chunks: dict[int, Any], blob0: dict) -> dict[str, str]:
    """Every state-dict key of a snapshot that names an already-named tensor."""
    index = read_index(chunks)
    return {**(blob0.get("aliases") or {}), **(index["aliases"] if index is not None else {})}


def recorded(chunks: dict[int, Any]) -> list[str] | None:
    """Names of the extras a snapshot holds; None for a checkpoint taken without them."""
    index = read_index(chunks)
    return None if index is None else [t[0] for t in index["tensors"]]
