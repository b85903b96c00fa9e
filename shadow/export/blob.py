"""Encoding of trainer-side state (RNG, scheduler, extra state, param groups) into the
opaque commit blob: msgpack with two extension types, never pickle. The trainer packs
(``trainer_hooks``), restore and the exporters unpack; one module keeps the two sides in
step. Imports torch: load it only where torch is needed (see :mod:`shadow.export`).

* ext 1: a CPU tensor: ``[dtype name, shape, raw bytes]``;
* ext 2: a tuple (msgpack would otherwise turn it into a list).
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

_EXT_TENSOR = 1
_EXT_TUPLE = 2
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class EncodeError(TypeError):
    """A value cannot travel in a commit record."""


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise EncodeError(f"tensors of dtype {obj.dtype} cannot be stored in a commit record")
        t = obj.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return msgpack.ExtType(_EXT_TENSOR, msgpack.packb([name, list(t.shape), raw], use_bin_type=True))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    raise EncodeError(
        f"a {type(obj).__name__} cannot be stored in a commit record; use numbers, strings, bytes, "
        "lists, tuples, dicts and tensors"
    )


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TENSOR:
        name, shape, raw = msgpack.unpackb(data, raw=False)
        if name not in _DTYPES:
            raise ValueError(f"commit record holds a tensor of unknown dtype {name!r}")
        dtype = _DTYPES[name]
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()
    if code == _EXT_TUPLE:
        return tuple(unpack(data))
    raise ValueError(f"commit record holds an unknown extension type {code}")


def pack(obj: Any) -> bytes:
    """Encode ``obj`` (raises :class:`EncodeError` naming the offending value's path)."""
    try:
        return _pack(obj)
    except EncodeError as exc:
        path = _find_bad(obj, "")
        raise EncodeError(f"{path or 'value'}: {exc}") from None


_PLAIN = (type(None), bool, int, float, str, bytes, torch.Tensor)


def _find_bad(obj: Any, path: str) -> str | None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            found = _find_bad(v, f"{path}[{k!r}]")
            if found is not None:
                return found
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found = _find_bad(v, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return None if isinstance(obj, _PLAIN) else path


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext_hook)
