"""Commit records on the worker: decoding and checking the replay part, agreement across
ranks, and the divergence audit's comparison. The opaque blob is never decoded here."""

from __future__ import annotations

import numpy as np

from shadow.core.optimizers import group_from_wire
from shadow.wire import frames as F
from shadow.wire import messages as M
from shadow.worker.shard import ShardState


def audit_shard(state: ShardState, audit: dict) -> dict:
    """Compare the trainer's sampled values with this shard's, bit for bit."""
    pos = np.asarray(audit["positions"], dtype=np.int64)
    if len(pos) == 0:
        return {"ok": True, "checked": 0, "max_ulp": 0, "first_param": "", "detail": ""}
    if pos.min() < state.start or pos.max() >= state.stop:
        return {
            "ok": False,
            "checked": 0,
            "max_ulp": 0,
            "first_param": "",
            "detail": "audit positions outside the range",
        }
    offsets = np.asarray([p.offset for p in state.layout.params], dtype=np.int64)
    worst, first, checked = 0, None, 0
    for field, values in audit["values"].items():
        arr = state.array(F.Field(int(field)))
        if len(arr) == 0:
            continue
        mine = arr[pos - state.start]
        theirs = np.asarray(values, dtype=np.float64).astype(np.float32)
        a, b = mine.view(np.int32).astype(np.int64), theirs.view(np.int32).astype(np.int64)
        a = np.where(a < 0, -(a & 0x7FFFFFFF), a)
        b = np.where(b < 0, -(b & 0x7FFFFFFF), b)
        diff = np.abs(a - b)
        diff[np.isnan(mine) & np.isnan(theirs)] = 0
        checked += len(pos)
        if diff.any():
            worst = max(worst, int(diff.max()))
            j = int(np.flatnonzero(diff)[0])
            i = int(np.searchsorted(offsets, pos[j], side="right") - 1)
            cand = (
                int(pos[j]),
                state.layout.params[i].name,
                F.Field(int(field)).name.lower(),
                float(mine[j]),
                float(theirs[j]),
            )
            first = cand if first is None or cand[0] < first[0] else first
    if first is None:
        return {"ok": True, "checked": checked, "max_ulp": 0, "first_param": "", "detail": ""}
    return {
        "ok": False,
        "checked": checked,
        "max_ulp": worst,
        "first_param": first[1],
        "detail": f"{first[2]} of {first[1]!r} (flat element {first[0]}): shadow {first[3]!r}, trainer {first[4]!r}",
    }


def same(a, b) -> bool:
    """Equality in which NaN equals NaN (a clip coefficient of an overflowing step is NaN)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return a == b


_AUDIT_FIELDS = frozenset(int(f) for f in F.Field if f != F.Field.GRAD)
MAX_AUDIT_POSITIONS = 4096


def _check_audit(audit) -> None:
    """An audit sample is ``{"positions": [int], "values": {field: [number]}}`` with one
    value per position for each state field; anything else is a malformed commit."""
    if not isinstance(audit, dict) or set(audit) != {"positions", "values"}:
        raise F.FrameError("bad_commit", "malformed audit sample: expected a map of positions and values")
    pos, values = audit["positions"], audit["values"]
    if (
        not isinstance(pos, list)
        or len(pos) > MAX_AUDIT_POSITIONS
        or not all(type(p) is int and 0 <= p < 2**63 for p in pos)
    ):
        raise F.FrameError(
            "bad_commit",
            f"malformed audit sample: positions must be at most {MAX_AUDIT_POSITIONS} flat element indices",
        )
    if not isinstance(values, dict) or not all(type(k) is int and k in _AUDIT_FIELDS for k in values):
        raise F.FrameError("bad_commit", "malformed audit sample: values must map state fields to lists")
    for v in values.values():
        if not isinstance(v, list) or len(v) != len(pos) or not all(type(x) in (int, float) for x in v):
            raise F.FrameError("bad_commit", "malformed audit sample: one number per position per field")


#: bytes per run of a kept-state proof: ``dst``, ``n`` and the xxh3-64 of the run, little-endian u64
KEPT_RUN_BYTES = 24


def _check_kept(kept, bootstrap: bool) -> dict[int, list[tuple[int, int, int]]]:
    """A bootstrap commit's proof of a kept state (``trainer_hooks.session.bootstrap``): a
    map from state field to packed runs, returned as ``{field: [(dst, n, digest)]}``."""
    if not bootstrap:
        raise F.FrameError("bad_commit", "a kept-state proof in a commit that is not a bootstrap")
    if not isinstance(kept, dict) or not all(type(k) is int and k in _AUDIT_FIELDS for k in kept):
        raise F.FrameError("bad_commit", "malformed kept-state proof: expected a map of state fields")
    out = {}
    for k, packed in kept.items():
        if not isinstance(packed, bytes) or len(packed) % KEPT_RUN_BYTES:
            raise F.FrameError("bad_commit", f"malformed kept-state proof: runs of {KEPT_RUN_BYTES} bytes")
        runs = np.frombuffer(packed, dtype="<u8").reshape(-1, 3)
        out[k] = [(int(d), int(n), int(h)) for d, n, h in runs]
    return out


def _check_group(g) -> None:
    """A param group's settings, as trainer_hooks.optim.describe sends them: exactly the keys of one
    optimizer's group (:func:`shadow.core.optimizers.group_from_wire`), numbers as int or float, flags as bool."""
    try:
        group_from_wire(g)
    except ValueError as exc:
        raise F.FrameError("bad_commit", str(exc)) from None


