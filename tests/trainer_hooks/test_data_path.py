"""The data path without host synchronisation, on CPU: the copy/event abstraction, the ring
freeing slots out of order, and a whole attached step (GradScaler with a fused optimizer,
the session's clip, the audit, the scheduler, extra state and model buffers) that never
reads a tensor back on the training or hook threads -- and still restores bit-identical."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from tests.helpers.tiny_trainer import build
from trainer_hooks.session import transfer
from trainer_hooks.session.staging import StagingRing
from trainer_hooks.session.transfer import DONE, AsScalar, CopyStream, HostCopy


def test_copies_on_cpu_happen_at_once_with_a_done_event():
    copier = CopyStream(torch.device("cpu"))
    src, dst = torch.arange(6, dtype=torch.float32), torch.zeros(6)
    ev = copier.copy(dst, src)
    assert ev is DONE and ev.query() and torch.equal(dst, src)
    copier.fence()  # nothing to wait for on CPU


def test_a_host_copy_is_a_snapshot_of_the_structure():
    live = {
        "t": torch.tensor([1.0, 2.0]),
        "n": [torch.tensor(3), 4],
        "s": AsScalar(torch.tensor([0.5])),
        "k": (AsScalar(torch.tensor(7), int),),
    }
    copy = HostCopy(live)
    live["t"].mul_(10)  # the loop goes on changing its tensors and containers
    live["n"][0].add_(1)
    live["n"].append(5)
    got = copy.get()
    assert copy.ready and torch.equal(got["t"], torch.tensor([1.0, 2.0])) and torch.equal(got["n"][0], torch.tensor(3))
    assert got["n"][1] == 4 and len(got["n"]) == 2
    assert got["s"] == 0.5 and isinstance(got["s"], float) and got["k"] == (7,) and isinstance(got["k"][0], int)
    assert transfer.gather([]) is None
    views = [torch.tensor([1.0, 2.0])[1], torch.tensor([3], dtype=torch.bfloat16)[0]]
    assert transfer.gather(views).dtype == torch.float32 and transfer.gather(views).tolist() == [2.0, 3.0]


def test_the_scaler_state_is_read_without_item_and_equals_its_state_dict():
    assert transfer.scaler_state(None) is None
    assert HostCopy(transfer.scaler_state(torch.amp.GradScaler("cpu", enabled=False))).get() == {}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    assert HostCopy(transfer.scaler_state(scaler)).get() == scaler.state_dict()  # before the first scale()
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    for bad in (False, True, False):
        scaler.scale((w * (float("inf") if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        snap = HostCopy(transfer.scaler_state(scaler))
        want = scaler.state_dict()
        scaler._scale.mul_(3)  # what the copy holds does not move with the scaler
        assert snap.get() == want
        scaler._scale.div_(3)


def test_the_ring_reclaims_slots_released_out_of_order():
    ring = StagingRing(10)
    a, b, c = ring.alloc(4, 0), ring.alloc(3, 0), ring.alloc(3, 0)
    assert (a, b, c) == (0, 4, 7)
    ring.release(b, 3)  # a hook thread queued b before a: its space waits for a
    with pytest.raises(TimeoutError):
        ring.alloc(3, 0.05)
    ring.release(a, 4)
    assert ring.alloc(4, 0) == 0  # a and b are free again, in allocation order
    with pytest.raises(RuntimeError, match="not a live slot"):
        ring.release(b, 3)


class SyncCounter:
    """Counts calls that would wait for a CUDA device (``.item()``, ``.tolist()``,
    ``float()``, ``int()``, ``bool()``, ``.cpu()``, ``.to("cpu")``) made by the shadow's own
    code on any thread but its sender's."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "to")

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        self.on = False
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name: str, real):
        counter = self

        def wrapper(t, *args, **kwargs):
            if counter.on and not threading.current_thread().name.startswith("shadow-sender"):
                caller = sys._getframe(1)
                module = caller.f_globals.get("__name__", "")
                if module.startswith(("trainer_hooks", "shadow.")) and (name != "to" or _to_host(args, kwargs)):
                    counter.calls.append(f"{module}:{caller.f_lineno} Tensor.{name}")
            return real(t, *args, **kwargs)

        return wrapper


def _to_host(args, kwargs) -> bool:
    dev = kwargs.get("device", args[0] if args else None)
    return dev is not None and not isinstance(dev, torch.dtype) and torch.device(dev).type == "cpu"


