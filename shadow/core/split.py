"""The tensors a sharded optimizer steps, in the flat space.

Under FSDP2, tensor parallelism or both, each rank's optimizer steps the *local* tensor of
every DTensor parameter: a box of the full parameter (one contiguous index range per
dimension: ``Shard(d)`` chunks dimension ``d``, ``Replicate()`` leaves it whole, and
``_StridedShard`` chunks it after the shards it is nested in). The replay follows each
rank's per-tensor view, because the fused kernels treat a tensor's last elements
differently (their scalar remainder loop), so a worker needs every distinct box of every
parameter, not only the full tensor.

The trainer describes them as a *split*: per split parameter and dimension, the cut
points of its chunks, ``[0, c1, ..., size]`` (every combination of one chunk per
dimension is a box some rank holds). A box lies in the flat space (row-major, from the
parameter's offset) as *runs* of contiguous elements: one when the box takes whole rows,
one per row of the box when it cuts the last dimension (``Shard(1)`` of a matrix).

Pure numpy: the trainer and the workers compute the same runs from the same layout and
split, and nothing here needs torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shadow.core.layout import Layout

#: Bounds on a split received from the network: boxes per parameter (the ranks of the
#: largest mesh), and runs over the whole layout (each one row of a box, 40 bytes).
MAX_BOXES = 1 << 16
MAX_RUNS = 1 << 23

Box = tuple[tuple[int, int], ...]


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _inner(shape: Sequence[int], box: Box) -> int:
    """The outermost dimension ``j`` from which the box takes whole dimensions after it:
    its runs are one per index of dimensions ``< j``."""
    j = len(shape) - 1
    while j > 0 and tuple(box[j]) == (0, shape[j]):
        j -= 1
    return j


def run_count(shape: Sequence[int], box: Box) -> int:
    """How many runs :func:`box_runs` gives."""
    if not shape:
        return 1
    if box_numel(box) == 0:
        return 0
    n = 1
    for lo, hi in box[: _inner(shape, box)]:
        n *= hi - lo
    return n


def box_runs(shape: Sequence[int], offset: int, box: Box) -> tuple[np.ndarray, np.ndarray]:
    """``(flat starts, lengths)`` of the runs of ``box`` of a parameter of ``shape`` at
    flat ``offset``, in the local tensor's (row-major) order; none for an empty box."""
    if not shape:  # a scalar is one element
        return np.asarray([offset], dtype=np.int64), np.asarray([1], dtype=np.int64)
    if box_numel(box) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    j = _inner(shape, box)
    length = (box[j][1] - box[j][0]) * strides[j]
    starts = np.asarray([offset + box[j][0] * strides[j]], dtype=np.int64)
    for d in range(j - 1, -1, -1):  # outer dimensions vary slowest
        idx = np.arange(box[d][0], box[d][1], dtype=np.int64) * strides[d]
        starts = np.add.outer(idx, starts).reshape(-1)
    return starts, np.full(len(starts), length, dtype=np.int64)


def boxes_of(cuts: Sequence[Sequence[int]]) -> list[Box]:
    """Every box of a split parameter: one chunk per dimension, row-major over the chunks."""
    out: list[Box] = [()]
    for c in cuts:
        out = [b + ((c[k], c[k + 1]),) for b in out for k in range(len(c) - 1)]
    return out


