"""A worker's slot token: what lets its restarted process take its slot back.

When a worker process dies, its slot stays reserved for a grace period
(``Tuning.slot_grace_s``): only a register carrying the slot's token (the coordinator hands
it out in the first ``registered`` of that slot) takes it back before then, so another
process cannot take the slot, and the state a peer copy or a resync would send it, while
the real one restarts. The token is kept in a file of this user's own
(:func:`shadow.security.private.state_dir`), one per coordinator address and slot, so a process
started again on the same host finds it; a host without a private state directory keeps
none (its restarted worker waits out the grace period)."""

from __future__ import annotations

import hashlib
import logging
import os
import time

from shadow.security.private import state_dir

logger = logging.getLogger(__name__)

TOKEN_BYTES = 16
KEEP_S = 7 * 86400  # token files untouched this long (clusters long gone) are removed on the next save


def _path(coordinator: str, worker_id: int) -> str | None:
    base = state_dir()
    if base is None or worker_id < 0:
        return None
    where = hashlib.sha256(coordinator.encode()).hexdigest()[:16]
    return os.path.join(base, "slots", f"{where}-{worker_id}.token")


def load(coordinator: str, worker_id: int) -> bytes | None:
    """The token this host keeps for slot ``worker_id`` of the cluster at ``coordinator``."""
    path = _path(coordinator, worker_id)
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        token = f.read(TOKEN_BYTES + 1)
    return token if len(token) == TOKEN_BYTES else None


def save(coordinator: str, worker_id: int, token: bytes) -> None:
    """Keep ``token`` for slot ``worker_id`` (0600, replaced whole); a failure is logged."""
    path = _path(coordinator, worker_id)
    if path is None or len(token) != TOKEN_BYTES:
        return
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(token)
        os.replace(tmp, path)
        _forget_old(os.path.dirname(path))
    except OSError as exc:
        logger.warning("cannot keep the slot token in %s (%s): a restart waits out the grace period", path, exc)


def _forget_old(directory: str) -> None:
    now = time.time()
    for entry in os.scandir(directory):
        try:
            if entry.name.endswith(".token") and now - entry.stat(follow_symlinks=False).st_mtime > KEEP_S:
                os.unlink(entry.path)
        except OSError:
            continue
