"""Bootstrap (and resync): stream this rank's stripe of the full state to the workers as
STATE frames for iteration ``base``, then the bootstrap commit (through the attachment)."""

from __future__ import annotations

import bisect

import numpy as np
import torch
import xxhash

from shadow.core import optimizers
from shadow.core.layout import intersect, stripe_bounds
from shadow.wire import frames as F
from trainer_hooks.capture import fsdp as _fsdp
from trainer_hooks.capture import rng as _rng
from trainer_hooks.optim import describe as _optim
from trainer_hooks.session.items import StateItem
from trainer_hooks.session.recorder import Commit
from trainer_hooks.session.transfer import HostCopy


def bootstrap(att, carry: tuple | None) -> None:
    """Queue iteration ``att.handshake.base``: STATE frames of this rank's stripe, then its
    commit. ``carry`` is the ``(rng, extra)`` the last commit recorded when re-attaching
    mid-run (resync, ``add_param_group``); without it, what the training loop holds now."""
    t, base, shards = att.target, att.handshake.base, list(att.handshake.shards)
    opt_state = t.optimizer.state
    spec = optimizers.spec_of(t.optim_desc)
    fields = spec.fields(t.optim_desc)
    key = spec.state_keys()
    sent = [0] * len(shards)
    kept: list | None = [{} for _ in shards] if att.handshake.keep else None
    if t.fsdp is not None:
        _local_state(att, fields, key, sent, kept)
    else:
        _stripe_state(att, fields, key, sent, kept)
    steps, has_state = [], []
    for p in t.params:
        st = opt_state.get(p, {})
        steps.append(float(st["step"]) if "step" in st else 0.0)
        has_state.append(st.get(spec.has_state_key) is not None)
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
    att.queue_commit(Commit(base, replay, rng, extra, sent, kept=kept))


def split(shards: list, lo: int, hi: int) -> list[list[tuple[int, int, int]]]:
    """Runs ``(src relative to lo, dst, n)`` of flat ``[lo, hi)`` per worker."""
    out = []
    for shard in shards:
        cut = intersect((lo, hi), shard)
        out.append([(cut[0] - lo, cut[0], cut[1] - cut[0])] if cut else [])
    return out


def _stripe_state(att, fields, key, sent: list, kept: list | None) -> None:
    """DDP: every rank holds everything and streams its stripe of the flat space (with
    ``kept``, proves it instead: see :func:`prove`)."""
    t, base, shards = att.target, att.handshake.base, list(att.handshake.shards)
    opt_state = t.optimizer.state
    lo, hi = stripe_bounds(t.layout.total, t.world)[t.rank]
    runs = split(shards, lo, hi)
    if hi > lo and kept is not None:
        for field in fields:
            pieces = []
            for spec, p in zip(t.layout.params, t.params, strict=True):
                cut = intersect((spec.offset, spec.offset + spec.numel), (lo, hi))
                if cut is None:
                    continue
                src = p if field == F.Field.PARAM else opt_state.get(p, {}).get(key[field])
                if src is not None:
                    a, b = cut[0] - spec.offset, cut[1] - spec.offset
                    pieces.append((cut[0] - lo, src.detach().reshape(-1)[a:b]))
            prove(field, pieces, runs, kept, sent)
    elif hi > lo:
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


def _local_state(att, fields, key, sent: list, kept: list | None) -> None:
    """FSDP2/HSDP: every rank streams its stripe of its own rows (the local tensors of the
    parameters and their optimizer state); with ``kept``, proves it instead (:func:`prove`)."""
    t, base = att.target, att.handshake.base
    shards = t.fsdp
    opt_state = t.optimizer.state
    lo, hi = shards.stripe()
    runs = shards.runs([True] * len(t.params), list(att.handshake.shards))
    if hi <= lo:
        return
    if kept is not None:
        for field in fields:
            pieces = []
            for i, src, dst, n in shards.pieces(lo, hi):
                p = t.params[i]
                value = p if field == F.Field.PARAM else opt_state.get(p, {}).get(key[field])
                if value is not None:
                    pieces.append((dst, _fsdp.local(value).detach().reshape(-1)[src : src + n]))
            prove(field, pieces, runs, kept, sent)
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


#: zeros hashed where a stripe has no value (a parameter without optimizer state yet)
_ZEROS = np.zeros(1 << 16, dtype=np.float32)


def prove(field, pieces: list, runs: list, kept: list, sent: list) -> None:
    """Instead of sending ``field`` of a stripe, prove it: per worker, the xxh3-64 of every
    run ``(src in the stripe, dst, n)`` it would have been sent, over ``pieces`` (``(start in
    the stripe, 1-D tensor)`` in order; what they leave out counts as zeros, as in a STATE
    frame). Each worker checks the digests against the state it kept; nothing is copied
    into a stripe buffer and nothing is sent but the digests."""
    starts = [a for a, _ in pieces]
    for w, worker_runs in enumerate(runs):
        out = []
        for src, dst, n in worker_runs:
            h = xxhash.xxh3_64()
            at, end = src, src + n
            i = max(bisect.bisect_right(starts, src) - 1, 0)
            while at < end:
                if i < len(pieces) and pieces[i][0] <= at < pieces[i][0] + pieces[i][1].numel():
                    a, piece = pieces[i]
                    stop = min(end, a + piece.numel())
                    h.update(memoryview(piece[at - a : stop - a].to("cpu", torch.float32).contiguous().numpy()))
                    at, i = stop, i + 1
                    continue
                if i < len(pieces) and pieces[i][0] + pieces[i][1].numel() <= at:
                    i += 1
                    continue
                stop = min(end, pieces[i][0] if i < len(pieces) else end)
                while at < stop:
                    m = min(stop - at, len(_ZEROS))
                    h.update(_ZEROS[:m].data)
                    at += m
            out.append((dst, n, h.intdigest()))
            sent[w] += n
        if out:
            kept[w][int(field)] = np.asarray(out, dtype="<u8").tobytes()
