"""Every optimizer, implementation, scaler and clipping a CPU loop can combine, attached to the
shadow: each cell ends bit-identical to the trainer (a restore from the cluster's memory is
``torch.equal`` to the trainer's model, optimizer and scaler), or is refused at attach with
its cause named. No cell may end with a wrong state offered as restorable.

{Adam (amsgrad, L2), AdamW, SGD (momentum, Nesterov)} x {single-tensor, foreach, fused} x
{no scaler, GradScaler(enabled=False), GradScaler} x {no clip, torch's clip_grad_norm_ in the
loop, torch's clip inside optimizer.step(closure)}: 81 cells, one rank, in this process."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.testing import assert_same_state
from tests.helpers.tiny_trainer import Tiny

pytestmark = pytest.mark.slow

OPTIMIZERS = {
    "adam-amsgrad-l2": lambda ps, kw: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, amsgrad=True, **kw),
    "adamw": lambda ps, kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "sgd-nesterov": lambda ps, kw: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, **kw),
}
IMPLS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
SCALERS = ("none", "disabled", "grad-scaler")
CLIPS = ("none", "torch-in-loop", "torch-in-closure")
CELLS = list(itertools.product(OPTIMIZERS, IMPLS, SCALERS, CLIPS))
STEPS = 4
MAX_NORM = 0.05  # small enough that every step clips


def _batch(it: int):
    g = torch.Generator().manual_seed(it)
    return torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)


def _step(ddp, opt, scaler, clip: str, it: int) -> None:
    """One iteration the way loops and frameworks write it."""
    x, y = _batch(it)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if clip != "none":
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        return loss

    if clip == "torch-in-closure":
        if scaler is not None and scaler.is_enabled():
            closure()  # GradScaler takes no closure: Lightning runs it, then steps the scaler
            scaler.step(opt)
        elif scaler is not None:
            scaler.step(opt, closure)  # a disabled scaler passes the closure on
        else:
            opt.step(closure)
    else:
        closure()
        if scaler is not None:
            scaler.step(opt)
        else:
            opt.step()
    if scaler is not None:
        scaler.update()


@pytest.mark.parametrize("optim,impl,scaler,clip", CELLS, ids=["-".join(c) for c in CELLS])
def test_cell_is_exact_or_refused(world1, shared_cluster, job, optim, impl, scaler, clip):
    torch.manual_seed(0)
    model = Tiny()
    opt = OPTIMIZERS[optim](model.parameters(), IMPLS[impl])
    sc = None if scaler == "none" else torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=scaler != "disabled")
    ddp = DDP(model)
    try:
        session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scaler=sc, job=job)
    except trainer_hooks.UnsupportedOptimizerError as exc:  # refused: the cause and the fix are named
        assert "exact=False" in str(exc) and "deviates by up to" in str(exc), exc
        return
    try:
        for it in range(1, STEPS + 1):
            _step(ddp, opt, sc, clip, it)
        assert session.close() == STEPS
    finally:
        session.close(wait=False)
    trained = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.manual_seed(1)
    fresh = Tiny()
    fresh_opt = OPTIMIZERS[optim](fresh.parameters(), IMPLS[impl])
    fresh_sc = None if sc is None else torch.amp.GradScaler("cpu", enabled=scaler != "disabled")
    info = trainer_hooks.restore(fresh, fresh_opt, source=shared_cluster.address, scaler=fresh_sc, job=job)
    assert info.iteration == STEPS and info.tier == "memory"
    assert_same_state({"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()}, trained)
    if sc is not None and sc.is_enabled():
        assert fresh_sc.state_dict() == sc.state_dict()
