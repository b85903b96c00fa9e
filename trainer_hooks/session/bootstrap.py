"""Bootstrap (and resync): stream this rank's stripe of the full state to the workers as
STATE frames for iteration ``base``, then the bootstrap commit (through the attachment)."""

from __future__ import annotations

import numpy as np
import torch

from shadow.layout import intersect, stripe_bounds
from shadow.wire import frames as F
from trainer_hooks import _fsdp, _optim, _rng
from trainer_hooks.session.items import StateItem
from trainer_hooks.session.recorder import Commit
from trainer_hooks.session.transfer import HostCopy


def bootstrap(att, carry: tuple | None) -> None:
    """Queue iteration ``att.handshake.base``: STATE frames of this rank's stripe, then its
    commit. ``carry`` is the ``(rng, extra)`` the last commit recorded when re-attaching
    mid-run (resync, ``add_param_group``); without it, what the training loop holds now."""
    t, base, shards = att.target, att.handshake.base, list(att.handshake.shards)
    opt_state = t.optimizer.state
    sgd = t.optim_desc["kind"] == "sgd"
    fields = F.state_fields(t.optim_desc)
    key = _optim.STATE_KEYS[t.optim_desc["kind"]]
    sent = [0] * len(shards)
    if t.fsdp is not None:
        _local_state(att, fields, key, sent)
    else:
        _stripe_state(att, fields, key, sent)
    steps, has_state = [], []
    for p in t.params:
        st = opt_state.get(p, {})
        steps.append(float(st["step"]) if "step" in st else 0.0)
        has_state.append(st.get("momentum_buffer") is not None if sgd else "step" in st)
    replay = {
        "iteration": base,
        "rank": t.rank,
        "groups": _optim.wire_groups(t.optimizer),
        "skipped": [],
        "clip": None,
        "bootstrap": True,
        "steps": steps,
        "has_state": has_state,
    }
    if carry is not None:
        rng, extra = carry
    else:
        extra_state = att.options.extra_state
        rng, extra = _rng.capture(), HostCopy(extra_state() if extra_state is not None else None)
    att.queue_commit(Commit(base, replay, rng, extra, sent))


def split(shards: list, lo: int, hi: int) -> list[list[tuple[int, int, int]]]:
    """Runs ``(src relative to lo, dst, n)`` of flat ``[lo, hi)`` per worker."""
    out = []
    for shard in shards:
        cut = intersect((lo, hi), shard)
        out.append([(cut[0] - lo, cut[0], cut[1] - cut[0])] if cut else [])
    return out


def _stripe_state(att, fields, key, sent: list) -> None:
    """DDP: every rank holds everything and streams its stripe of the flat space."""
    t, base, shards = att.target, att.handshake.base, list(att.handshake.shards)
    opt_state = t.optimizer.state
    lo, hi = stripe_bounds(t.layout.total, t.world)[t.rank]
    runs = split(shards, lo, hi)
    if hi > lo:
        for field in fields:
            data = np.zeros(hi - lo, dtype=np.float32)
            for spec, p in zip(t.layout.params, t.params, strict=True):
                cut = intersect((spec.offset, spec.offset + spec.numel), (lo, hi))
                if cut is None:
                    continue
                src = p.detach() if field == F.Field.PARAM else opt_state.get(p, {}).get(key[field])
                if src is None:
                    continue
                flat = src.detach().reshape(-1)[cut[0] - spec.offset : cut[1] - spec.offset]
                data[cut[0] - lo : cut[1] - lo] = flat.to("cpu", torch.float32).numpy()
            att.sender.q.put(StateItem(base, field, data, runs))
            for w, r in enumerate(runs):
                sent[w] += sum(n for _, _, n in r)


def _local_state(att, fields, key, sent: list) -> None:
    """FSDP2/HSDP: every rank streams its stripe of its own rows (the local tensors of the
    parameters and their optimizer state)."""
    t, base = att.target, att.handshake.base
    shards = t.fsdp
    opt_state = t.optimizer.state
    lo, hi = shards.stripe()
    runs = shards.runs([True] * len(t.params), list(att.handshake.shards))
    if hi <= lo:
        return
    for field in fields:
        data = np.zeros(hi - lo, dtype=np.float32)
        for i, src, dst, n in shards.pieces(lo, hi):
            p = t.params[i]
            value = p.detach() if field == F.Field.PARAM else opt_state.get(p, {}).get(key[field])
            if value is None:
                continue
            flat = _fsdp.local(value).detach().reshape(-1)[src : src + n]
            data[dst : dst + n] = flat.to("cpu", torch.float32).numpy()
        att.sender.q.put(StateItem(base, field, data, runs))
        for w, r in enumerate(runs):
            sent[w] += sum(m for _, _, m in r)