def dim0_split(layout: Layout, shards: int) -> list:
    """The split of every parameter on dim 0 over ``shards`` ranks, as FSDP2 splits it
    (``ceil(rows / shards)`` rows each, the last ranks' pieces shorter or empty): what an
    optimizer descriptor's ``dim0_shards`` names."""
    out = []
    for i, spec in enumerate(layout.params):
        if not spec.shape or not spec.numel:  # a scalar is the first rank's; nothing to split in an empty one
            continue
        rows = spec.shape[0]
        per = -(-rows // shards)
        c0 = sorted({min(rows, r * per) for r in range(shards + 1)} | {0, rows})
        out.append([i, [c0] + [[0, s] for s in spec.shape[1:]]])
    return out


def check_split(layout: Layout, split) -> dict[int, list[list[int]]]:
    """``split`` (``[[parameter index, [cuts per dimension]], ...]``) checked against
    ``layout``: each index once, one cut list per dimension, each strictly increasing from
    0 to the dimension's size, boxes and runs within bounds. ``ValueError`` names the
    first problem."""
    if not isinstance(split, list):
        raise ValueError("split must be a list of [parameter index, [cuts per dimension]]")
    out: dict[int, list[list[int]]] = {}
    runs = 0
    for entry in split:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise ValueError(f"split entry {entry!r:.60} is not [parameter index, [cuts per dimension]]")
        i, cuts = entry
        if type(i) is not int or not 0 <= i < len(layout.params) or i in out:
            raise ValueError(f"split names parameter {i!r:.20} of {len(layout.params)} (or twice)")
        shape = layout.params[i].shape
        if not isinstance(cuts, list) or len(cuts) != len(shape):
            raise ValueError(f"split of parameter {i} needs one cut list per dimension of {list(shape)}")
        boxes = 1
        for d, c in enumerate(cuts):
            ok = isinstance(c, list) and len(c) >= 2 and all(type(x) is int for x in c)
            if not ok or c[0] != 0 or c[-1] != shape[d] or any(a >= b for a, b in zip(c, c[1:], strict=False)):
                raise ValueError(f"split of parameter {i}, dimension {d}: cuts must rise strictly from 0 to {shape[d]}")
            boxes *= len(c) - 1
            if boxes > MAX_BOXES:
                raise ValueError(f"split of parameter {i} has more than {MAX_BOXES} boxes")
        for b in boxes_of(cuts):
            runs += run_count(shape, b)
        if runs > MAX_RUNS:
            raise ValueError(f"split has more than {MAX_RUNS} runs; the replay cannot hold it")
        out[i] = [list(c) for c in cuts]
    return out


def replay_runs(layout: Layout, optim: dict) -> np.ndarray:
    """The tensors the optimizer described by ``optim`` steps, as runs in flat order:
    int64 rows ``(flat start, elements, parameter index, origin, tensor elements)``.
    ``origin`` is where the run's tensor's element 0 would lie (``flat start`` minus the
    run's position in its tensor), so element ``x`` of the run is element ``x - origin``
    of its tensor. Each parameter is one tensor unless ``optim`` splits it:
    ``optim["split"]`` (every box of a DTensor parameter, :func:`check_split`) or
    ``optim["dim0_shards"]`` (FSDP2's dim-0 split, :func:`dim0_split`)."""
    from shadow.core.layout import MAX_DIM0_SHARDS

    shards = optim.get("dim0_shards", 1)
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_DIM0_SHARDS:
        raise ValueError(f"dim0_shards must be an integer in [1, {MAX_DIM0_SHARDS}], got {shards!r}")
    raw = optim.get("split")
    if raw is not None and shards > 1:
        raise ValueError("an optimizer descriptor names split or dim0_shards, not both")
    split = check_split(layout, raw if raw is not None else dim0_split(layout, shards) if shards > 1 else [])
    parts = []
    for i, spec in enumerate(layout.params):
        cuts = split.get(i)
        if cuts is None:
            parts.append(np.asarray([[spec.offset, spec.numel, i, spec.offset, spec.numel]], dtype=np.int64))
            continue
        for b in boxes_of(cuts):
            starts, lens = box_runs(spec.shape, spec.offset, b)
            if not len(starts):
                continue
            local = np.concatenate(([0], np.cumsum(lens)[:-1]))
            rows = np.empty((len(starts), 5), dtype=np.int64)
            rows[:, 0], rows[:, 1], rows[:, 2] = starts, lens, i
            rows[:, 3], rows[:, 4] = starts - local, box_numel(b)
            parts.append(rows)
    if not parts:
        return np.zeros((0, 5), dtype=np.int64)
    out = np.concatenate(parts)
    return out[np.argsort(out[:, 0], kind="stable")]