def _step(ddp, opt, sched, scaler, session, it: int, *, bad: bool = False) -> None:
    g = torch.Generator().manual_seed(it)
    x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)
    loss = torch.nn.functional.cross_entropy(ddp(x), y) * (float("inf") if bad else 1.0)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    session.clip_grad_norm_(0.5)
    scaler.step(opt)
    scaler.update()
    sched.step()
    opt.zero_grad()


def test_an_attached_step_never_reads_a_tensor_back_and_restores_bit_identical(
    world1, shared_cluster, job, monkeypatch
):
    model, opt, sched = build(extras=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    ddp = DDP(model)
    session = trainer_hooks.attach(
        ddp,
        opt,
        coordinator=shared_cluster.address,
        scheduler=sched,
        scaler=scaler,
        job=job,
        audit_every=2,
        audit_strict=True,
        extra_state=lambda: {"seen": torch.tensor([7]), "scale": scaler._scale},
    )
    counter = SyncCounter(monkeypatch)
    # the counter sees what it should: the shadow reading a scalar on the training thread
    counter.on = True
    HostCopy(AsScalar(torch.tensor(1.0))).get()
    assert len(counter.calls) == 1 and "Tensor.item" in counter.calls[0]
    counter.calls.clear()
    for it in range(1, 8):  # iteration 4 overflows: the fused optimizer skips it on the device
        _step(ddp, opt, sched, scaler, session, it, bad=it == 4)
    counter.on = False
    assert counter.calls == [], counter.calls
    assert session.close() == 7 and session.stats()["shadow_errors"] == 0 and session.audit_failures == []
    live = {k: v.clone() for k, v in model.state_dict().items()}
    live_opt = opt.state_dict()
    scaler_state, sched_state = scaler.state_dict(), sched.state_dict()

    model2, opt2, sched2 = build(seed=5, extras=True)
    scaler2 = torch.amp.GradScaler("cpu")
    info = trainer_hooks.restore(
        model2, opt2, source=shared_cluster.address, scheduler=sched2, scaler=scaler2, job=job, rank=0
    )
    assert info.iteration == 7
    for k, v in live.items():
        assert torch.equal(model2.state_dict()[k], v), k
    got = opt2.state_dict()["state"]
    for i, st in live_opt["state"].items():
        for key, v in st.items():
            assert torch.equal(got[i][key], v), (i, key)
    assert scaler2.state_dict() == scaler_state and sched2.state_dict()["last_epoch"] == sched_state["last_epoch"]


def test_a_refused_commit_stops_the_stream_at_that_iteration(world1, shared_cluster, job):
    """The gradient check runs on the sender: a commit that fails it is never sent, nor is
    anything after it, and the step after raises."""
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for it in range(1, 3):
        _step(ddp, opt, sched, scaler, session, it)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)  # behind the shadow's back
    opt.step()
    sched.step()
    opt.zero_grad()
    deadline = time.monotonic() + 20
    while session.latch.error is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert session.sender.refused == 3
    with pytest.raises(trainer_hooks.ShadowError, match="iteration 3"):
        _step(ddp, opt, sched, scaler, session, 4)
    session.close(wait=False)
    st = shared_cluster.wait_status(
        lambda st: all(w["applied"] == 2 for w in st["workers"]) and shared_cluster.heard_after_cut(st),
        what="iteration 2 applied by every worker",
    )
    assert st["job"]["committed"] == 2


def test_gradients_as_bucket_views_are_staged_before_the_loop_writes_them(world1, shared_cluster, job):
    """With ``gradient_as_bucket_view=True`` the loop's clip and unscale write the bucket
    itself; what was staged is still the reduced gradient, and the restore is exact."""
    model, opt, sched = build()
    ddp = DDP(model, gradient_as_bucket_view=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6)
    session = trainer_hooks.attach(
        ddp, opt, coordinator=shared_cluster.address, scheduler=sched, scaler=scaler, job=job
    )
    assert session.attachment.target.views
    for it in range(1, 6):
        _step(ddp, opt, sched, scaler, session, it)
    assert session.close() == 5 and session.stats()["shadow_errors"] == 0 and session.latch.error is None
    live = {k: v.clone() for k, v in model.state_dict().items()}
    model2, opt2, sched2 = build(seed=3)
    trainer_hooks.restore(model2, opt2, source=shared_cluster.address, scheduler=sched2, job=job, rank=0)
    for k, v in live.items():
        assert torch.equal(model2.state_dict()[k], v), k
