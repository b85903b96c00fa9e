"""What a reader checks before it opens a shard file a manifest names, and after.

A manifest is data found on storage, so the file it names must be the checkpoint's own:
a regular file inside the checkpoint directory (a link may point only at a regular file
in that same directory), exactly the size the manifest records -- checked before a byte
is read, so a FIFO never blocks a reader and ``/dev/zero`` is never read -- and the shard
ranges of a manifest must tile the flat space ``[0, total)`` exactly, or a restore would
hand out memory no shard wrote.
"""

from __future__ import annotations

import os
import posixpath
import stat


def local_file(directory: str, name: str, size: int) -> str:
    """The path of shard file ``name`` in local checkpoint ``directory``, once it is known
    to be a regular file inside it of ``size`` bytes; ``FileNotFoundError`` if it is
    missing, ``ValueError`` saying what is wrong otherwise."""
    path = os.path.join(directory, name)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        real, home = os.path.realpath(path), os.path.realpath(directory)
        if os.path.dirname(real) != home:
            raise ValueError(f"{path} is a link to {real}, outside the checkpoint directory")
        st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if st.st_size != size:
        raise ValueError(f"{path} is {st.st_size} bytes, manifest says {size}")
    return path


def remote_file(fs, directory: str, name: str, size: int) -> str:
    """The same checks through an fsspec file system (its ``info``)."""
    path = posixpath.join(directory, name)
    info = fs.info(path)
    if info.get("type") != "file":
        raise ValueError(f"{path} is not a regular file (a {info.get('type')})")
    if info.get("size") is not None and info["size"] != size:
        raise ValueError(f"{path} is {info['size']} bytes, manifest says {size}")
    return path


def tiling_problem(shards: list[dict], total: int) -> str | None:
    """What is wrong with the ranges of ``shards`` as a tiling of ``[0, total)``, or None."""
    at = 0
    for s in sorted(shards, key=lambda s: (s["start"], s["stop"])):
        if s["start"] != at:
            what = "overlap" if s["start"] < at else "leave a gap"
            return f"shard ranges do not tile [0, {total}): they {what} at element {min(at, s['start'])}"
        at = s["stop"]
    if at != total:
        return f"shard ranges do not tile [0, {total}): they end at element {at}"
    return None