def _check_owns(replay: dict, nparams: int, ngroups: int) -> list[int] | None:
    """A pipeline stage's commit names what it speaks for: ``owns`` = ``[first parameter,
    end, first group, end]`` (``trainer_hooks.capture.stages``); its skipped parameters lie
    inside. None: the rank speaks for the whole model."""
    owns = replay.get("owns")
    if owns is None:
        return None
    if not (isinstance(owns, list) and len(owns) == 4 and all(type(x) is int for x in owns)):
        raise F.FrameError("bad_commit", "commit 'owns' is not [first parameter, end, first group, end]")
    p0, p1, g0, g1 = owns
    if not (0 <= p0 < p1 <= nparams and 0 <= g0 < g1 <= ngroups):
        raise F.FrameError(
            "bad_commit",
            f"commit owns parameters [{p0}, {p1}) and groups [{g0}, {g1}) of a layout of {nparams} and {ngroups}",
        )
    if not all(p0 <= i < p1 for i in replay["skipped"]):
        raise F.FrameError("bad_commit", "commit skips a parameter its rank does not own")
    return owns


def _owned(c: dict, nparams: int) -> tuple[int, int]:
    owns = c.get("owns")
    return (0, nparams) if owns is None else (owns[0], owns[1])


#: what every rank's commit of an iteration must say alike (where they speak for the same parameters)
AGREED = ("clip", "inv_scale", "grad_scale", "skip_step")


def agree(a: dict, b: dict, nparams: int) -> bool:
    """Two ranks' commits of one iteration agree: the same settings for every param group
    both set, the same skipped parameters among those both own, the same factors."""
    if any(not same(a.get(k), b.get(k)) for k in AGREED):
        return False
    if any(x is not None and y is not None and x != y for x, y in zip(a["groups"], b["groups"], strict=True)):
        return False
    lo, hi = max(_owned(a, nparams)[0], _owned(b, nparams)[0]), min(_owned(a, nparams)[1], _owned(b, nparams)[1])
    return sorted(i for i in a["skipped"] if lo <= i < hi) == sorted(i for i in b["skipped"] if lo <= i < hi)


