"""Which disk a worker's local tier is on, so a manifest can say where each shard lives.

A worker's local tier is a directory on its own host (``persist.local.dir``, or the
worker's own ``local_dir=``): a node-local disk, or storage several hosts share. The
first worker to use a directory leaves a mark in it, ``.shadow-disk``, holding a random
id; every worker that uses the same directory later (after a restart, or from another
host on a shared mount) reads the same id. A manifest names, for each shard, the disks
holding a copy (:func:`holder`), and a restore asks a live worker on one of them for the
file (:mod:`shadow.worker.files`), or reads it itself where the path is visible to it."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
import uuid

from shadow.storage import modes

logger = logging.getLogger(__name__)

MARK = ".shadow-disk"
_ID = re.compile(r"[0-9a-f]{32}")


def disk_id(root: str, file_mode: int = modes.FILE_MODE, dir_mode: int = modes.DIR_MODE) -> str:
    """The id of the disk under ``root`` (created with it if none is there yet). Raises
    ``OSError`` where the directory cannot be made or read, ``ValueError`` where its mark
    is not an id (then it is left as it is: someone else's file, or damage to look at)."""
    modes.makedirs(root, dir_mode)
    path = os.path.join(root, MARK)
    fresh = uuid.uuid4().hex
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), file_mode)
    except FileExistsError:
        pass
    else:
        try:
            os.fchmod(fd, file_mode)  # whatever the umask did to it
            os.write(fd, fresh.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    with open(path, "rb") as f:
        text = f.read(64).decode("ascii", "replace").strip()
    if not _ID.fullmatch(text):  # another worker may be writing it this very moment: look once more
        with contextlib.suppress(OSError):
            time.sleep(0.05)
            with open(path, "rb") as f:
                text = f.read(64).decode("ascii", "replace").strip()
    if not _ID.fullmatch(text):
        raise ValueError(f"{path} does not hold a disk id ({text[:40]!r}); remove it to let a worker write a new one")
    return text


def describe(root: str, file_mode: int = modes.FILE_MODE, dir_mode: int = modes.DIR_MODE) -> dict:
    """What a worker reports of its local tier: ``{"id", "dir", "host"}``; ``id`` is ""
    where the directory cannot be made or read, or holds a damaged mark (logged)."""
    root = os.path.abspath(root)
    try:
        ident = disk_id(root, file_mode, dir_mode)
    except (OSError, ValueError) as exc:
        logger.warning("local tier %s: cannot tell which disk it is on: %s", root, exc)
        ident = ""
    return {"id": ident, "dir": root, "host": socket.gethostname()}


def holder(worker: int, disk: dict | None) -> dict:
    """A manifest's record of one copy of a shard: the worker that wrote it and its disk."""
    d = disk or {}
    return {
        "worker": worker,
        "disk": str(d.get("id", "")),
        "dir": str(d.get("dir", "")),
        "host": str(d.get("host", "")),
    }
