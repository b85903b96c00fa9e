"""Square roots as the trainer's CPU computes them, for torch's single-tensor and foreach Adam.

torch's CPU ``Tensor.sqrt`` runs through MKL's vector math library (``vsSqrt``, high
accuracy mode), which is not correctly rounded: depending on the CPU it dispatches to, a
reciprocal square root estimate (``rsqrtps``, ``vrsqrt14ps``) refined by one Newton step,
so about one result in six is the *other* neighbour of the exact root (measured: 17% on
an AMD EPYC, where the estimate comes from the CPU's own table). The fused Adam kernels do
not use it; single-tensor Adam (torch's default on CPU) and foreach Adam do.

The worker cannot call the trainer's library (nor run on its CPU), so the trainer measures
its square root at attach (:func:`measure`) and ships where it differs from IEEE ``sqrt``:

* every differing result is one ulp away, towards the exact root (checked: otherwise no
  table is made), so one bit per input says whether to step;
* the estimate depends on the exponent's parity and the mantissa only, so two *slots* of
  2**23 bits (one per parity, 1 MiB each) cover every normal input; an exponent where a
  sample disagrees (MKL's paths for huge inputs, near ``FLT_MAX``) gets a slot of its own,
  measured in full, and so do subnormal inputs when any differs;
* the map says which slot an input's sign and exponent use (-1: IEEE).

On the wire (``optim["sqrt"]``): ``{"digest": xxh3 of map and slots, "map": [slot per
exponent 0..254], "bits": zlib of the slots}``, about 0.7 MB (a slot of an exponent of its
own travels XOR its parity's slot: a few KB). The coordinator keeps the
bits out of status replies and manifests (:func:`public`).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

SLOT_BITS = 1 << 23  # one per mantissa
SLOT_BYTES = SLOT_BITS // 8
MAX_SLOTS = 32  # two parities, then subnormals and exponents of their own (1 MiB each in memory)
MAX_WIRE_BYTES = 4 << 20  # the compressed slots
N_EXPONENTS = 255  # 0 (subnormals) .. 254; 255 (inf, nan) is always IEEE
SAMPLE, EDGE = 16384, 4096  # per exponent: random mantissas, and the lowest and highest


@dataclass(frozen=True, eq=False)
class SqrtTable:
    """``slots``: uint8 ``[n * SLOT_BYTES]``, bit ``m`` of slot ``s`` set where the input with
    mantissa ``m`` rounds to the other neighbour; ``emap``: int16 ``[512]``, the slot of
    each ``bits >> 23`` (sign and exponent), -1 for IEEE."""

    slots: np.ndarray
    emap: np.ndarray
    digest: str

    @classmethod
    def build(cls, slots: np.ndarray, exponents: list[int]) -> SqrtTable:
        emap = np.full(512, -1, dtype=np.int16)
        emap[:N_EXPONENTS] = exponents
        slots = np.ascontiguousarray(slots, dtype=np.uint8).reshape(-1)
        return cls(slots, emap, _digest(exponents, slots))

    @functools.cached_property
    def words(self) -> np.ndarray:
        """The slots as uint32 words (bit ``m & 31`` of word ``m >> 5``): what the kernel reads."""
        return self.slots.view(np.uint32)

    @functools.cached_property
    def emap32(self) -> np.ndarray:
        return self.emap.astype(np.int32)

    @property
    def nslots(self) -> int:
        return len(self.slots) // SLOT_BYTES

    def to_wire(self) -> dict:
        emap = [int(x) for x in self.emap[:N_EXPONENTS]]
        return {"digest": self.digest, "map": emap, "bits": zlib.compress(_xor_bases(self.slots, emap).tobytes(), 6)}

    @classmethod
    def from_wire(cls, d: dict) -> SqrtTable:
        """The table of a (checked: :func:`check`) ``optim["sqrt"]``; ``ValueError`` if its
        bits do not decompress to what the map names or do not match the digest."""
        problem = check(d)
        if problem is not None:
            raise ValueError(problem)
        n = max(d["map"]) + 1
        dec = zlib.decompressobj()
        try:
            raw = dec.decompress(d["bits"], n * SLOT_BYTES + 1)
        except zlib.error as exc:
            raise ValueError(f"the sqrt table does not decompress: {exc}") from None
        if len(raw) != n * SLOT_BYTES or dec.unconsumed_tail or not dec.eof:
            raise ValueError(f"the sqrt table holds {len(raw)} bytes, not the {n} slots its map names")
        slots = _xor_bases(np.frombuffer(raw, dtype=np.uint8), d["map"])
        if _digest(d["map"], slots) != d["digest"]:
            raise ValueError("the sqrt table does not match its digest")
        return cls.build(slots, d["map"])

    def sqrt(self, x: np.ndarray) -> np.ndarray:
        """The trainer's square root of float32 ``x`` (numpy; the kernels inline the same)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        s = np.sqrt(x)
        b = x.view(np.uint32)
        slot = self.emap[b >> 23].astype(np.int64)
        m = (b & 0x7FFFFF).astype(np.int64)
        hit = slot >= 0
        idx = np.where(hit, slot * SLOT_BYTES + (m >> 3), 0)
        flip = hit & (((self.slots[idx] >> (m & 7)) & 1) == 1)
        up = x.astype(np.float64) > s.astype(np.float64) ** 2
        sb = s.view(np.uint32).astype(np.int64)
        out = np.where(flip, np.where(up, sb + 1, sb - 1), sb).astype(np.uint32)
        return out.view(np.float32)


