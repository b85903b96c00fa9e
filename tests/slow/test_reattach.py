"""Re-attaching mid-run (resync, add_param_group, a resumed run) keeps the checkpoint of
the boundary intact: the bootstrap records that iteration's RNG and extra state, and the
previous epoch keeps answering restores until the new one holds its base."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from tests.helpers.tiny_trainer import Tiny, build

pytestmark = pytest.mark.slow


def _step(ddp, opt, it):
    g = torch.Generator().manual_seed(it)
    x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)
    torch.nn.functional.cross_entropy(ddp(x, True), y).backward()
    opt.step()
    opt.zero_grad()


def _groups(model):
    return [p for n, p in model.named_parameters() if not n.startswith("side")]


def test_reattach_bootstrap_records_the_boundary_rng_and_extra_state(world1, shared_cluster, job):
    torch.manual_seed(0)
    model = Tiny(unused_branch=True)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2, fused=True)
    ddp = DDP(model)
    box = {"it": 0}
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, job=job, extra_state=lambda: dict(box))
    random.seed(11)
    for it in range(1, 4):
        box["it"] = it
        random.random()  # the loop's own draws (augmentation, sampling) before the step
        _step(ddp, opt, it)
    at_boundary = random.getstate()
    box["it"], _ = 4, random.random()  # the next iteration has begun when the re-attach happens
    session.add_param_group({"params": [model.side.weight, model.side.bias], "lr": 5e-3})
    assert session.iteration == 3
    assert session.close() == 3  # nothing after the bootstrap: the restore reads the bootstrap itself
    m2 = Tiny(unused_branch=True)
    o2 = torch.optim.AdamW(_groups(m2), lr=1e-2, fused=True)
    o2.add_param_group({"params": [m2.side.weight, m2.side.bias], "lr": 5e-3})
    random.seed(99)
    info = trainer_hooks.restore(m2, o2, source=shared_cluster.address, job=job)
    assert info.iteration == 3 and info.extra_state == {"it": 3}
    assert random.getstate() == at_boundary
    for a, b in zip(model.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_previous_epoch_serves_restores_while_a_reattach_bootstraps(world1, shared_cluster, job, monkeypatch):
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    from tests.helpers.loop import train_step

    for it in range(1, 4):
        train_step(ddp, opt, sched, it)
    assert session.close() == 3
    want = {k: v.clone() for k, v in model.state_dict().items()}
    # a resumed trainer re-attaches and dies before its bootstrap reaches the workers
    from trainer_hooks.session import bootstrap

    streamed = bootstrap.bootstrap
    monkeypatch.setattr(bootstrap, "bootstrap", lambda att, carry: None)
    m3, o3, s3 = build(seed=4)
    dead = trainer_hooks.attach(DDP(m3), o3, coordinator=shared_cluster.address, scheduler=s3, job=job, iteration=3)
    st = shared_cluster.status()
    # the new epoch has nothing yet
    assert st["job"]["name"] == job and st["job"]["epoch"] == dead.epoch and st["job"]["committed"] is None
    assert st["restorable"]["memory"] == 3
    dead.close(wait=False)
    monkeypatch.setattr(bootstrap, "bootstrap", streamed)
    fresh, fopt, fsched = build(seed=7)
    # no job named: the cluster's newest one, this test's (it attached last), served by the previous epoch
    info = trainer_hooks.restore(fresh, fopt, source=shared_cluster.address, scheduler=fsched)
    assert info.iteration == 3 and info.tier == "memory" and info.job == job
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
