"""Layout, shard and stripe math (property tests)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.layout import ALIGN_ELEMS, Layout, bucket_runs, shard_bounds, stripe_bounds


@given(st.integers(0, 10**7), st.integers(1, 64))
def test_shards_partition_and_align(total, n):
    b = shard_bounds(total, n)
    assert len(b) == n and b[0][0] == 0 and b[-1][1] == total
    for (lo, hi), (lo2, _) in pairwise(b):
        assert hi == lo2 and lo <= hi
    for lo, _ in b:
        assert lo % ALIGN_ELEMS == 0 or lo == total
    if total >= n * ALIGN_ELEMS * 4:
        sizes = [hi - lo for lo, hi in b]
        assert max(sizes) - min(sizes) <= 2 * ALIGN_ELEMS  # balanced


def test_shard_bounds_rejects_zero():
    with pytest.raises(ValueError, match="at least one shard"):
        shard_bounds(10, 0)


@settings(max_examples=200)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=12),
    st.integers(1, 5),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_every_bucket_byte_leaves_once_to_its_owner(numels, world, nshards, rnd):
    """Union over ranks of each rank's runs covers the bucket exactly once and lands every
    element at its own flat position on the shard that owns it."""
    offsets = np.cumsum([0] + numels)[:-1]
    total = int(sum(numels))
    shards = shard_bounds(total, nshards)
    order = list(range(len(numels)))
    rnd.shuffle(order)  # a bucket holds params in any order
    slots, boff = [], 0
    for i in order:
        slots.append((boff, int(offsets[i]), numels[i]))
        boff += numels[i]
    bucket = np.arange(boff)  # bucket element j holds "j"
    expected = np.empty(total, dtype=np.int64)
    for b, f, n in slots:
        expected[f : f + n] = bucket[b : b + n]
    got = np.full(total, -1, dtype=np.int64)
    for stripe in stripe_bounds(boff, world):
        for s, runs in enumerate(bucket_runs(slots, stripe, shards)):
            for run in runs:
                assert shards[s][0] <= run.dst and run.dst + run.nelem <= shards[s][1]
                assert stripe[0] <= run.src and run.src + run.nelem <= stripe[1]
                assert (got[run.dst : run.dst + run.nelem] == -1).all(), "element sent twice"
                got[run.dst : run.dst + run.nelem] = bucket[run.src : run.src + run.nelem]
    assert np.array_equal(got, expected)


def test_layout_hash_and_roundtrip():
    lay = Layout.build([("a.w", (3, 4), 0, True), ("b", (5,), 1, False)], 2)
    assert lay.total == 17 and lay.params[1].offset == 12
    back = Layout.from_dict(lay.to_dict())
    assert back == lay and back.hash == lay.hash
    other = Layout.build([("a.w", (4, 3), 0, True), ("b", (5,), 1, False)], 2)
    assert other.hash != lay.hash
    assert "shape [4, 3]" in other.describe_mismatch(lay)


@pytest.mark.parametrize(
    "bad",
    [
        {"num_groups": 1, "params": [["a", [2], 3, 2, 0, True]]},  # offset gap
        {"num_groups": 1, "params": [["a", [2], 0, 2, 1, True]]},  # group out of range
        {"num_groups": 1, "params": [["a", [2], 0, 3, 0, True]]},  # numel != shape
        {"params": []},
        {"num_groups": 1, "params": [["a"]]},
    ],
)
def test_layout_rejects_malformed(bad):
    with pytest.raises(ValueError):
        Layout.from_dict(bad)


def test_a_received_layout_is_bounded():
    """A layout from the network or a file cannot name more than MAX_ELEMENTS elements,
    more than MAX_DIMS dimensions or MAX_GROUPS groups (a dimension of 10**100 used to be
    taken, and overflowed every offset computed from it)."""
    from shadow.core.layout import MAX_DIMS, MAX_ELEMENTS, MAX_GROUPS, Layout

    def one(shape, groups=1):
        numel = 1
        for s in shape:
            numel *= s
        return {"num_groups": groups, "params": [["w", list(shape), 0, numel, 0, True]]}

    for bad, what in (
        (one([10**100]), "elements"),
        (one([2**24, 2**25]), "elements"),
        (one([1] * (MAX_DIMS + 1)), "dimensions"),
        (one([4], MAX_GROUPS + 1), "groups"),
    ):
        with pytest.raises(ValueError, match=what):
            Layout.from_dict(bad)
    assert Layout.from_dict(one([2**24, 2**23])).total == 2**47 < MAX_ELEMENTS  # a large real one still fits
