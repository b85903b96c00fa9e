"""Model state outside the optimizer's flat space ("extras"): parameters in no param group
(frozen layers) and persistent buffers, of any size and dtype.

Rank 0 captures all of them at attach (and at every resync, which attaches again), and
after that only what changed: each commit compares every tensor's ``_version`` and
identity with the captured ones -- no copy, no device sync, no hashing. A changed tensor
is copied once, non-blocking (:meth:`ExtrasTracker.capture`); on the sender thread
(:meth:`PendingExtras.finish`), once the copy landed, if its bytes differ from the last
ones sent (DDP's buffer broadcast rewrites buffers with the same values every forward) it
is cut into chunks of at most
``SHADOW_EXTRA_CHUNK_BYTES`` that leave as EXTRA frames ahead of that iteration's commit,
chunk ``c`` of tensor ``j`` under key ``j << 32 | c`` to the replicas of shard
``(j + c) % nshards``. Workers keep the newest chunk under each key (a chunk becomes
part of the state when its iteration is applied), so every applied iteration -- served
from memory or persisted -- holds the whole set, however rarely it is sent. Tensor 0 is
the index (names, dtypes, shapes, aliases, state-dict order), sent again only when it
changes. Changes made through ``.data`` or a numpy view do not move ``_version`` and are
not seen. Reading them back out of a snapshot (the key scheme and index format included)
is :mod:`shadow.export.extras`.
"""

from __future__ import annotations

import logging
import struct
from typing import Any

import numpy as np
import torch
import xxhash

from shadow.config.tuning import Tuning
from shadow.export import blob as _codec
from shadow.export.extras import FORMAT, INDEX, key
from trainer_hooks.capture.extras import collect
from trainer_hooks.capture.model import unwrap
from trainer_hooks.session.items import ExtraItem
from trainer_hooks.session.transfer import HostCopy

logger = logging.getLogger(__name__)

MESSAGE_BYTES = 64 << 20  # chunks per EXTRA message, at most this many bytes (or one chunk)
MESSAGE_RUNS = 4096


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter: checked by content each time
        return None


def _slot(m: torch.nn.Module, name: str):
    """``(dict, key)`` where module ``m`` keeps the tensor of state-dict key ``name``, so a
    reassigned parameter or buffer is noticed; None when a custom ``state_dict`` made it."""
    mod_name, _, attr = name.rpartition(".")
    try:
        mod = m.get_submodule(mod_name) if mod_name else m
    except AttributeError:
        return None
    for d in (mod._parameters, mod._buffers):
        if attr in d:
            return d, attr
    return None


