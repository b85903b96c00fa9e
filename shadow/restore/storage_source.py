"""A persisted tier as a restore source: :class:`TierSource` (it loads the tiers' readers
and codecs, which a restore from memory never needs)."""

from __future__ import annotations

import posixpath

from shadow.core.snapshot import Snapshot
from shadow.persist import checkpoints
from shadow.restore.sources import COMPLETE, DIVERGED, INCOMPLETE, SUPERSEDED, UNREADABLE, Candidate
from shadow.storage import Storage, storage_for


class TierSource:
    """A persisted tier (``root``: a path, a URL or a :class:`Storage`): its complete
    checkpoints (each manifest read), then its torn and unreadable ones. Loading verifies
    checksums unless ``check=False``. No timeout of its own: the storage's apply.

    ``sign_key``: the manifest key (:mod:`shadow.persist.signing`); with it, a checkpoint
    whose manifest is unsigned or fails its signature is listed ``unreadable`` (it may have
    been tampered with), never offered for loading. None: signatures are not checked."""

    def __init__(self, name: str, root: str | Storage, check: bool = True, sign_key: bytes | None = None) -> None:
        self.name, self.check, self.sign_key = name, check, sign_key
        self._root = root
        self._storage: Storage | None = root if isinstance(root, Storage) else None

    @property
    def root(self) -> str:
        return self._root.url if isinstance(self._root, Storage) else self._root

    @property
    def storage(self) -> Storage:
        """Made on first use (a remote back end that cannot load fails inside the listing)."""
        if self._storage is None:
            self._storage = storage_for(self.root)
        return self._storage

    def candidates(self, job: str | None) -> list[Candidate]:
        skipped: list[tuple[str, str]] = []
        out = [
            Candidate(
                c.job,
                c.iteration,
                self.name,
                c.path,
                DIVERGED if c.diverged else SUPERSEDED if c.superseded else COMPLETE,
                c.generation,
                c.manifest.get("created"),
                c.bytes,
                c.raw_bytes,
                handle=c,
            )
            for c in checkpoints.list_checkpoints(self.storage, self.name, job, skipped, self.sign_key)
        ]
        for d in checkpoints.list_torn(self.storage, job):
            generation, iteration = checkpoints.dir_key(d) or (0, -1)
            out.append(Candidate(d.rstrip("/").split("/")[-2], iteration, self.name, d, INCOMPLETE, generation))
        for mpath, reason in skipped:
            d = posixpath.dirname(mpath)
            key = checkpoints.dir_key(d)
            # a manifest's job is its directory's parent; a generation record's, its directory
            job_dir = posixpath.basename(posixpath.dirname(d) if key else d)
            out.append(Candidate(job_dir, key[1] if key else None, self.name, mpath, UNREADABLE, None, error=reason))
        return out

    def load(self, candidate: Candidate, progress=None) -> Snapshot:
        return checkpoints.load(candidate.handle, self.check, progress)