def _xor_bases(slots: np.ndarray, emap: list[int]) -> np.ndarray:
    """Each slot of an exponent of its own XOR its parity's slot (on the wire: they differ
    in a few bits, and the XOR compresses to almost nothing); its own inverse."""
    out = slots.copy()
    n = len(slots) // SLOT_BYTES
    for e, slot in enumerate(emap):
        base = (e - 127) & 1
        if slot >= 2 and base < n and slot < n:
            out[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES] ^= slots[base * SLOT_BYTES : (base + 1) * SLOT_BYTES]
    return out


def _digest(exponents, slots: np.ndarray) -> str:
    h = xxhash.xxh3_64()
    h.update(np.asarray(exponents, dtype=np.int16).tobytes())
    h.update(slots.tobytes())
    return h.hexdigest()


def check(d) -> str | None:
    """Why an ``optim["sqrt"]`` from the network is malformed, or None (the bits' content is
    checked by :meth:`SqrtTable.from_wire`)."""
    if not isinstance(d, dict) or set(d) != {"digest", "map", "bits"}:
        return "sqrt must be a map of digest, map and bits"
    if not isinstance(d["digest"], str) or len(d["digest"]) != 16:
        return "sqrt.digest must be a 16-digit xxh3 hex string"
    m = d["map"]
    if not isinstance(m, list) or len(m) != N_EXPONENTS or not all(isinstance(x, int) for x in m):
        return f"sqrt.map must list {N_EXPONENTS} slot numbers"
    if not all(-1 <= x < MAX_SLOTS for x in m) or max(m) < 0:
        return f"sqrt.map entries must be -1 or a slot below {MAX_SLOTS}, at least one a slot"
    if not isinstance(d["bits"], bytes) or len(d["bits"]) > MAX_WIRE_BYTES:
        return f"sqrt.bits must be at most {MAX_WIRE_BYTES} bytes"
    return None


def public(optim: dict) -> dict:
    """``optim`` as status replies and manifests show it: the sqrt table's digest, not its bits."""
    sq = optim.get("sqrt")
    if not isinstance(sq, dict) or "bits" not in sq:
        return optim
    return {**optim, "sqrt": {"digest": sq.get("digest")}}


