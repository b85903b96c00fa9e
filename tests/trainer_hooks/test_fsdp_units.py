"""The FSDP2 pieces of the trainer side without a cluster: where a rank's rows lie and what
it streams (:class:`trainer_hooks.capture.fsdp.LocalShards`), what attach refuses, and a restore's
rows placed as the live DTensors are, on a one-rank FSDP2 model (the multi-rank runs are
tests/slow/test_fsdp.py)."""

from __future__ import annotations

import pytest
import torch

from shadow.core.errors import ShadowUsageError
from shadow.core.layout import Layout
from trainer_hooks.capture.fsdp import LocalShards, Rows, check_outside_optimizer, local_shards, rows_ranges


def test_replicas_split_their_shard_and_runs_skip_what_has_no_gradient():
    # this rank's rows: a 35-element piece at flat 35, 2 elements at flat 70 (two parameters)
    shards = LocalShards(shards=2, replicas=2, replica=1, slots=((0, 35, 35), (35, 70, 2)), total=37)
    other = LocalShards(2, 2, 0, shards.slots, 37)
    # stripes are cut on 1024-element boundaries: 37 elements fall to one replica whole
    assert (other.stripe(), shards.stripe()) == ((0, 0), (0, 37))
    assert list(shards.pieces(0, 37)) == [(0, 0, 0, 35), (1, 0, 35, 2)]
    assert list(shards.pieces(30, 36)) == [(0, 30, 0, 5), (1, 0, 5, 1)]
    lo, hi = shards.stripe()
    workers = [(0, 50), (50, 100)]
    # (src in the stripe, flat dst, n) per worker; runs adjacent in both merge
    assert shards.runs([True, True], workers) == [[(0, 35, 15)], [(15, 50, 22)]]
    assert shards.runs([True, False], workers) == [[(0, 35, 15)], [(15, 50, 20)]]
    assert (lo, hi) == (0, 37)
    # the two replicas together stream every element once
    sent = sorted((dst, n) for s in (shards, other) for rs in s.runs([True, True], [(0, 100)]) for _, dst, n in rs)
    covered = sum(n for _, n in sent)
    assert covered == 37 and sent[0][0] == 35


def test_plain_tensors_are_not_fsdp_shards():
    layout = Layout.build([("w", (4, 2), 0, True)], 1)
    with pytest.raises(ShadowUsageError, match="not sharded"):
        local_shards(layout, [torch.zeros(4, 2)])
    assert Rows.of(layout, [torch.zeros(4, 2)]) is None


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
    assert rows is not None and rows.shards.shards == 1
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
