"""Bootstrap (and resync): stream this rank's stripe of the full state to the workers as
STATE frames for iteration ``base``, then the bootstrap commit."""
from __future__ import annotations

import numpy as np
import torch

from shadow.layout import intersect, stripe_bounds
from shadow.wire import frames as F
from trainer_hooks import _optim, _rng
from trainer_hooks._sender import StateItem


def bootstrap(session) -> None:
    lo, hi = stripe_bounds(session.layout.total, session.world)[session.rank]
    opt_state = session.optimizer.state
    sgd = session.optim_desc["kind"] == "sgd"
    fields = F.state_fields(session.optim_desc)
    key = _optim.STATE_KEYS[session.optim_desc["kind"]]
    runs = split(session.shards, lo, hi)
    sent = [0] * len(session.shards)
    if hi > lo:
        for field in fields:
            data = np.zeros(hi - lo, dtype=np.float32)
            for spec, p in zip(session.layout.params, session.params):
                cut = intersect((spec.offset, spec.offset + spec.numel), (lo, hi))
                if cut is None:
                    continue
                src = p.detach() if field == F.Field.PARAM else opt_state.get(p, {}).get(key[field])
                if src is None:
                    continue
                flat = src.detach().reshape(-1)[cut[0] - spec.offset:cut[1] - spec.offset]
                data[cut[0] - lo:cut[1] - lo] = flat.to("cpu", torch.float32).numpy()
            session.sender.q.put(StateItem(session.base, field, data, runs))
            for w, r in enumerate(runs):
                sent[w] += sum(n for _, _, n in r)
    steps, has_state = [], []
    for p in session.params:
        st = opt_state.get(p, {})
        steps.append(float(st["step"]) if "step" in st else 0.0)
        has_state.append(st.get("momentum_buffer") is not None if sgd else "step" in st)
    replay = {"iteration": session.base, "rank": session.rank, "groups": _optim.replay_groups(session.optimizer),
              "skipped": [], "clip": None, "bootstrap": True, "steps": steps, "has_state": has_state}
    # the state of iteration base: what the last commit recorded when re-attaching mid-run
    # (resync, add_param_group), else what the training loop holds now (attach after restore)
    carry = session.__dict__.pop("_carry", None)
    if carry is not None:
        rng, extra = carry
    else:
        rng, extra = _rng.capture(), session.extra_state() if session.extra_state is not None else None
    session._queue_commit(session.base, replay, rng, extra, sent)


def split(shards: list, lo: int, hi: int) -> list[list[tuple[int, int, int]]]:
    """Runs ``(src relative to lo, dst, n)`` of flat ``[lo, hi)`` per worker."""
    out = []
    for shard in shards:
        cut = intersect((lo, hi), shard)
        out.append([(cut[0] - lo, cut[0], cut[1] - cut[0])] if cut else [])
    return out