def _flags(sqrt_fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> tuple[np.ndarray, bool]:
    """Where ``sqrt_fn`` differs from IEEE on ``x``, and whether every difference is one ulp
    towards the exact root (what a table bit can say)."""
    got = np.asarray(sqrt_fn(x), dtype=np.float32).view(np.uint32).astype(np.int64)
    s = np.sqrt(x)
    ieee = s.view(np.uint32).astype(np.int64)
    flag = got != ieee
    if not flag.any():
        return flag, True
    up = x[flag].astype(np.float64) > s[flag].astype(np.float64) ** 2
    step = np.where(up, 1, -1)
    return flag, bool(np.array_equal(got[flag] - ieee[flag], step))


def _exponent(e: int, mantissas: np.ndarray) -> np.ndarray:
    return ((np.uint32(e) << np.uint32(23)) | mantissas.astype(np.uint32)).view(np.float32)


def measure(sqrt_fn: Callable[[np.ndarray], np.ndarray], seed: int = 0) -> tuple[SqrtTable | None, str]:
    """The table that reproduces ``sqrt_fn`` (float32 in, float32 out, elementwise) for every
    input >= 0, with a note on what was found. ``(None, note)`` when ``sqrt_fn`` is IEEE
    ``sqrt`` wherever it was measured (no table needed) or when no table can express it
    (the note says which)."""
    all_m = np.arange(SLOT_BITS, dtype=np.uint32)
    rng = np.random.default_rng(seed)
    slots: list[np.ndarray] = []
    exponents = [-1] * N_EXPONENTS
    full: dict[int, np.ndarray] = {}
    for e in (127, 128):  # [1, 2) and [2, 4): every mantissa of both parities
        flag, ok = _flags(sqrt_fn, _exponent(e, all_m))
        if not ok:
            return None, f"square roots of [1, 4) differ from IEEE by more than one ulp (exponent {e})"
        full[e] = flag
    base = {0: full[127], 1: full[128]}  # by the unbiased exponent's parity
    flag, ok = _flags(sqrt_fn, _exponent(0, all_m))  # zero and the subnormals
    if not ok:
        return None, "square roots of subnormal numbers differ from IEEE by more than one ulp"
    own: dict[int, np.ndarray] = {0: flag} if flag.any() else {}
    sample = np.concatenate(
        [np.arange(EDGE), np.arange(SLOT_BITS - EDGE, SLOT_BITS), rng.integers(EDGE, SLOT_BITS - EDGE, SAMPLE)]
    ).astype(np.uint32)
    for e in range(1, N_EXPONENTS):
        if e in full:
            continue
        parity = (e - 127) & 1
        flag, ok = _flags(sqrt_fn, _exponent(e, sample))
        if ok and np.array_equal(flag, base[parity][sample]):
            continue
        flag, ok = _flags(sqrt_fn, _exponent(e, all_m))
        if not ok:
            return None, f"square roots at exponent {e - 127} differ from IEEE by more than one ulp"
        if not np.array_equal(flag, base[parity]):
            own[e] = flag
    if not any(f.any() for f in base.values()) and not own:
        return None, "IEEE square roots"
    if 2 + len(own) > MAX_SLOTS:
        return None, f"{len(own)} exponents need tables of their own (at most {MAX_SLOTS - 2})"
    for parity in (0, 1):
        slots.append(np.packbits(base[parity], bitorder="little"))
    for e in range(1, N_EXPONENTS):
        exponents[e] = (e - 127) & 1
    for e, flag in sorted(own.items()):
        exponents[e] = len(slots)
        slots.append(np.packbits(flag, bitorder="little"))
    table = SqrtTable.build(np.concatenate(slots), exponents)
    if len(zlib.compress(table.slots.tobytes(), 6)) > MAX_WIRE_BYTES:
        return None, "the table does not compress below its wire limit"
    rate = float(np.mean(np.concatenate([base[0], base[1]])))
    extra = f"; exponents with tables of their own: {sorted(e - 127 for e in own)}" if own else ""
    return table, f"{rate:.1%} of square roots are the other neighbour of the exact root{extra}"
