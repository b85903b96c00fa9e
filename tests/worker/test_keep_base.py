"""A worker keeps its state as a new epoch's base when the coordinator offers it
(``configure``'s ``keep``) and it holds exactly that: the previous epoch applied through the
new base, same job, layout, range, world and optimizer. The ranks then prove their state
equal by digests (``trainer_hooks.session.bootstrap.prove``) instead of sending it: a proof
that checks out completes the base like STATE frames; one that differs makes the worker
stale (a resync sends the state whole); a rank that sends STATE frames after all gets
arrays of the new epoch's own, and the previous epoch's (still serving restores) are never
written.

Units: the worker's routes and data path in this process, without services."""

from __future__ import annotations

import msgpack
import numpy as np
import torch
import xxhash

from shadow.core.optimizers import AdamGroup
from shadow.wire import frames as F
from shadow.worker.assignment import Assignment
from tests.worker.test_worker_parts import BASE, LAYOUT, bootstrapped, configure, ctrl, data_path, worker
from trainer_hooks.session.bootstrap import prove

GROUP = AdamGroup(
    lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False, decoupled=True
)


def _held(w) -> Assignment:
    """Epoch 2 of job ``j`` applied through ``BASE``, with distinct values in every field."""
    w.dispatch(ctrl("configure", **configure(epoch=2)))
    s = w.state.assignment
    for k, f in enumerate(s.state.fields()):
        s.state.array(f)[:] = np.arange(s.state.size, dtype=np.float32) * (k + 1) + 0.5
    bootstrapped(s)
    w.dispatch(ctrl("apply", epoch=2, iteration=BASE, persist=False))
    assert s.applied == BASE
    return s


def test_a_worker_keeps_exactly_the_state_it_holds_at_the_new_base():
    w, out = worker()
    old = _held(w)
    before = {f: old.state.array(f).copy() for f in old.state.fields()}
    w.dispatch(ctrl("configure", **configure(epoch=3, keep=2)))
    s = w.state.assignment
    assert out.last("configured") == {"epoch": 3, "kept": True} and s.kept
    assert w.state.retired is old  # restores still read epoch 2 until epoch 3 holds its base
    for f in s.state.fields():
        assert np.shares_memory(s.state.array(f), old.state.array(f))  # nothing copied, nothing allocated
        assert np.array_equal(s.state.array(f), before[f])
    assert "keep" not in s.config  # what a rejoin sends back describes the epoch, not the offer


def test_a_worker_keeps_nothing_it_does_not_hold_as_offered():
    for why, change in [
        ("another epoch", {"keep": 1}),
        ("another base", {"keep": 2, "iteration": BASE + 1}),
        ("another range", {"keep": 2, "start": 2}),
        ("another optimizer", {"keep": 2, "optim": {**configure()["optim"], "vec_width": 8}}),
        ("another job", {"keep": 2, "job": "other"}),
    ]:
        w, out = worker()
        _held(w)
        w.dispatch(ctrl("configure", **configure(epoch=3, **change)))
        assert out.last("configured") == {"epoch": 3}, why
        assert not w.state.assignment.kept, why


def _commit(s: Assignment, kept: dict | None, sent: int) -> bytes:
    n = len(LAYOUT.params)
    replay = {
        "iteration": BASE,
        "rank": 0,
        "sent": sent,
        "skipped": [],
        "groups": [GROUP.to_wire()],
        "clip": None,
        "bootstrap": True,
        "steps": [3.0] * n,
        "has_state": [True] * n,
    }
    if kept is not None:
        replay["kept"] = kept
    return msgpack.packb({"replay": replay, "blob": b"rng"}, use_bin_type=True)


