"""Bad input gets a clear error, within a bound, and changes nothing."""

from __future__ import annotations

import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.config.tuning import Tuning
from shadow.testing import free_port
from shadow.testing.wait import wait_until
from tests.helpers.loop import train
from tests.helpers.tiny_trainer import Tiny, build

pytestmark = pytest.mark.slow


def test_unreachable_coordinator_fails_fast(world1):
    model, opt, sched = build()
    ddp = DDP(model)
    t0 = time.monotonic()
    with pytest.raises(trainer_hooks.ShadowConnectionError, match="no shadow coordinator answered.*shadow cluster"):
        address = f"tcp://127.0.0.1:{free_port()}"
        trainer_hooks.attach(ddp, opt, coordinator=address, tuning=Tuning(connect_timeout_s=1.5))
    assert time.monotonic() - t0 < 10


def test_a_restore_in_place_says_what_it_changed_when_the_rest_does_not_match(world1, shared_cluster, job):
    """From memory, a CPU model's parameters are received straight into it once its layout
    matches; model state outside the optimizer that then does not match is an error that
    says the parameters are restored and nothing else was changed."""
    model, opt, sched = build(extras=True)
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    train(ddp, opt, sched, 3)
    assert session.close() == 3
    other, oopt, _ = build(seed=9, extras=True)
    other.table = torch.zeros(7)  # a buffer of another size: outside the layout, found once the data is in
    with pytest.raises(trainer_hooks.LayoutMismatchError, match="parameters were received into the model already"):
        trainer_hooks.restore(other, oopt, source=shared_cluster.address, job=job)
    optim_params = [p for g in opt.param_groups for p in g["params"]]
    got = [p for g in oopt.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(optim_params, got, strict=True))
    assert torch.equal(other.table, torch.zeros(7)) and not oopt.state


def test_malformed_address_and_unsupported_optimizer(world1):
    model, opt, _ = build()
    ddp = DDP(model)
    with pytest.raises(ValueError, match="not a ZeroMQ endpoint"):
        trainer_hooks.attach(ddp, opt, coordinator="127.0.0.1:5555")
    with pytest.raises(trainer_hooks.UnsupportedOptimizerError, match="torch.optim.Adam"):
        trainer_hooks.attach(ddp, torch.optim.RMSprop(model.parameters()), coordinator="tcp://127.0.0.1:1")
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        trainer_hooks.attach(model, opt, coordinator="tcp://127.0.0.1:1")


def test_restore_guards_and_overwrite_protection(world1, shared_cluster, job):
    with pytest.raises(trainer_hooks.ShadowError, match=f"holds no checkpoint for job '{job}'"):
        trainer_hooks.restore(Tiny(), torch.optim.AdamW(Tiny().parameters()), source=shared_cluster.address, job=job)

    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    train(ddp, opt, sched, 4)
    assert session.close() == 4

    # a fresh run at iteration 0 must not silently replace the checkpoint
    m2, o2, s2 = build(seed=5)
    with pytest.raises(trainer_hooks.ShadowConnectionError, match="restore first"):
        trainer_hooks.attach(DDP(m2), o2, coordinator=shared_cluster.address, job=job)

    # a model that does not match: clear error, nothing overwritten
    wrong = torch.nn.Sequential(torch.nn.Linear(24, 33))
    wopt = torch.optim.AdamW(wrong.parameters(), fused=True)
    before = [p.detach().clone() for p in wrong.parameters()]
    with pytest.raises(trainer_hooks.LayoutMismatchError, match="does not match.*nothing was changed"):
        trainer_hooks.restore(wrong, wopt, source=shared_cluster.address, job=job)
    assert all(torch.equal(a, b) for a, b in zip(before, wrong.parameters(), strict=True))
    assert not wopt.state

    # restoring then attaching continues from the checkpoint
    info = trainer_hooks.restore(m2, o2, source=shared_cluster.address, scheduler=s2, job=job)
    assert info.iteration == 4
    ddp2 = DDP(m2)
    session = trainer_hooks.attach(ddp2, o2, coordinator=shared_cluster.address, scheduler=s2, job=job)
    assert session.iteration == 4
    train(ddp2, o2, s2, 2, start=4)
    assert session.close() == 6
    st = shared_cluster.status()
    assert st["job"]["name"] == job and st["job"]["committed"] == 6


