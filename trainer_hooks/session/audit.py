"""The divergence audit's trainer side: which elements to sample after step k, and their
values (a local generator seeded by k; the training loop's RNGs are never touched)."""
from __future__ import annotations

import numpy as np

from shadow.wire import frames as F
from trainer_hooks import _optim


def sample(layout, params: list, optimizer, optim_desc: dict, shards: list, k: int) -> list:
    """Per worker: sampled flat positions and the trainer's values there after step k
    (a local generator seeded by k: the training loop's RNGs are not touched)."""
    rng = np.random.default_rng(k)
    offsets = np.asarray([p.offset for p in layout.params], dtype=np.int64)
    names = _optim.STATE_KEYS[optim_desc["kind"]]
    keys = {f: names.get(f) for f in F.state_fields(optim_desc)}
    out = []
    for lo, hi in shards:
        if hi <= lo:
            out.append(None)
            continue
        pos = np.unique(rng.integers(lo, hi, size=min(64, hi - lo)))
        idx = np.searchsorted(offsets, pos, side="right") - 1
        values: dict[int, list] = {int(f): [] for f in keys}
        for flat, i in zip(pos, idx):
            p = params[i]
            elem = int(flat - offsets[i])
            for f, key in keys.items():
                t = p.detach() if key is None else optimizer.state.get(p, {}).get(key)
                values[int(f)].append(0.0 if t is None else float(t.reshape(-1)[elem]))
        out.append({"positions": [int(x) for x in pos], "values": values})
    return out

