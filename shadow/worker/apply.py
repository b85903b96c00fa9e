"""Applying prepared iterations on the coordinator's word (the cut), the divergence
audit of each, and the local tier's snapshot of a cut taken in the same pass. Imports no
torch."""

from __future__ import annotations

import logging
import time

import numpy as np

from shadow.wire import frames as F
from shadow.worker.commit import audit_shard
from shadow.worker.fetches import FetchServer
from shadow.worker.outbox import Outbox
from shadow.worker.state import WorkerState, go_stale

logger = logging.getLogger(__name__)


class Apply:
    """Applies the cut to ``state.assignment`` (``apply`` from the coordinator), audits it,
    snapshots it for the local tier, and reports the persister's results.

    Talks to the coordinator through ``outbox`` (``audited``, ``persisted``, ``stale``) and
    to ``fetches`` (shards being sent from the live state are let go before it changes;
    fetches waiting for an applied iteration are answered). Owned by the worker's main
    thread; the persister's threads only hand back reports that :meth:`report_persisted`
    drains."""

    def __init__(self, state: WorkerState, outbox: Outbox, fetches: FetchServer) -> None:
        self.state, self.outbox, self.fetches = state, outbox, fetches

    def through(self, epoch: int, iteration: int, persist: bool = False) -> None:
        """Apply every prepared iteration up to the cut ``iteration``; with ``persist``,
        snapshot the cut for the local tier -- in the apply pass itself when the cut is a
        gradient iteration applied now (the kernel writes the new values to the image
        too: no separate copy), else by copying."""
        w, s = self.state, self.state.assignment
        if s is None or epoch != s.epoch:
            return
        folded = None
        tried = False  # the apply pass asked the persister for an image of the cut (reported if none)
        if self.fetches.replies and (s.applied + 1 if s.applied >= 0 else s.base) <= iteration:
            self.fetches.wait_for_readers()
        while True:
            k = s.applied + 1 if s.applied >= 0 else s.base
            if k > iteration:
                break
            slot = s.inbox.slots.get(k)
            if slot is None or not s.inbox.complete(slot):
                self._stale(f"asked to apply iteration {k} that is not prepared here")
                return
            extras = {**s.extras, **slot.extras} if slot.extras else s.extras  # chunks are kept until replaced
            if slot.kind == F.Kind.STATE:
                try:
                    c = s.inbox.replay(slot)
                    s.state.install_meta(c["steps"], c["has_state"])
                except ValueError as exc:
                    self._stale(f"iteration {k} cannot be installed: {exc}")
                    return
            else:
                persister = s.persister if persist and k == iteration else None  # snapshots the cut in this pass
                img = persister.begin(k, s.epoch, s.world, slot.blobs, extras) if persister is not None else None
                tried = persister is not None
                t0 = time.perf_counter()
                try:
                    filled = s.state.apply(
                        s.inbox.grad_parts(slot),
                        s.inbox.replay(slot),
                        persister.field_views(img) if persister is not None and img is not None else None,
                    )
                    w.replay_s += time.perf_counter() - t0
                    w.replayed += 1
                except ValueError as exc:
                    if persister is not None and img is not None:
                        persister.abandon(img)
                    self._stale(f"iteration {k} cannot be applied: {exc}")
                    return
                if img is not None:
                    folded = (img, filled)
            s.inbox.release(k)
            s.applied = k
            if w.retired is not None:  # the new epoch holds its base: the old one is no longer needed
                w.retired = None
            s.blobs = slot.blobs
            s.extras = extras
            s.commit = s.inbox.replay(slot)
            audit = next((c.get("audit") for c in slot.commits if c.get("audit")), None)
            if audit:
                result = audit_shard(s.state, audit)
                if not s.exact and not result["ok"]:  # a GPU trainer: report the deviation, do not fail
                    result.update(ok=True, detail="deviation (not bit-exact by design): " + result["detail"])
                self.outbox.to_coord("audited", epoch=s.epoch, iteration=k, **result)
        if persist and not (tried and folded is None):  # else: begin() reported the cut skipped
            self._persist(iteration, folded)
        self.fetches.answer()

    def _persist(self, iteration: int, folded=None) -> None:
        """Finish the snapshot of ``iteration`` (``folded``: ``(image, filled)`` from the
        apply pass) or take it by copying."""
        s = self.state.assignment
        if s is None or s.persister is None:
            return
        if s.applied != iteration:
            rep = s.persister.report(iteration, s.epoch, "local", False, f"worker is at iteration {s.applied}")
            self.outbox.to_coord(rep.kind, **rep.fields())
            return
        commit = {k: v for k, v in s.commit.items() if k not in ("steps", "has_state", "sent")} if s.commit else None
        if folded is None:
            s.persister.snapshot(s.applied, s.epoch, s.world, s.blobs, commit, s.extras)
            return
        img, filled = folded
        if not filled:  # a skipped step: the kernel did not run
            for f, view in s.persister.field_views(img).items():
                np.copyto(view, s.state.array(f), casting="no")
        s.persister.finish(img, iteration, s.epoch, s.blobs, commit, s.extras)

    def report_persisted(self) -> None:
        """Tell the coordinator what the persister finished since the last call, and tally it."""
        s = self.state.assignment
        if s is None or s.persister is None:
            return
        for rep in s.persister.results():
            tally = self.state.persisted.setdefault(rep.tier, [0.0, 0, 0, 0])
            if rep.ok:
                tally[0] += rep.seconds
                tally[1] += 1
                tally[2] += rep.bytes
            elif not rep.skipped:  # a skip is not a failure
                tally[3] += 1
            self.outbox.to_coord(rep.kind, **rep.fields())

    def _stale(self, reason: str) -> None:
        go_stale(self.state, self.outbox, reason)
