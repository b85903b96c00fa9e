"""The commit of iteration k: what the workers need to replay it (hyperparameters as used,
skipped params, clip and scaler factors) and what a restore needs besides the arrays
(RNG, extra state, scheduler/scaler), released once the scheduler has stepped, behind
the model state outside the optimizer that changed (``_extras``)."""
from __future__ import annotations

from typing import Any

import msgpack
import torch

from shadow.errors import ShadowError
from trainer_hooks import _audit, _codec, _optim, _rng
from trainer_hooks._extras import ExtrasTracker
from trainer_hooks._sender import CommitItem


class CommitMixin:
    """Session methods: recording and emitting each iteration's commit."""

    def _record(self, k: int, sent: list, skip: bool, grad_scale) -> None:
        replay = {"iteration": k, "rank": self.rank, "groups": _optim.replay_groups(self.optimizer),
                  "skipped": [i for i, p in enumerate(self.params) if p.grad is None],
                  "clip": self._clip, "inv_scale": self._inv_scale,
                  "grad_scale": None if grad_scale is None else float(torch.as_tensor(grad_scale).float().item()),
                  "skip_step": bool(skip), "bootstrap": False,
                  "tokens": int(self.tokens()) if self.tokens is not None else None}
        self._clip = self._inv_scale = None
        audit = None
        if self.audit_every and k % self.audit_every == 0 and not skip and self.rank == 0:
            audit = _audit.sample(self, k)
        extra = self.extra_state() if self.extra_state is not None else None
        rng = _rng.capture()
        self._last_record = (rng, extra)  # a resync bootstrap right after k records these, not later draws
        self._pending = (k, replay, rng, extra, sent, audit)
        self._awaiting = {name for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler))
                          if obj is not None}
        if not self._awaiting:
            self._emit_pending()
        self._throttle(k)
        self._raise_latched()

    def _done(self, what: str) -> None:
        """The scheduler/scaler stepped: once all have, the pending commit leaves."""
        self._awaiting.discard(what)
        if not self._awaiting:
            self._emit_pending()

    def _emit_pending(self) -> None:
        if self._pending is None:
            return
        if self.degraded is not None:
            self._pending = None
            return
        k, replay, rng, extra, sent, audit = self._pending
        self._pending = None
        self._queue_commit(k, replay, rng, extra, sent, audit)

    def _queue_commit(self, k: int, replay: dict, rng: dict, extra: Any, sent: list, audit: list | None = None) -> None:
        blob_obj: dict = {"rank": self.rank, "world": self.world, "rng": rng, "extra_state": extra}
        if self.rank == 0:
            blob_obj["param_groups"] = [{k2: v for k2, v in g.items() if k2 != "params"}
                                        for g in self.optimizer.param_groups]
            blob_obj["scheduler"] = self.scheduler.state_dict() if self.scheduler is not None else None
            blob_obj["scaler"] = self.scaler.state_dict() if self.scaler is not None else None
            blob_obj["aliases"] = self._aliases
        try:
            blob = _codec.pack(blob_obj)
        except _codec.EncodeError as exc:
            raise ShadowError(f"cannot record iteration {k}: {exc} (check what extra_state returns)") from None
        extras = self._emit_extras(k, bool(replay["bootstrap"]))
        nshards = max(w.get("shard", i) for i, w in enumerate(self.workers)) + 1
        bodies = []
        for w in range(len(self.shards)):
            owner = self.workers[w].get("shard", w) == self.rank % nshards  # every replica of that shard
            rec = dict(replay, sent=sent[w])
            if extras is not None and extras[w]:
                rec["extras"] = extras[w]  # EXTRA chunks sent ahead of this commit
            if audit is not None and audit[w] is not None:
                rec["audit"] = audit[w]
            bodies.append(msgpack.packb({"replay": rec, "blob": blob if owner else None}, use_bin_type=True))
        self.sender.q.put(CommitItem(k, bodies))
        self._last_emitted = k

    def _emit_extras(self, k: int, bootstrap: bool) -> list[int] | None:
        """Rank 0: queue the model state outside the optimizer that changed in ``k``
        (all of it at a bootstrap, which starts a new epoch); chunks per worker."""
        if self.rank != 0:
            return None
        if bootstrap or getattr(self, "_extras", None) is None:
            self._extras = ExtrasTracker(self.model, self.params, self.workers)
        return self._extras.emit(k, self.sender.q, everything=bootstrap)
