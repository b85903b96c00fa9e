"""The canonical flat fp32 parameter space, its sharding across workers and the
striping of gradient buckets across data-parallel ranks.

Everything here is pure: the trainer and the workers compute the same answers from
the same :class:`Layout`, which travels once per attach and is named by its hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Boundaries of shards and stripes fall on multiples of this many fp32 elements
#: (one 4 KiB page: cache-line aligned, and a shard's slice of a restored flat array is
#: a valid O_DIRECT target), except at the very end of a range.
ALIGN_ELEMS = 1024
#: Bounds on a layout received from elsewhere, far beyond any real model (2**48 fp32
#: elements is 1 PiB of parameters): flat offsets stay well inside 64 bits.
MAX_ELEMENTS = 1 << 48
MAX_DIMS = 64
MAX_GROUPS = 1 << 16
#: Bound on the ranks an FSDP2 parameter is split over (``shadow.core.split.replay_runs``).
MAX_DIM0_SHARDS = 1 << 16


@dataclass(frozen=True)
class ParamSpec:
    """One optimizer parameter in the flat space."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    group: int
    requires_grad: bool = True


@dataclass(frozen=True)
class Layout:
    """Parameters in optimizer order (param-group order, then order within a group)."""

    params: tuple[ParamSpec, ...]
    num_groups: int

    @property
    def total(self) -> int:
        return self.params[-1].offset + self.params[-1].numel if self.params else 0

    @property
    def hash(self) -> int:
        """64-bit name of this layout (first 8 bytes of SHA-256 of its canonical form)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little")

    def to_dict(self) -> dict:
        return {
            "num_groups": self.num_groups,
            "params": [[p.name, list(p.shape), p.offset, p.numel, p.group, bool(p.requires_grad)] for p in self.params],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        """Rebuild and validate a layout received from elsewhere."""
        try:
            num_groups = int(d["num_groups"])
            params = tuple(
                ParamSpec(str(n), tuple(int(x) for x in shape), int(off), int(numel), int(g), bool(rg))
                for n, shape, off, numel, g, rg in d["params"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed layout description: {exc}") from exc
        layout = cls(params, num_groups)
        layout.validate()
        return layout

    @classmethod
    def build(cls, entries: Iterable[tuple[str, Sequence[int], int, bool]], num_groups: int) -> Layout:
        """Lay out ``(name, shape, group, requires_grad)`` entries contiguously."""
        params, off = [], 0
        for name, shape, group, rg in entries:
            numel = 1
            for s in shape:
                numel *= int(s)
            params.append(ParamSpec(name, tuple(int(s) for s in shape), off, numel, group, rg))
            off += numel
        return cls(tuple(params), num_groups)

    def validate(self) -> None:
        if not 0 <= self.num_groups <= MAX_GROUPS:
            raise ValueError(f"layout has {self.num_groups} param groups; at most {MAX_GROUPS} are supported")
        off = 0
        for i, p in enumerate(self.params):
            n = 1
            if len(p.shape) > MAX_DIMS:
                raise ValueError(f"layout param {i} ({p.name}) has {len(p.shape)} dimensions; at most {MAX_DIMS}")
            for s in p.shape:
                if s < 0:
                    raise ValueError(f"layout param {i} ({p.name}) has a negative dimension {p.shape}")
                n *= s
                if n > MAX_ELEMENTS:
                    break
            if off + n > MAX_ELEMENTS:
                raise ValueError(
                    f"layout reaches more than {MAX_ELEMENTS} elements at param {i} ({p.name}); "
                    "that is beyond any model a cluster can hold"
                )
            if p.numel != n or p.offset != off:
                raise ValueError(f"layout param {i} ({p.name}) is not contiguous with its predecessors")
            if not 0 <= p.group < self.num_groups:
                raise ValueError(f"layout param {i} ({p.name}) names group {p.group} of {self.num_groups}")
            off += n

    def describe_mismatch(self, other: Layout) -> str:
        """A human-readable first difference between two layouts."""
        if len(self.params) != len(other.params):
            return f"{len(self.params)} parameters here vs {len(other.params)} in the checkpoint"
        for a, b in zip(self.params, other.params, strict=True):
            if (a.name, a.shape, a.group) != (b.name, b.shape, b.group):
                return (
                    f"parameter {a.name!r} shape {list(a.shape)} group {a.group} here vs "
                    f"{b.name!r} shape {list(b.shape)} group {b.group} in the checkpoint"
                )
        if self.num_groups != other.num_groups:
            return f"{self.num_groups} param groups here vs {other.num_groups} in the checkpoint"
        return "layouts differ only in requires_grad flags"


def _align_down(x: int, total: int) -> int:
    return total if x >= total else (x // ALIGN_ELEMS) * ALIGN_ELEMS


def shard_bounds(total: int, nshards: int) -> list[tuple[int, int]]:
    """Balanced, cache-line-aligned contiguous ranges ``[start, stop)`` for ``nshards``."""
    if nshards < 1:
        raise ValueError(f"need at least one shard, got {nshards}")
    cuts = [_align_down((total * s) // nshards, total) for s in range(nshards)] + [total]
    return [(cuts[s], cuts[s + 1]) for s in range(nshards)]


def stripe_bounds(length: int, nranks: int) -> list[tuple[int, int]]:
    """The stripe of a bucket of ``length`` elements that each of ``nranks`` sends."""
    return shard_bounds(length, nranks)


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class Run:
    """``nelem`` elements at ``src`` in a bucket buffer that land at flat ``dst``."""

    src: int
    dst: int
    nelem: int


def bucket_runs(
    param_slots: Sequence[tuple[int, int, int]],
    stripe: tuple[int, int],
    shards: Sequence[tuple[int, int]],
) -> list[list[Run]]:
    """Runs of one rank's stripe of a bucket, per destination shard.

    ``param_slots`` lists ``(bucket_offset, flat_offset, numel)`` for the parameters in
    the bucket. Runs that are adjacent both in the bucket and in flat space are merged.
    """
    per_shard: list[list[Run]] = [[] for _ in shards]
    for b_off, f_off, n in param_slots:
        piece = intersect((b_off, b_off + n), stripe)
        if piece is None:
            continue
        f_lo = f_off + piece[0] - b_off
        f_hi = f_lo + piece[1] - piece[0]
        for s, shard in enumerate(shards):
            cut = intersect((f_lo, f_hi), shard)
            if cut is None:
                continue
            run = Run(piece[0] + cut[0] - f_lo, cut[0], cut[1] - cut[0])
            runs = per_shard[s]
            if runs and runs[-1].src + runs[-1].nelem == run.src and runs[-1].dst + runs[-1].nelem == run.dst:
                last = runs[-1]
                runs[-1] = Run(last.src, last.dst, last.nelem + run.nelem)
            else:
                runs.append(run)
    return per_shard