def test_weights_only_restore(world1, shared_cluster, job):
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    train(ddp, opt, sched, 3)
    session.close()
    fresh = Tiny()
    info = trainer_hooks.restore(fresh, source=shared_cluster.address, weights_only=True, job=job)
    assert info.iteration == 3
    for (n, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_worker_rejects_malformed_frames_and_keeps_its_state(world1, shared_cluster, job):
    """Frames at a default cluster's data socket (in clear, each frame under its rank's MAC):
    a peer without the rank's key is refused at the door, before a frame of it is read; one
    past it (who saw the rank's door credential go by in clear) is refused frame by frame by
    what is wrong first (too short, not a shadow frame, or, for a well-formed header of any
    epoch, layout or world, its MAC), nothing taken."""
    import zmq

    from shadow import security
    from shadow.wire import frames as F
    from shadow.wire import tags

    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    train(ddp, opt, sched, 3)
    rank0 = session.sender.tags[0]
    assert isinstance(rank0, tags.DataKey)
    door = security.Door(tags.rank_user(0), rank0.door)
    session.close()
    st = shared_cluster.wait_caught_up(3)
    worker = st["workers"][0]
    good = F.Header(
        F.Kind.GRAD,
        F.Field.GRAD,
        session.job_id,
        session.epoch,
        0,
        1,
        session.layout.hash,
        4,
        99,
        ((worker["start"], 4, F.checksum(b"\0" * 16)),),
    )
    bad = [
        [b"garbage"],
        [good.pack()[:20]],
        [b"XXXX" + good.pack()[4:], b"\0" * 16],
        [F.Header(**{**good.__dict__, "epoch": session.epoch + 7}).pack(), b"\0" * 16],
        [F.Header(**{**good.__dict__, "layout": 12345}).pack(), b"\0" * 16],
        [F.Header(**{**good.__dict__, "world": 3}).pack(), b"\0" * 16],
    ]
    stranger = zmq.Context.instance().socket(zmq.PUSH)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(worker["data"])
    stranger.send_multipart(bad[0], zmq.NOBLOCK)  # queued here: no connection ever takes it

    def refused(rejected: dict) -> int:
        return sum(n for k, n in rejected.items() if k.startswith("auth_handshake"))

    shared_cluster.wait_status(
        lambda st: refused(st["workers"][0]["rejected"]) > refused(worker["rejected"]),
        what="the stranger refused at the door",
    )
    stranger.close()
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    door.apply(sock)
    sock.connect(worker["data"])
    for frames in bad:
        sock.send_multipart(frames)
    sock.close()
    reasons = ("truncated", "bad_magic", "bad_mac")
    st2 = shared_cluster.wait_status(
        lambda st: all(st["workers"][0]["rejected"].get(r, 0) > worker["rejected"].get(r, 0) for r in reasons),
        what=f"worker 0 refusing frames for each of {reasons}",
    )
    assert st2["workers"][0]["health"] == "ok" and st2["job"]["committed"] == 3
    fresh, fopt, fsched = build(seed=3)
    assert trainer_hooks.restore(fresh, fopt, source=shared_cluster.address, scheduler=fsched, job=job).iteration == 3
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_worker_process_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, shadow.worker.server, shadow.coordinator.server, shadow.cli.main; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_training_survives_a_lost_worker_that_does_not_come_back(world1, tmp_path):
    """SIGKILL a worker and do not restart it: the trainer is told the cluster is degraded
    and goes on without waiting; status shows the worker lost; the frozen checkpoint stays."""
    import os
    import signal

    from shadow.testing import LocalCluster

    cluster = LocalCluster(tmp_path, args=("max_restarts=0",))
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        # a stall is bounded by the tuning's block timeout
        session = trainer_hooks.attach(
            ddp, opt, coordinator=cluster.address, scheduler=sched, job="lossy", tuning=Tuning(block_timeout_s=60.0)
        )
        train(ddp, opt, sched, 2)
        deadline = time.monotonic() + 30
        while (cluster.status()["job"]["committed"] or -1) < 2:  # the checkpoint to be frozen
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(cluster.status()["workers"][1]["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        train(ddp, opt, sched, 12, start=2)
        assert time.monotonic() - t0 < 30
        assert session.degraded is not None and "worker 1 lost" in session.degraded
        session.close()
        st = cluster.status()
    finally:
        cluster.stop()
    assert st["workers"][1]["health"] == "lost"
    assert st["job"]["committed"] == 2 and "frozen at 2" in session.degraded


#: gradients changed after DDP's all-reduce in ways the shadow cannot replay, and what the next step says
TAMPERS = {
    # torch's clip of part of the model: one coefficient cannot replay it
    "torch-clip-part": r"clip_grad_norm_ scaled 1 of the \d+ attached parameters.*iteration 3.*in one call",
    # gradients scaled by hand: found by the sampled probes, off the step
    "manual-scale": r"changed between DDP's all-reduce.*iteration 3.*session.clip_grad_norm_",
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_gradients_changed_behind_the_shadows_back_are_refused(world1, shared_cluster, job, tamper):
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    try:
        train(ddp, opt, sched, 2)  # fine so far
        g = torch.Generator().manual_seed(3)
        x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        if tamper == "torch-clip-part":
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad][:1], 1e-3)
        else:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)
        # the step reads nothing back from the device: the sender refuses iteration 3's commit (a
        # partial clip is known at once; a hand-made change once the probed copies landed and were
        # compared with what was staged), and the next step raises
        opt.step()
        sched.step()
        opt.zero_grad()
        wait_until(lambda: session.latch.error is not None, what="the sender refusing iteration 3's commit")
        x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(trainer_hooks.ShadowError, match=TAMPERS[tamper]):
            opt.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert unchanged  # that step did not happen
    finally:
        session.close(wait=False)
    st = shared_cluster.wait_status(
        lambda st: all(w["applied"] == 2 for w in st["workers"]) and shared_cluster.heard_after_cut(st),
        what="iteration 2 applied by every worker",
    )
    assert st["job"]["committed"] == 2  # nothing of iteration 3 was checkpointed


def test_add_param_group_relayouts_and_direct_call_is_refused(world1, shared_cluster, job):
    from tests.helpers.tiny_trainer import Tiny

    torch.manual_seed(0)
    model = Tiny(unused_branch=True)
    base = [p for n, p in model.named_parameters() if not n.startswith("side")]
    opt = torch.optim.AdamW(base, lr=1e-2, fused=True)
    ddp = DDP(model)

    def step(it):
        g = torch.Generator().manual_seed(it)
        x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x, True), y).backward()
        opt.step()
        opt.zero_grad()

    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, job=job)
    for it in range(1, 4):
        step(it)
    opt.add_param_group({"params": [model.side.weight], "lr": 5e-3})
    with pytest.raises(trainer_hooks.ShadowError, match="session.add_param_group"):
        step(4)
    opt.param_groups.pop()  # undo, then do it the supported way
    opt.zero_grad()
    session.add_param_group({"params": [model.side.weight, model.side.bias], "lr": 5e-3})
    assert session.iteration == 3 and session.layout.num_groups == 2
    for it in range(4, 7):
        step(it)
    assert session.close() == 6
    m2 = Tiny(unused_branch=True)
    o2 = torch.optim.AdamW([p for n, p in m2.named_parameters() if not n.startswith("side")], lr=1e-2, fused=True)
    o2.add_param_group({"params": [m2.side.weight, m2.side.bias], "lr": 5e-3})
    assert trainer_hooks.restore(m2, o2, source=shared_cluster.address, job=job).iteration == 6
    for a, b in zip(model.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict()["state"], o2.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_divergence_audit_passes_then_catches_a_corrupted_replica(world1, shared_cluster, job, tmp_path):
    from shadow.testing import LocalCluster, ServiceFaults

    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(
        ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job, audit_every=2, audit_strict=True
    )
    train(ddp, opt, sched, 6)
    session.close()
    audit = shared_cluster.wait_status(
        lambda st: st["job"]["audit"]["last_iteration"] == 6, what="the audit of iteration 6"
    )["job"]["audit"]
    assert audit["checked"] > 0 and audit["mismatches"] == 0 and audit["last_iteration"] == 6
    assert session.audit_failures == []

    bad = LocalCluster(tmp_path, faults=ServiceFaults(corrupt_apply_at=4))  # every worker flips a bit at 4
    try:
        model, opt, sched = build()
        ddp2 = DDP(model)
        session = trainer_hooks.attach(
            ddp2, opt, coordinator=bad.address, scheduler=sched, job="audited", audit_every=2, audit_strict=True
        )
        with pytest.raises(trainer_hooks.ShadowError, match=r"divergence audit failed at iteration 4: param of '"):
            train(ddp2, opt, sched, 12)
        bad.wait_status(lambda st: st["job"]["audit"]["mismatches"] >= 1, what="the audit's mismatch")
        session.close(wait=False)
    finally:
        bad.stop()


def test_scheduler_that_cannot_be_recorded_is_refused_at_attach(world1):
    model, opt, _ = build()

    class Weird(torch.optim.lr_scheduler.LambdaLR):
        def state_dict(self):
            return {"fn": lambda: 1}

    with pytest.raises(trainer_hooks.ShadowError, match=r"scheduler Weird cannot be recorded.*lr_scheduler"):
        trainer_hooks.attach(DDP(model), opt, coordinator="tcp://127.0.0.1:1", scheduler=Weird(opt, lambda s: 1.0))
    with pytest.raises(TypeError, match="scheduler must be"):
        trainer_hooks.attach(DDP(model), opt, coordinator="tcp://127.0.0.1:1", scheduler=object())


def test_a_divergence_is_final_until_the_trainers_resync(world1, tmp_path):
    """An audit mismatch at iteration 4 (every worker flips a bit there) after a clean audit
    at 2: memory serves nothing of the job, no checkpoint after 2 is restorable from the
    tier, and the trainers' resync makes the shadow right again."""
    from shadow.restore import resolve
    from shadow.testing import LocalCluster, ServiceFaults

    local = tmp_path / "tier"
    bad = LocalCluster(
        tmp_path,
        args=(f"persist.local.dir={local}", "persist.local.every_n=1", "persist.local.keep=20"),
        faults=ServiceFaults(corrupt_apply_at=4),
    )
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=bad.address, scheduler=sched, job="dv", audit_every=2)
        train(ddp, opt, sched, 5)
        st = bad.wait_status(lambda s: s["job"]["diverged"] is not None, what="the divergence")
        assert st["job"]["diverged"] == 2 and st["restorable"]["memory"] is None
        assert st["restorable"]["local"] is None or st["restorable"]["local"] <= 2
        with pytest.raises(trainer_hooks.ShadowError):  # memory holds a wrong state: never served
            resolve(bad.address, job="dv", iteration=st["job"]["committed"], attempts=1)
        snap = resolve(str(local), job="dv")
        assert snap.iteration <= 2
        # the trainers resync (a new epoch from their state): restorable and right again
        it = 5
        while session.epoch == 1 or session.degraded is not None:  # the resync comes at an iteration boundary
            assert it < 400, f"no resync after {it} iterations: {bad.status()['job']}"
            it = train(ddp, opt, sched, 1, start=it)
            time.sleep(0.02)
        it = train(ddp, opt, sched, 2, start=it)
        session.close()
        st = bad.status()
        assert st["job"]["diverged"] is None and st["restorable"]["memory"] == it
        model2, opt2, sched2 = build()
        info = trainer_hooks.restore(model2, opt2, source=bad.address, scheduler=sched2, job="dv")
        assert info.iteration == it and info.tier == "memory"
        for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    finally:
        bad.stop()