def merge(commits: list, nparams: int | None = None) -> dict:
    """One iteration's replay record from every rank's commit: the first rank's, unless
    pipeline stages each speak for their part (``owns``): then each group's settings, each
    skipped parameter and (bootstrap) each parameter's step count come from a rank that
    owns it. ``ValueError`` when some group or parameter has no rank speaking for it."""
    first = commits[0]
    if all(c.get("owns") is None for c in commits):
        return first
    if nparams is None:  # the stages' parameters end where the last one's do
        nparams = max(c["owns"][1] for c in commits if c.get("owns") is not None)
    out = {k: v for k, v in first.items() if k != "owns"}
    groups = list(first["groups"])
    skipped: set[int] = set()
    steps = list(first.get("steps", ())) if first["bootstrap"] else None
    has_state = list(first.get("has_state", ())) if first["bootstrap"] else None
    covered = np.zeros(nparams, dtype=bool)
    for c in commits:
        for i, g in enumerate(c["groups"]):
            if groups[i] is None:
                groups[i] = g
        skipped.update(c["skipped"])
        lo, hi = _owned(c, nparams)
        if steps is not None and has_state is not None and not covered[lo:hi].all():
            steps[lo:hi], has_state[lo:hi] = c["steps"][lo:hi], c["has_state"][lo:hi]
        covered[lo:hi] = True
    if any(g is None for g in groups) or not covered.all():
        raise ValueError("no rank's commit speaks for some param groups or parameters (a pipeline stage missing)")
    out.update(groups=groups, skipped=sorted(skipped))
    if steps is not None:
        out.update(steps=steps, has_state=has_state)
    return out


def decode_commit(body: bytes, h: F.Header, nparams: int, ngroups: int) -> tuple[dict, bytes | None]:
    """Decode and check the replay part of a commit; the blob stays opaque."""
    # bounded by what a commit of this layout holds: per-parameter lists, one map per group
    # (with a few short lists), an audit sample, the blob as one byte string
    longest = max(nparams, ngroups, MAX_AUDIT_POSITIONS) + 16
    lim = M.Limits(len(body), 4096, len(body), longest, 256)
    try:
        msg = M.unpack_bounded(body, lim, containers=8 * ngroups + 64)
    except ValueError as exc:
        if "exceeds max_" in str(exc):
            raise F.FrameError("bad_commit", f"commit body too large for its layout: {str(exc)[:160]}") from None
        raise F.FrameError("bad_commit", "commit body is not msgpack") from None
    except Exception:
        raise F.FrameError("bad_commit", "commit body is not msgpack") from None
    if not isinstance(msg, dict):
        raise F.FrameError("bad_commit", "commit body is not a map")
    try:
        replay, blob = msg["replay"], msg.get("blob")
        if replay["iteration"] != h.iteration or replay["rank"] != h.rank:
            raise F.FrameError("bad_commit", "commit body names another iteration or rank than its header")
        if not isinstance(replay["sent"], int) or replay["sent"] < 0:
            raise F.FrameError("bad_commit", "commit 'sent' is not a count")
        if not isinstance(replay.get("extras", 0), int) or replay.get("extras", 0) < 0:
            raise F.FrameError("bad_commit", "commit 'extras' is not a count")
        skipped = replay["skipped"]
        if not all(isinstance(i, int) and 0 <= i < nparams for i in skipped):
            raise F.FrameError("bad_commit", "commit skips a parameter index out of range")
        groups = replay["groups"]
        if len(groups) != ngroups:
            raise F.FrameError("bad_commit", f"commit has {len(groups)} param groups, layout has {ngroups}")
        owns = _check_owns(replay, nparams, ngroups)
        for i, g in enumerate(groups):
            if owns is not None and not owns[2] <= i < owns[3]:
                if g is not None:
                    raise F.FrameError("bad_commit", f"commit sets param group {i}, which its rank does not own")
                continue
            _check_group(g)
        for key in ("clip", "inv_scale", "grad_scale"):
            if replay.get(key) is not None and not isinstance(replay[key], float):
                raise F.FrameError("bad_commit", f"commit {key} is not a float")
        if not isinstance(replay.get("skip_step", False), bool):
            raise F.FrameError("bad_commit", "commit skip_step is not a bool")
        audit = replay.get("audit")
        if audit is not None:
            _check_audit(audit)
        if replay["bootstrap"]:
            if len(replay["steps"]) != nparams or len(replay["has_state"]) != nparams:
                raise F.FrameError("bad_commit", "bootstrap commit lacks per-parameter steps")
        if "kept" in replay:
            replay["kept"] = _check_kept(replay["kept"], replay["bootstrap"])
        if blob is not None and not isinstance(blob, bytes):
            raise F.FrameError("bad_commit", "commit blob is not bytes")
    except F.FrameError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise F.FrameError("bad_commit", f"malformed commit record ({type(exc).__name__}: {exc})") from None
    return replay, blob
