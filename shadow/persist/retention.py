"""Retention: which checkpoints of a job a tier keeps, and deleting the rest."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from shadow.persist import checkpoints
from shadow.storage import Storage, storage_for

logger = logging.getLogger(__name__)


def retain(root: str | Storage, job: str, keep: int, busy: Iterable[int] = ()) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints, and torn directories older
    than the newest complete one, except those of the iterations in ``busy`` (still being
    written: a newer checkpoint can complete first). Never deletes anything if none is
    complete."""
    if keep <= 0:
        return []
    st = storage_for(root)
    done = checkpoints.list_checkpoints(st, job=job)
    if not done:
        return []
    newest, busy = (done[-1].generation, done[-1].iteration), set(busy)

    def stale(d: str) -> bool:  # torn, older than the newest complete one, and not being written
        key = checkpoints.dir_key(d)
        return key is not None and key < newest and key[1] not in busy

    victims = [c.path for c in done[:-keep]] + [d for d in checkpoints.list_torn(st, job) if stale(d)]
    for d in victims:
        try:
            st.rm(d, recursive=True)
        except OSError as exc:
            logger.warning("retention could not delete %s: %s", d, exc)
    return victims