class ExtrasTracker:
    """Rank 0's view of the extras of one attach epoch: what was sent, and what changed."""

    def __init__(self, model: torch.nn.Module, layout_params, workers: list[dict], tuning: Tuning) -> None:
        tensors, self.aliases, self.order = collect(model, layout_params)
        m = unwrap(model)
        self.names = list(tensors)
        self.tensors = list(tensors.values())
        self.slots = [_slot(m, n) for n in self.names]
        # the tensors of one module change together: BatchNorm's kernel updates the running
        # statistics without moving their _version, but num_batches_tracked's moves
        owner: dict[str, list[int]] = {}
        for j, n in enumerate(self.names):
            owner.setdefault(n.rpartition(".")[0], []).append(j)
        self.siblings = [owner[n.rpartition(".")[0]] for n in self.names]
        self.versions: list[int | None] = [None] * len(self.tensors)
        self.digests: list[bytes | None] = [None] * len(self.tensors)
        self.index_dirty = True
        self.chunk = max(1, min(tuning.extra_chunk_bytes, tuning.max_commit_bytes))
        shard_of = [w.get("shard", i) for i, w in enumerate(workers)]
        self.nshards = max(shard_of) + 1
        self.replicas = [[w for w, s in enumerate(shard_of) if s == shard] for shard in range(self.nshards)]
        self.nworkers = len(workers)

    def changed(self) -> list[int]:
        """Tensors whose version or identity moved since they were captured, with the
        other tensors of their modules (cheap: no copy, no device sync)."""
        out: set[int] = set()
        for j, t in enumerate(self.tensors):
            slot = self.slots[j]
            if slot is not None:
                cur = slot[0].get(slot[1])
                if cur is not None and cur is not t:
                    self.tensors[j] = t = cur  # reassigned: send the new tensor (and the index: its shape)
                    self.index_dirty = True
                    out.add(j)
            v = _version(t)
            if v is None or v != self.versions[j]:
                out.update(self.siblings[j])
        return sorted(out)

    def _index(self) -> bytes:
        raw = _codec.pack(
            {
                "format": FORMAT,
                "chunk": self.chunk,
                "aliases": self.aliases,
                "order": self.order,
                "tensors": [
                    [n, str(t.dtype).removeprefix("torch."), list(t.shape)]
                    for n, t in zip(self.names, self.tensors, strict=True)
                ],
            }
        )
        return struct.pack("<Q", len(raw)) + raw

    def capture(self, everything: bool = False) -> PendingExtras:
        """Training thread: copy what changed (all of it with ``everything``, at a
        bootstrap) to the host, non-blocking; :meth:`PendingExtras.finish` sends it."""
        todo = list(range(len(self.tensors))) if everything else self.changed()
        index = None
        if everything or self.index_dirty:
            index = np.frombuffer(self._index(), dtype=np.uint8)
            self.index_dirty = False
        for j in todo:
            self.versions[j] = _version(self.tensors[j])
        copies = HostCopy([self.tensors[j] for j in todo]) if todo else None
        return PendingExtras(self, everything, index, todo, copies)

    def emit(self, iteration: int, sender_q, everything: bool = False) -> list[int]:
        """:meth:`capture` and finish at once: queue the items on ``sender_q``; returns
        the number of chunks each worker gets for ``iteration``."""
        items, counts = self.capture(everything).finish(iteration)
        for item in items:
            sender_q.put(item)
        return counts

    def _items(self, iteration: int, pieces: list) -> tuple[list, list[int]]:
        counts = [0] * self.nworkers
        items: list = []
        self._queue(iteration, pieces, items, counts)
        return items, counts

    def _queue(self, iteration: int, pieces: list, out: list, counts: list[int]) -> None:
        runs: list[list] = [[] for _ in range(self.nworkers)]
        for j, buf in pieces:
            for c, lo in enumerate(range(0, len(buf), self.chunk)):
                view = buf[lo : lo + self.chunk]
                for w in self.replicas[(j + c) % self.nshards]:
                    runs[w].append((key(j, c), view))
        for w, rs in enumerate(runs):
            counts[w] = len(rs)
            start, size = 0, 0
            for i, (_, view) in enumerate(rs):  # messages of at most MESSAGE_BYTES (or one chunk)
                if i > start and (size + len(view) > MESSAGE_BYTES or i - start >= MESSAGE_RUNS):
                    out.append(ExtraItem(iteration, w, rs[start:i]))
                    start, size = i, 0
                size += len(view)
            if rs:
                out.append(ExtraItem(iteration, w, rs[start:]))


class PendingExtras:
    """Extras copied at a commit, on their way to the host."""

    def __init__(self, tracker: ExtrasTracker, everything: bool, index, todo: list[int], copies) -> None:
        self.tracker, self.everything, self.index, self.todo, self.copies = tracker, everything, index, todo, copies

    def finish(self, iteration: int) -> tuple[list, list[int]]:
        """Sender thread: wait for the copies; ``(EXTRA items, chunks per worker)`` of
        the tensors whose bytes differ from the last ones sent (all at a bootstrap)."""
        t = self.tracker
        if not self.todo and not self.everything and self.index is None:
            return [], [0] * t.nworkers
        pieces: list[tuple[int, Any]] = []  # (tensor number, uint8 array)
        if self.index is not None:
            pieces.append((INDEX, self.index))
        hosts = self.copies.get() if self.copies is not None else []
        for j, host in zip(self.todo, hosts, strict=True):
            buf = host.reshape(-1).view(torch.uint8).numpy() if host.numel() else np.empty(0, dtype=np.uint8)
            digest = xxhash.xxh3_128_digest(buf.data)
            if self.everything or digest != t.digests[j]:
                t.digests[j] = digest
                pieces.append((j + 1, buf))
        return t._items(iteration, pieces)


# -- restore ---------------------------------------------------------------------------------
