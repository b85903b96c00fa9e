"""Retention: which checkpoints of a job a tier keeps, and deleting the rest."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import fsspec

from shadow.persist import checkpoints, fsglob

logger = logging.getLogger(__name__)


def retain(root: str, job: str, keep: int, busy: Iterable[int] = ()) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints, and torn directories older
    than the newest complete one, except those of the iterations in ``busy`` (still being
    written: a newer checkpoint can complete first). Never deletes anything if none is
    complete."""
    if keep <= 0:
        return []
    done = checkpoints.list_checkpoints(root, job=job)
    if not done:
        return []
    fs, _ = fsspec.core.url_to_fs(root)
    newest, busy = (done[-1].generation, done[-1].iteration), set(busy)

    def stale(d: str) -> bool:  # torn, older than the newest complete one, and not being written
        key = checkpoints.dir_key(d)
        return key is not None and key < newest and key[1] not in busy

    victims = [c.path for c in done[:-keep]] + [d for d in checkpoints.list_torn(root, job) if stale(d)]
    for d in victims:
        try:
            fs.rm(fsglob.literal(fs, d), recursive=True)
        except OSError as exc:
            logger.warning("retention could not delete %s: %s", d, exc)
    return victims