def _deliver(data, push, kind: F.Kind, field: F.Field, seq: int, payload: bytes, s: Assignment) -> None:
    runs = ((0, len(payload) // (4 if kind == F.Kind.STATE else 1), F.checksum(payload)),)
    head = F.Header(kind, field, s.job_id, s.epoch, 0, 1, s.layout_hash, BASE, seq, runs).pack()
    push.send_multipart([head, payload])
    assert data.sock.poll(2000)
    data.on_message(data.sock)


def _proof(values: dict) -> tuple[dict, int]:
    """What a rank holding ``values`` (field -> array of the whole layout) proves to one worker
    holding all of it: the digests of ``prove``, over pieces of two tensors."""
    kept, sent = [{}], [0]
    for f, arr in values.items():
        t = torch.from_numpy(arr.copy())
        pieces = [(0, t[:5]), (5, t[5:])]
        prove(f, pieces, [[(0, 0, len(arr))]], kept, sent)
    return kept[0], sent[0]


def _kept_worker():
    """A worker whose epoch 3 kept epoch 2's state, on a live data path."""
    w, out = worker()
    old = _held(w)
    w.dispatch(ctrl("configure", **configure(epoch=3, keep=2)))
    state, rec, data, push = data_path()
    state.assignment, state.retired = w.state.assignment, old
    return old, state, rec, data, push


def test_a_proof_that_checks_out_completes_the_base_without_a_byte_of_state():
    old, state, out, data, push = _kept_worker()
    s = state.assignment
    try:
        kept, sent = _proof({f: old.state.array(f) for f in s.state.fields()})
        _deliver(data, push, F.Kind.COMMIT, F.Field.GRAD, 0, _commit(s, kept, sent), s)
        assert out.kinds() == ["prepared"] and out.last("prepared")["iteration"] == BASE
        assert data.bytes_in < 1000 and not s.stale
        assert s.inbox.slots[BASE].blobs == {0: b"rng"}
    finally:
        push.close(linger=0)
        data.close()


def test_a_proof_that_differs_makes_the_worker_stale_and_changes_nothing():
    old, state, out, data, push = _kept_worker()
    s = state.assignment
    before = old.state.param.copy()
    try:
        theirs = {f: old.state.array(f).copy() for f in s.state.fields()}
        theirs[F.Field.EXP_AVG][7] += 1e-3  # the trainer changed a moment after its restore
        kept, sent = _proof(theirs)
        _deliver(data, push, F.Kind.COMMIT, F.Field.GRAD, 0, _commit(s, kept, sent), s)
        assert out.kinds() == ["stale"] and s.stale
        reason = out.last("stale")["reason"]
        assert "exp_avg in [0, 12) differs from the state this worker kept for iteration 5" in reason
        assert state.rejected["kept_mismatch"] == 1
        assert np.array_equal(old.state.param, before)
    finally:
        push.close(linger=0)
        data.close()


def test_a_proof_run_outside_the_range_empty_or_proved_twice_is_refused():
    for why, runs in [("twice", [(0, 4), (2, 4)]), ("outside", [(10, 4)]), ("empty", [(0, 0)])]:
        old, state, out, data, push = _kept_worker()
        s = state.assignment
        try:
            arr = old.state.param
            packed = [(d, n, xxhash.xxh3_64_intdigest(arr[d : d + n])) for d, n in runs]
            kept = {int(F.Field.PARAM): np.asarray(packed, dtype="<u8").tobytes()}
            _deliver(data, push, F.Kind.COMMIT, F.Field.GRAD, 0, _commit(s, kept, 0), s)
            assert s.stale and state.rejected["kept_mismatch"] == 1, why
            assert ("twice" in out.last("stale")["reason"]) == (why == "twice"), why
        finally:
            push.close(linger=0)
            data.close()


def test_state_frames_after_all_land_in_arrays_of_the_new_epochs_own():
    old, state, out, data, push = _kept_worker()
    s = state.assignment
    before = {f: old.state.array(f).copy() for f in old.state.fields()}
    try:
        mine = {f: np.full(LAYOUT.total, 2.0 + int(f), dtype=np.float32) for f in s.state.fields()}
        for seq, (f, values) in enumerate(mine.items()):
            _deliver(data, push, F.Kind.STATE, f, seq, values.tobytes(), s)
        assert not s.kept
        _deliver(data, push, F.Kind.COMMIT, F.Field.GRAD, len(mine), _commit(s, None, LAYOUT.total * len(mine)), s)
        assert out.kinds() == ["prepared"]
        for f in s.state.fields():
            assert np.array_equal(s.state.array(f), mine[f])
            assert np.array_equal(old.state.array(f), before[f])  # the retired epoch's, still served
    finally:
        push.close(linger=0)
        data.close()


def test_a_proof_to_a_worker_that_took_state_frames_is_refused():
    old, state, out, data, push = _kept_worker()
    s = state.assignment
    try:
        _deliver(data, push, F.Kind.STATE, F.Field.PARAM, 0, old.state.param.tobytes(), s)
        kept, sent = _proof({F.Field.EXP_AVG: old.state.exp_avg})
        _deliver(data, push, F.Kind.COMMIT, F.Field.GRAD, 1, _commit(s, kept, sent + LAYOUT.total), s)
        assert s.stale and state.rejected["kept_mismatch"] == 1
    finally:
        push.close(linger=0)
        data.close()
