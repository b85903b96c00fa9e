"""The commit blob's encoding (msgpack, never pickle): it lives with its readers in
:mod:`shadow.export.blob`; the trainer side packs through this name."""

from shadow.export.blob import EncodeError, pack, unpack

__all__ = ["EncodeError", "pack", "unpack"]
