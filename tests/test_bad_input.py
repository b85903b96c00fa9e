"""Bad input gets a clear error, within a bound, and changes nothing."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow import knobs
from tests.conftest import free_port
from tests.helpers.tiny_trainer import Tiny, build

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(session, ddp, opt, sched, steps, start=0):
    for it in range(start + 1, start + steps + 1):
        g = torch.Generator().manual_seed(it)
        x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def test_unreachable_coordinator_fails_fast(world1):
    model, opt, sched = build()
    ddp = DDP(model)
    t0 = time.monotonic()
    with knobs.override(CONNECT_TIMEOUT_S=1.5):
        with pytest.raises(trainer_hooks.ShadowConnectionError, match="no shadow coordinator answered.*shadow cluster"):
            trainer_hooks.attach(ddp, opt, coordinator=f"tcp://127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 10


def test_malformed_address_and_unsupported_optimizer(world1):
    model, opt, _ = build()
    ddp = DDP(model)
    with pytest.raises(ValueError, match="not a ZeroMQ endpoint"):
        trainer_hooks.attach(ddp, opt, coordinator="127.0.0.1:5555")
    with pytest.raises(trainer_hooks.UnsupportedOptimizerError, match="torch.optim.Adam"):
        trainer_hooks.attach(ddp, torch.optim.RMSprop(model.parameters()), coordinator="tcp://127.0.0.1:1")
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        trainer_hooks.attach(model, opt, coordinator="tcp://127.0.0.1:1")


def test_restore_guards_and_overwrite_protection(world1, cluster):
    with pytest.raises(trainer_hooks.ShadowConnectionError, match="no checkpoint yet"):
        trainer_hooks.restore(Tiny(), torch.optim.AdamW(Tiny().parameters()), source=cluster.address)

    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched)
    _train(session, ddp, opt, sched, 4)
    assert session.close() == 4

    # a fresh run at iteration 0 must not silently replace the checkpoint
    m2, o2, s2 = build(seed=5)
    with pytest.raises(trainer_hooks.ShadowConnectionError, match="restore first"):
        trainer_hooks.attach(DDP(m2), o2, coordinator=cluster.address)

    # a model that does not match: clear error, nothing overwritten
    wrong = torch.nn.Sequential(torch.nn.Linear(24, 33))
    wopt = torch.optim.AdamW(wrong.parameters(), fused=True)
    before = [p.detach().clone() for p in wrong.parameters()]
    with pytest.raises(trainer_hooks.LayoutMismatchError, match="does not match.*nothing was changed"):
        trainer_hooks.restore(wrong, wopt, source=cluster.address)
    assert all(torch.equal(a, b) for a, b in zip(before, wrong.parameters()))
    assert not wopt.state

    # restoring then attaching continues from the checkpoint
    info = trainer_hooks.restore(m2, o2, source=cluster.address, scheduler=s2)
    assert info.iteration == 4
    ddp2 = DDP(m2)
    session = trainer_hooks.attach(ddp2, o2, coordinator=cluster.address, scheduler=s2)
    assert session.iteration == 4
    _train(session, ddp2, o2, s2, 2, start=4)
    assert session.close() == 6
    assert cluster.status()["job"]["committed"] == 6


def test_weights_only_restore(world1, cluster):
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="eval-me")
    _train(session, ddp, opt, sched, 3)
    session.close()
    fresh = Tiny()
    info = trainer_hooks.restore(fresh, source=cluster.address, weights_only=True)
    assert info.iteration == 3
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
