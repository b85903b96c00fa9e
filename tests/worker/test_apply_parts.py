"""The worker applies gradients where the frames put them (parts, no gather copy) and
can fill the persistence snapshot in the same pass: both must equal, bit for bit, the
plain contiguous apply followed by a copy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shadow.core.layout import Layout
from shadow.core.optimizers import AdamGroup, SgdGroup
from shadow.core.sqrttab import SLOT_BYTES, SqrtTable
from shadow.kernels.replay import part_work, segments_for_range, untouched
from shadow.wire.frames import Field
from shadow.worker.shard import ShardState

SIZES = [1000, 37, 4096 + 5, 3, 2500]
ADAM = AdamGroup(
    lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False, decoupled=True
)
SGD = SgdGroup(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-4, nesterov=True, maximize=False)


def _table() -> SqrtTable:
    """Any square root table will do here (random bits): the parts and the snapshot must
    give what the contiguous apply gives, whatever the table says."""
    bits = np.random.default_rng(7).integers(0, 256, 2 * SLOT_BYTES, dtype=np.uint8)
    return SqrtTable.build(bits, [-1] + [(e - 127) & 1 for e in range(1, 255)])


def make_state(kind: str, start: int, stop: int, amsgrad: bool = False, impl: str = "fused") -> ShardState:
    layout = Layout.build([(f"p{i}", (n,), 0, True) for i, n in enumerate(SIZES)], 1)
    optim = {
        "kind": kind,
        "impl": impl,
        "vec_width": 16,
        "tail_width": 8,
        "amsgrad_any": amsgrad,
        "momentum_any": kind == "sgd",
    }
    if impl == "single":  # torch's single-tensor CPU path: the table rule, in blocks
        optim["sqrt"] = _table().to_wire()
    st = ShardState(layout, start, stop, optim)
    rng = np.random.default_rng(0)
    for f in st.fields():
        st.array(f)[:] = rng.standard_normal(st.size).astype(np.float32) ** 2
    return st


def commit(kind: str, skipped=(), amsgrad: bool = False, skip_step: bool = False) -> dict:
    group = SGD if kind == "sgd" else dataclasses.replace(ADAM, amsgrad=amsgrad)
    return {
        "skipped": list(skipped),
        "groups": [group.to_wire()],
        "clip": 0.5,
        "inv_scale": None,
        "grad_scale": None,
        "skip_step": skip_step,
    }


def split(grad: np.ndarray, cuts: list[int], order) -> list[tuple[int, np.ndarray]]:
    """Gradient pieces as frames deliver them: read-only arrays of their own, any order."""
    bounds = [0] + cuts + [len(grad)]
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        a = np.frombuffer(grad[lo:hi].tobytes(), dtype=np.float32)  # its own (read-only) buffer
        parts.append((lo, a))
    parts = [parts[i] for i in order(len(parts))]
    return sorted(parts, key=lambda p: p[0])


@pytest.mark.parametrize(
    "kind,amsgrad,impl",
    [
        ("adam", False, "fused"),
        ("adam", True, "fused"),
        ("sgd", False, "fused"),
        ("adam", False, "single"),
        ("adam", True, "single"),
    ],
)
@pytest.mark.parametrize("skipped", [(), (1, 3)])
def test_parts_and_folded_snapshot_equal_contiguous_apply(kind, amsgrad, impl, skipped):
    total = sum(SIZES)
    start, stop = 500, total - 100  # a range cutting the first and last parameters
    ref, got = make_state(kind, start, stop, amsgrad, impl), make_state(kind, start, stop, amsgrad, impl)
    rng = np.random.default_rng(1)
    for it in range(3):
        grad = rng.standard_normal(ref.size).astype(np.float32)
        c = commit(kind, skipped, amsgrad)
        ref.apply([(0, grad)], c)
        expect = {f: ref.array(f).copy() for f in ref.fields()}
        cuts = sorted(rng.choice(np.arange(1, ref.size), size=6, replace=False).tolist())
        parts = split(grad, cuts, lambda n: rng.permutation(n))
        snap = {f: np.full(got.size, np.nan, dtype=np.float32) for f in got.fields()} if it != 1 else None
        filled = got.apply(parts, c, snap)
        assert filled == (snap is not None)
        for f in ref.fields():
            assert np.array_equal(got.array(f), expect[f]), (f, it)
            if snap is not None:  # every element, including skipped parameters, equals the state
                assert np.array_equal(snap[f], expect[f]), (f, it)
        assert np.array_equal(got.steps, ref.steps) and np.array_equal(got.has_state, ref.has_state)


def test_skipped_step_fills_nothing():
    st = make_state("adam", 0, sum(SIZES))
    before = st.param.copy()
    snap = {f: np.zeros(st.size, np.float32) for f in st.fields()}
    assert st.apply([(0, np.ones(st.size, np.float32))], commit("adam", skip_step=True), snap) is False
    assert np.array_equal(st.param, before) and not snap[Field.PARAM].any()


def test_missing_or_overlapping_gradient_is_refused_and_state_untouched():
    st = make_state("adam", 0, sum(SIZES))
    before = {f: st.array(f).copy() for f in st.fields()}
    g = np.ones(st.size, np.float32)
    with pytest.raises(ValueError, match="lack gradient"):  # a hole in parameter 2
        st.apply([(0, g[:1100]), (1200, g[1200:])], commit("adam"))
    with pytest.raises(ValueError, match="overlap"):
        st.apply([(0, g[:1100]), (1000, g[1000:])], commit("adam"))
    for f in st.fields():
        assert np.array_equal(st.array(f), before[f])
    # a hole in a skipped parameter is fine: nothing there is updated
    lo, hi = st.layout.params[2].offset, st.layout.params[2].offset + st.layout.params[2].numel
    st.apply([(0, g[:lo]), (hi, g[hi:])], commit("adam", skipped=[2]))
    assert np.array_equal(st.param[lo:hi], before[Field.PARAM][lo:hi])
    assert not np.array_equal(st.param[:lo], before[Field.PARAM][:lo])


def test_part_work_rows_and_untouched_ranges():
    segs = segments_for_range([0, 10, 30], [10, 20, 5], [0, 0, 0], 0, 35, "fused", 16, 8)
    work, covered = part_work(segs, [(0, 12), (12, 8), (25, 10)], chunk=4)
    # every row lies inside one segment and one part, and rows tile the covered elements
    assert covered.tolist() == [10, 15, 5]
    rows = work.tolist()
    assert all(hi - lo <= 4 for lo, hi, *_ in rows)
    assert sum(hi - lo for lo, hi, *_ in rows) == 30
    assert [r for r in rows if r[0] == 10][0] == [10, 12, 1, 0, 10]  # segment 1 starts inside part 0
    assert [r for r in rows if r[0] == 12][0] == [12, 16, 1, 1, 0]
    active = np.array([True, False, True])
    assert untouched(work, active, 35) == [(10, 30)]
    assert untouched(work, np.array([True, True, True]), 40) == [(20, 25), (35, 40)]
