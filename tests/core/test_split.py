"""The tensors a sharded optimizer steps (``shadow.core.split``) and the replay's segments
over them (``shadow.kernels.segments_for_runs``)."""

import numpy as np
import pytest

from shadow.core.layout import Layout
from shadow.core.split import MAX_BOXES, box_runs, boxes_of, check_split, dim0_split, replay_runs
from shadow.kernels import segments_for_range, segments_for_runs


def test_dim0_shards_replay_each_rank_rows_as_a_tensor():
    layout = Layout.build([("w", (13, 5), 0, True), ("b", (1,), 0, True), ("s", (), 0, True)], 1)
    runs = replay_runs(layout, {"dim0_shards": 2})
    # 13 rows on 2 ranks: 7 + 6; one row on 2 ranks: all on the first; a scalar whole
    assert runs[:, :3].tolist() == [[0, 35, 0], [35, 30, 0], [65, 1, 1], [66, 1, 2]]
    assert runs[:, 4].tolist() == [35, 30, 1, 1]
    assert replay_runs(layout, {"impl": "fused"})[:, :3].tolist() == [[0, 65, 0], [65, 1, 1], [66, 1, 2]]
    # 13 rows on 4 ranks: 4 + 4 + 4 + 1
    assert replay_runs(layout, {"dim0_shards": 4})[:4, 1].tolist() == [20, 20, 20, 5]
    # 3 rows on 4 ranks: one row each on the first three, none on the last
    assert dim0_split(Layout.build([("v", (3, 2), 0, True)], 1), 4) == [[0, [[0, 1, 2, 3], [0, 2]]]]
    for bad in (0, -1, 1 << 40, "2", True, 2.0):
        with pytest.raises(ValueError, match="dim0_shards"):
            replay_runs(layout, {"dim0_shards": bad})


def test_a_column_split_is_one_run_per_row_and_each_box_its_own_tensor():
    # Shard(1) of a 3 x 4 matrix over 2 ranks: each rank's 3 x 2 piece is three runs of 2
    layout = Layout.build([("a", (2,), 0, True), ("w", (3, 4), 0, True)], 1)
    runs = replay_runs(layout, {"split": [[1, [[0, 3], [0, 2, 4]]]]})
    assert runs.tolist() == [
        [0, 2, 0, 0, 2],
        [2, 2, 1, 2, 6],  # rank 0: rows 0..2, columns 0..1 (its element 0 at flat 2)
        [4, 2, 1, 4, 6],  # rank 1: columns 2..3; its element 0 at flat 4
        [6, 2, 1, 4, 6],  # rank 0's row 1: its elements 2, 3 (origin 6 - 2)
        [8, 2, 1, 6, 6],
        [10, 2, 1, 6, 6],
        [12, 2, 1, 8, 6],
    ]
    # every element once
    cover = np.zeros(layout.total, dtype=int)
    for flat, n, *_ in runs.tolist():
        cover[flat : flat + n] += 1
    assert cover.tolist() == [1] * layout.total


def test_box_runs_follow_row_major_order():
    starts, lens = box_runs((4, 3, 5), 100, ((1, 3), (0, 3), (2, 4)))
    assert lens.tolist() == [2] * 6
    assert starts.tolist() == [100 + r * 15 + c * 5 + 2 for r in (1, 2) for c in range(3)]
    starts, lens = box_runs((4, 3, 5), 0, ((1, 3), (0, 3), (0, 5)))  # whole rows: one run
    assert (starts.tolist(), lens.tolist()) == ([15], [30])
    assert box_runs((4, 3), 0, ((2, 2), (0, 3)))[0].size == 0  # an empty box
    assert boxes_of([[0, 1, 3], [0, 2]]) == [((0, 1), (0, 2)), ((1, 3), (0, 2))]


def test_a_malformed_split_is_refused_naming_the_problem():
    layout = Layout.build([("w", (3, 4), 0, True)], 1)
    for bad, what in (
        ({"x": 1}, "must be a list"),
        ([[0]], "is not"),
        ([[1, [[0, 3], [0, 4]]]], "names parameter"),
        ([[0, [[0, 3], [0, 4]]], [0, [[0, 3], [0, 4]]]], "names parameter"),
        ([[0, [[0, 3]]]], "one cut list per dimension"),
        ([[0, [[0, 2, 2, 3], [0, 4]]]], "rise strictly"),
        ([[0, [[0, 3], [1, 4]]]], "rise strictly"),
        ([[0, [[0, 3], [0, 5]]]], "rise strictly"),
        ([[0, [[0, 3.0], [0, 4]]]], "rise strictly"),
    ):
        with pytest.raises(ValueError, match=what):
            check_split(layout, bad)
    big = Layout.build([("w", (MAX_BOXES + 1, 1), 0, True)], 1)
    with pytest.raises(ValueError, match="boxes"):
        check_split(big, [[0, [list(range(MAX_BOXES + 2)), [0, 1]]]])
    with pytest.raises(ValueError, match="not both"):
        replay_runs(layout, {"dim0_shards": 2, "split": []})


def test_segments_merge_rows_the_kernels_cannot_tell_apart_and_keep_tails_apart():
    # Shard(1) of 8 x 64 over 2 ranks: each tensor 8 x 32 = 256 elements, a multiple of the
    # vector width: no tail, the rows of both ranks' tensors merge into one segment
    layout = Layout.build([("w", (8, 64), 0, True)], 1)
    runs = replay_runs(layout, {"split": [[0, [[0, 8], [0, 32, 64]]]]})
    segs = segments_for_runs(runs, [0], 0, layout.total, "fused", 16, 8)
    assert [(s.lo, s.hi) for s in segs] == [(0, 512)]
    # the whole tensor's segment is what segments_for_range makes
    assert segs == segments_for_range([0], [512], [0], 0, 512, "fused", 16, 8)
    # 3 x 66 over 2: tensors of 3 x 33 = 99 = 6 * 16 + 3: the last 3 elements of each
    # tensor (its last row's last 3) take the fused tail rule
    layout = Layout.build([("w", (3, 66), 0, True)], 1)
    runs = replay_runs(layout, {"split": [[0, [[0, 3], [0, 33, 66]]]]})
    segs = segments_for_runs(runs, [0], 0, layout.total, "fused", 16, 8)
    tails = sorted(x for s in segs for x in range(max(s.lo, s.tail), s.hi))
    assert tails == [162, 163, 164, 195, 196, 197]
    seen = np.zeros(layout.total, dtype=int)  # every element once
    for s in segs:
        seen[s.lo : s.hi] += 1
    assert seen.tolist() == [1] * layout.total
    # CUDA's fused kernel reads each element's index in its tensor modulo 4
    for s in segments_for_runs(runs, [0], 0, layout.total, "cuda_fused", 16, 8):
        for x in range(s.lo, s.hi):
            row, col = divmod(x, 66)
            assert (x - s.start) % 4 == (row * 33 + col % 33) % 4
    # foreach has no tail: everything merges; a worker's range cuts the segments
    segs = segments_for_runs(runs, [0], 100, 300, "foreach", 16, 8)
    assert [(s.lo, s.hi) for s in segs] == [(0, 98)]
    # under CUDA's fused kernel, only rows whose indices agree modulo 4 join (origins 0, 33, 33, 66, 66, 99)
    assert len(segments_for_runs(runs, [0], 0, layout.total, "cuda_fused", 16, 8)) == 4
