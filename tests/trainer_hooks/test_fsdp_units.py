"""The sharded-model pieces of the trainer side without a cluster: where a rank's boxes lie
(FSDP2, tensor parallel, both: ``trainer_hooks.capture.placement``) and what it streams
(:class:`trainer_hooks.capture.fsdp.LocalShards`), what attach refuses, and a restore's
boxes placed as the live DTensors are, on a one-rank FSDP2 model (the multi-rank runs are
tests/slow/test_fsdp.py and tests/slow/test_tensor_parallel.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shadow.core.errors import ShadowUsageError
from shadow.core.layout import Layout
from trainer_hooks.capture.fsdp import LocalShards, Rows, boxes, check_outside_optimizer, rows_ranges


def _shards(slots, flat, total):
    return LocalShards((), tuple(slots), np.asarray(flat, dtype=np.int64).reshape(-1, 4), total, [], ())


def test_a_stream_maps_each_stripe_to_its_runs_and_skips_what_has_no_gradient():
    # parameter 0: a 35-element box at flat 35; parameter 1: 2 elements at flat 70
    shards = _shards([(0, 0, 35), (35, 0, 2)], [[0, 0, 35, 35], [1, 35, 70, 2]], 37)
    assert shards.stripe() == (0, 37)
    assert list(shards.pieces(0, 37)) == [(0, 0, 0, 35), (1, 0, 35, 2)]
    assert list(shards.pieces(30, 36)) == [(0, 30, 0, 5), (1, 0, 5, 1)]
    workers = [(0, 50), (50, 100)]
    # (src in the stream, flat dst, n) per worker; runs adjacent in both merge
    assert shards.runs([True, True], workers) == [[(0, 35, 15)], [(15, 50, 22)]]
    assert shards.runs([True, False], workers) == [[(0, 35, 15)], [(15, 50, 20)]]
    # a replica streams its stripe of a box (start 1024 in its local tensor) and a column
    # split's rows: runs neighbouring in the stream but not in the flat space stay apart
    rows = _shards([(0, 1024, 6)], [[0, 0, 1024, 3], [0, 3, 1030, 3]], 6)
    assert list(rows.pieces(0, 6)) == [(0, 1024, 0, 6)]
    assert rows.runs([True], [(0, 1028), (1028, 2000)]) == [[(0, 1024, 3)], [(3, 1030, 3)]]


def test_plain_tensors_are_not_dtensor_boxes():
    layout = Layout.build([("w", (4, 2), 0, True)], 1)
    with pytest.raises(ShadowUsageError, match="plain tensor"):
        boxes(layout, [torch.zeros(4, 2)])
    assert Rows.of(layout, [torch.zeros(4, 2)]) is None


def test_boxes_follow_shard_strided_shard_and_replicate():
    from torch.distributed.tensor import Replicate, Shard

    from trainer_hooks.capture.placement import _StridedShard, box

    # FSDP2 over tensor parallel, 8 rows on (dp 2, tp 2): torch's table
    strided = (_StridedShard(0, split_factor=2), Shard(0))
    got = {c: box((8, 3), strided, (2, 2), c)[0] for c in ((0, 0), (0, 1), (1, 0), (1, 1))}
    assert got == {(0, 0): (0, 2), (0, 1): (4, 6), (1, 0): (2, 4), (1, 1): (6, 8)}
    # uneven: 70 rows, tensor parallel first (35 + 35), then FSDP2's chunks of those (18 + 17)
    assert [box((70,), strided, (2, 2), c)[0] for c in ((0, 0), (1, 0), (0, 1), (1, 1))] == [
        (0, 18),
        (18, 35),
        (35, 53),
        (53, 70),
    ]
    # FSDP2 on dim 0 and row-wise tensor parallel on dim 1; a replicated mesh dimension
    assert box((13, 6), (Shard(0), Shard(1)), (2, 2), (1, 1)) == ((7, 13), (3, 6))
    assert box((13, 6), (Shard(0), Replicate()), (2, 2), (1, 0)) == ((7, 13), (0, 6))
    assert box((3, 2), (Shard(0),), (4,), (3,)) == ((3, 3), (0, 2))  # 3 rows on 4 ranks: the last none
    # plain shards on one dimension apply left to right
    assert box((8,), (Shard(0), Shard(0)), (2, 2), (0, 1)) == ((2, 4),)


def test_a_placement_the_shadow_cannot_place_is_refused_with_the_fix():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import Partial

    from trainer_hooks.capture.placement import _order, _StridedShard

    with pytest.raises(ShadowUsageError, match="split factor"):
        _order("w", (_StridedShard(0, split_factor=3), Shard(0)), (2, 2))
    with pytest.raises(ShadowUsageError, match="split factor"):
        _order("w", (_StridedShard(0, split_factor=2), Shard(1)), (2, 2))

    class P:
        placements = (Partial(),)

        class device_mesh:  # noqa: N801 - stands for a DTensor's mesh
            shape = (2,)

    from trainer_hooks.capture.placement import check

    with pytest.raises(ShadowUsageError, match="Partial"):
        check("w", P)  # type: ignore[arg-type]


def _one_rank_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    fully_shard(m[0], mesh=init_device_mesh("cpu", (1,)))
    fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
    return m


def test_attach_refuses_what_fsdp2_cannot_stream(world1):
    import trainer_hooks

    m = _one_rank_model()
    opt = torch.optim.AdamW(m.parameters())
    with pytest.raises(TypeError, match="comm_hook= is a DDP communication hook"):
        trainer_hooks.attach(m, opt, "tcp://127.0.0.1:1", comm_hook=lambda s, b: None)
    frozen = torch.optim.AdamW(m[1].parameters())  # the first layer's sharded parameters in no optimizer
    with pytest.raises(ShadowUsageError, match=r"'0.weight', '0.bias'.*param group of their own"):
        check_outside_optimizer(m, list(m[1].parameters()))
    del frozen


def test_a_restore_places_full_tensors_as_the_live_dtensors(world1):
    from torch.distributed.tensor import DTensor

    from trainer_hooks.capture.model import build_layout

    m = _one_rank_model()
    opt = torch.optim.AdamW(m.parameters())
    layout, params = build_layout(m, opt)
    rows = Rows.of(layout, params)
    assert rows is not None and rows.boxes[0] == ((0, 5), (0, 3))
    # one rank holds every row: a restore fetches one range, the whole flat space
    assert rows_ranges(layout, params) == (layout.hash, [(0, layout.total)])
    assert rows.within([(0, layout.total)]) and not rows.within([(0, layout.total - 1)])
    assert rows_ranges(layout, [torch.zeros(p.shape) for p in params]) is None
    full = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    placed = rows.place(0, full, None)
    assert isinstance(placed, DTensor) and placed.placements == params[0].placements
    assert torch.equal(placed.full_tensor(), full)
    live = rows.place(0, torch.zeros(5, 3), None)
    again = rows.place(0, full, live)
    assert again is live and torch.equal(live.full_tensor(), full)  # filled in place
