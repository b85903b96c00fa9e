"""The loops users write: torch's clipping recorded wherever it is called from, a disabled
GradScaler, scheduler cadence, and restores that must know their rank (no services)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trainer_hooks.restorer.restore import RestoreInfo, process_rank
from trainer_hooks.session import clipping
from trainer_hooks.session.options import AttachOptions
from trainer_hooks.session.recorder import StepRecorder


class FakeSession:
    """What the clipping wrapper talks to: ``_clipped`` (the session's real method)."""

    def __init__(self, params) -> None:
        self.params = params
        self.calls: list = []

    def _clipped(self, scaled, coef) -> None:
        self.calls.append((set(scaled), coef))


def _params(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(5 + i, generator=g)) for i in range(n)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 10
    return ps


def test_clip_from_any_import_is_recorded_with_torch_s_coefficient():
    from torch.nn.utils import clip_grad_norm_  # imported before the wrapper exists, as frameworks do

    params = _params()
    fake = FakeSession(params)
    clipping.register(fake)
    try:
        before = [p.grad.clone() for p in params]
        total = clip_grad_norm_((p for p in params), 0.5)  # a generator, as model.parameters()
    finally:
        clipping.unregister(fake)
    assert len(fake.calls) == 1
    scaled, coef = fake.calls[0]
    assert scaled == {id(p) for p in params}
    want = torch.clamp(0.5 / (total + 1e-6), max=1.0)
    assert coef.dtype == torch.float32 and torch.equal(coef, want)
    for b, p in zip(before, params, strict=True):
        assert torch.equal(b * coef, p.grad)  # torch scaled them by exactly that
    # unregistered: nothing is told
    clip_grad_norm_(params, 0.5)
    assert len(fake.calls) == 1


def test_session_clip_takes_whole_model_refuses_part_and_twice():
    """What a session's attachment hands its recorder for every clip torch reports."""
    params = _params()
    rec = StepRecorder(torch.optim.SGD(params, lr=0.1), AttachOptions())
    coef = torch.tensor(0.25)
    rec.clipped_params({id(p) for p in params} | {12345}, coef, params)  # a superset (outside the optimizer): fine
    assert rec.clip is coef and rec.refusal is None
    rec.clipped_params({id(params[0])}, coef, params)  # part of them: one coefficient cannot replay it
    assert rec.refusal is not None and "1 of the 3" in rec.refusal
    rec.refusal, rec.clip = None, coef
    rec.clipped_params({id(p) for p in params}, coef, params)  # a second clip in the iteration
    assert rec.refusal is not None and "twice" in rec.refusal
    rec.refusal = None
    rec.clipped_params({999}, coef, params)  # another model's parameters: not ours
    assert rec.refusal is None


def test_disabled_grad_scaler_is_no_scaler():
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert AttachOptions(scaler=scaler).scaler is None
    enabled = torch.amp.GradScaler("cpu")
    assert AttachOptions(scaler=enabled).scaler is enabled


def test_scheduler_cadence_is_learnt():
    p = _params(1)
    opt = torch.optim.SGD(p, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    ready, stale = [], []
    rec = StepRecorder(opt, AttachOptions(scheduler=sched))
    rec.start(0, 1)

    def step(times: int) -> None:  # as the attachment drives it: it acts on what the recorder returns
        k, sent = rec.advance()
        rec.record(k, sent, False, None, None, p, 0)
        for _ in range(times):
            late = rec.stepped("scheduler")
            if late is not None:
                stale.append(late.iteration)
            commit = rec.take_ready()
            if commit is not None:
                ready.append(commit)

    step(2)  # first iteration: once per step is assumed; the second step makes that commit's state stale
    assert [c.iteration for c in ready] == [1] and stale == [1]
    rec.window_closed()
    step(2)
    assert [c.iteration for c in ready] == [1, 2] and stale == [1]  # learnt: leaves after the second step
    rec.window_closed()
    step(3)  # one more than learnt, after the commit left
    assert [c.iteration for c in ready] == [1, 2, 3] and stale == [1, 3]


def test_restore_rank_from_environment(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # before init_process_group (Lightning)
    monkeypatch.delenv("RANK", raising=False)
    assert process_rank(None, 1) == 0  # a one-rank checkpoint needs no rank
    with pytest.raises(ValueError, match="cannot tell which of the checkpoint's 2 ranks"):
        process_rank(None, 2)
    monkeypatch.setenv("RANK", "1")
    assert process_rank(None, 2) == 1
    assert process_rank(0, 2) == 0
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK='one'"):
        process_rank(None, 2)
    with pytest.raises(ValueError, match="rank must be"):
        process_rank(-1, 2)


def test_deferred_rng_applies_once():
    from trainer_hooks.capture import rng as _rng

    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    state = _rng.capture()
    want = (torch.rand(3), random.random(), np.random.rand())
    info = RestoreInfo(7, None, "j", "src", "memory", 2, state)
    torch.rand(5)  # the loop draws (a new DataLoader iterator) before applying
    info.apply_rng()
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]
    with pytest.raises(RuntimeError, match="applied already"):
        info.apply_rng()
    with pytest.raises(ValueError, match="no RNG state"):
        RestoreInfo(7, None, "j", "src", "memory", 2, None).apply_rng()


def test_a_hold_keeps_the_commit_until_released_with_the_extra_state_then():
    """An integration's hold (Lightning's end of batch): the commit waits for it after the
    scheduler stepped, and leaves carrying the extra state given at the release."""
    p = _params(1)
    opt = torch.optim.SGD(p, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    rec = StepRecorder(opt, AttachOptions(scheduler=sched, extra_state=lambda: {"at": "step"}))
    rec.holds.add("loop")
    rec.start(0, 1)
    k, sent = rec.advance()
    rec.record(k, sent, False, None, None, p, 0)
    rec.stepped("scheduler")
    assert rec.take_ready() is None and rec.awaiting == {"loop"}
    rec.release("other", {"at": "nothing"})  # not a hold of this commit: ignored
    assert rec.take_ready() is None
    rec.release("loop", {"at": "batch end"})
    ready = rec.take_ready()
    assert ready.iteration == 1 and ready.extra.get() == {"at": "batch end"}
    assert rec.last_record[1].get() == {"at": "batch end"}  # a resync right after records the same
    rec.release("loop", {"at": "late"})  # nothing pending any more: nothing happens
    assert rec.take_ready() is None and rec.take_pending() is None
