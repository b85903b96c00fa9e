"""Any fsspec back end (object stores, shared file systems reached by URL, ``memory://``)
as a :class:`~shadow.storage.base.Storage`.

fsspec reads ``*``, ``?`` and ``[`` as glob syntax not only in ``glob`` but also in ``rm``
and ``mv``/``copy`` (on every file system but the local one). A root such as
``s3://b/ckpt[1]`` would then match nothing, or worse, a sibling's files: :meth:`rm` and
:meth:`move` here take their paths literally.
"""

from __future__ import annotations

import builtins
import glob
import posixpath
import re
from collections.abc import Mapping
from typing import Any, BinaryIO

import fsspec

from shadow.storage.base import Storage

_MAGIC = re.compile(r"[*?[]")
#: object stores: no directories, only keys; making one would create a missing bucket instead
#: of reporting it (s3fs's makedirs does), so nothing is made
_NO_DIRECTORIES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}
#: S3 clients wait this long at most (botocore's defaults: 60 s per connect and read, several
#: retries): an endpoint that never answers must cost a checkpoint, not the coordinator's loop
_S3_DEFAULTS = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 3}},
    "max_concurrency": 4,  # parts of one multipart upload in flight at once
}


class FsspecStorage(Storage):
    """A tier behind an fsspec URL. Writes are made atomic by writing ``<path>.tmp`` and
    moving it over ``path`` (what the back end offers; an object store's move is a copy
    and a delete, and the manifest written last is still the commit marker)."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        given = dict(options or {})
        if url.startswith(("s3://", "s3a://")):
            given = {**_S3_DEFAULTS, **given}
        self.fs, self.base = fsspec.core.url_to_fs(url, **given)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple | list) else (self.fs.protocol,)
        self.keys_only = bool(set(protocols) & _NO_DIRECTORIES)

    def write_atomic(self, path: str, data: bytes, parents: bool = False) -> None:
        if parents:
            self.makedirs(posixpath.dirname(path))
        self.fs.pipe_file(path + ".tmp", data)
        self.move(path + ".tmp", path)

    def read_into(self, path: str, out: memoryview, offset: int = 0) -> int:
        with self.fs.open(path, "rb") as f:
            f.seek(offset)
            data = f.read(len(out))
        out[: len(data)] = data
        return len(data)

    # the rest of the fsspec file system's own calls, one call each where the defaults make several

    def cat(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    def list(self, pattern: str) -> list[str]:
        return self.fs.glob(pattern)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def isdir(self, path: str) -> bool:
        return self.fs.isdir(path)

    def info(self, path: str) -> dict:
        return self.fs.info(path)

    def ls(self, path: str) -> builtins.list[dict]:
        return self.fs.ls(path, detail=True)

    def rm(self, path: str, recursive: bool = True) -> None:
        self.fs.rm(glob.escape(path), recursive=recursive)

    def put_file(self, src: str, path: str) -> None:
        self.fs.put_file(src, path)

    def open(self, path: str, mode: str = "rb") -> BinaryIO:
        return self.fs.open(path, mode)

    def makedirs(self, path: str) -> None:
        if not self.keys_only:
            self.fs.makedirs(path, exist_ok=True)

    def move(self, src: str, dst: str) -> None:
        if _MAGIC.search(src) or _MAGIC.search(dst):  # mv would read them as a pattern
            self.fs.cp_file(src, dst)
            self.fs.rm_file(src)
        else:
            self.fs.mv(src, dst)
