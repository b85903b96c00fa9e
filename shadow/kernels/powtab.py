"""``beta ** k`` in float32 as the trainer's device computes it, for every step count k.

CUDA's fused Adam computes its bias corrections with the device's ``powf``, which is not
correctly rounded in general; a worker's ``powf`` is another function. So the worker never
calls one: :func:`reference` is a deterministic float32 power (exponentiation by squaring
in float64, then one rounding: the same on every machine), and the trainer measures, at
attach, where its device differs from it (:func:`exceptions`). The pairs travel in the
replay descriptor (``optim["pow"]``: ``[[beta bits, [[k, value bits], ...], limit], ...]``,
JSON-friendly integers).

Past ``limit`` (where the reference is below 2**-30) every power that can occur rounds
``1 - p`` to 1.0 in float32, so no table is needed beyond it.
"""

from __future__ import annotations

import numpy as np

TINY = 2.0**-30  # below this, 1 - p and sqrt(1 - p) round to 1.0f whatever p's last bits
MAX_STEPS = 1 << 20  # a beta closer to 1 than this covers is checked up to here only


def bits(x: float) -> int:
    return int(np.float32(x).view(np.uint32))


def from_bits(b: int) -> np.float32:
    return np.array([b], dtype=np.uint32).view(np.float32)[0]


def limit(beta: float) -> int:
    """The step count from which ``beta ** k`` no longer matters (capped at MAX_STEPS)."""
    b = float(np.float32(beta))
    if not 0.0 < b < 1.0:
        return 1
    return int(min(MAX_STEPS, np.ceil(np.log(TINY) / np.log(b)) + 1))


def reference(beta: float, ks: np.ndarray) -> np.ndarray:
    """float32 ``beta ** k`` for integer ``ks`` (>= 0): squaring in float64, one rounding."""
    ks = np.asarray(ks, dtype=np.int64)
    base = np.full(ks.shape, float(np.float32(beta)), dtype=np.float64)
    out = np.ones(ks.shape, dtype=np.float64)
    e = ks.copy()
    while np.any(e > 0):
        odd = (e & 1) == 1
        out = np.where(odd, out * base, out)
        base = base * base
        e >>= 1
    return out.astype(np.float32)


def exceptions(beta: float, device_values: np.ndarray) -> list[list[int]]:
    """``[[k, value bits], ...]`` where ``device_values`` (``beta ** k`` for k = 1..n as
    the device computed it) differ from :func:`reference`."""
    device_values = np.asarray(device_values, dtype=np.float32)
    ks = np.arange(1, len(device_values) + 1)
    ref = reference(beta, ks)
    where = np.flatnonzero(ref.view(np.uint32) != device_values.view(np.uint32))
    return [[int(ks[i]), int(device_values.view(np.uint32)[i])] for i in where]


class PowTable:
    """``beta ** k`` per float32 beta: the device's values where they differ from the
    reference, the reference elsewhere."""

    def __init__(self, entries: list | None = None) -> None:
        self.table: dict[int, dict[int, np.float32]] = {}
        self.limits: dict[int, int] = {}
        for beta_bits, pairs, lim in entries or ():
            self.table[int(beta_bits)] = {int(k): from_bits(int(v)) for k, v in pairs}
            self.limits[int(beta_bits)] = int(lim)

    def __bool__(self) -> bool:
        return bool(self.limits)

    def pow(self, beta: float, k: float) -> np.float32:
        b = bits(beta)
        got = self.table.get(b, {}).get(int(k))
        return got if got is not None else reference(beta, np.array([int(k)]))[0]


def check_entries(entries) -> str | None:
    """Why ``optim["pow"]`` from the network is malformed, or None."""
    if entries is None:
        return None
    if not isinstance(entries, list) or len(entries) > 64:
        return "pow must be a list of at most 64 [beta bits, [[k, value bits], ...], limit]"
    for e in entries:
        if not (
            isinstance(e, list)
            and len(e) == 3
            and isinstance(e[0], int)
            and isinstance(e[1], list)
            and isinstance(e[2], int)
            and 0 <= e[0] < 1 << 32
            and 0 < e[2] <= MAX_STEPS + 1
            and len(e[1]) <= MAX_STEPS
        ):
            return "pow entries must be [beta bits, [[k, value bits], ...], limit] of integers"
        for pair in e[1]:
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and all(isinstance(x, int) for x in pair)
                and 0 < pair[0] <= MAX_STEPS
                and 0 <= pair[1] < 1 << 32
            ):
                return "pow entries must be [beta bits, [[k, value bits], ...], limit] of integers"
    return None
