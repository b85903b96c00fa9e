"""The trainer's square root as a table (shadow/core/sqrttab.py): measured from a function, shipped,
checked when it comes from the network, and applied by the numpy and numba paths alike."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from numba import njit

from shadow.core import sqrttab
from shadow.kernels import adam_cpu_table


def estimate_and_refine(x: np.ndarray) -> np.ndarray:
    """A vector library's square root: a 13-bit reciprocal square root estimate ``r``, then one
    Newton step with fused operations, ``fma(fma(-s, s, x), r / 2, s)`` where ``s = x * r``
    (as MKL's AVX-512 path computes it), IEEE below the normal range. From exponent 125 on the
    estimate is rounded, not truncated: a path of its own there, as MKL has near FLT_MAX."""
    x = np.asarray(x, dtype=np.float32)
    e = (x.view(np.uint32) >> 23) & 0xFF
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        exact = (1.0 / np.sqrt(x.astype(np.float64))).astype(np.float32).view(np.uint32)
        half = np.where(e >= 252, np.uint32(0x200), np.uint32(0))
        r = ((exact + half) & np.uint32(0xFFFFFC00)).view(np.float32)
        s = x * r
        h = (r * np.float32(0.5)).astype(np.float64)
        d = (x.astype(np.float64) - s.astype(np.float64) ** 2).astype(np.float32)  # exact, then rounded: an fma
        out = (d.astype(np.float64) * h + s).astype(np.float32)
    normal = (e > 0) & (e < 255)
    return np.where(normal, out, np.sqrt(x)).astype(np.float32)


@pytest.fixture(scope="module")
def table() -> sqrttab.SqrtTable:
    t, note = sqrttab.measure(estimate_and_refine)
    assert t is not None, note
    assert "exponents with tables of their own" in note, note
    return t


def _inputs(seed=0, n=400_000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 0x7F800000, n, dtype=np.uint32)  # every finite non-negative float32
    edges = np.array([0, 1, 0x007FFFFF, 0x00800000, 0x3F800000, 0x7F7FFFFF, 0x7F800000], dtype=np.uint32)
    return np.concatenate([bits, edges]).view(np.float32)


@pytest.mark.slow
def test_the_table_reproduces_the_function_everywhere(table):
    x = _inputs()
    want = estimate_and_refine(x)
    assert not np.array_equal(want.view(np.uint32), np.sqrt(x).view(np.uint32))  # there is something to fix
    assert np.array_equal(table.sqrt(x).view(np.uint32), want.view(np.uint32))
    # the top exponents take another path, and so do the smallest normal ones (where x - s * s
    # underflows): each has a slot of its own; the rest share their parity's
    own = {e for e in range(255) if table.emap[e] >= 2}
    assert {252, 253, 254} <= own and 1 in own and len(own) == table.nslots - 2 < 32, sorted(own)
    assert table.emap[127] == 0 and table.emap[128] == 1 and table.emap[0] == -1  # subnormals: IEEE
    assert table.emap[255] == -1 and (table.emap[256:] == -1).all()  # inf, nan, negatives: IEEE


@njit
def _kernel_sqrt(x, words, emap):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = adam_cpu_table._table_sqrt(x[i], adam_cpu_table._table_word(x[i], words, emap))
    return out


@pytest.mark.slow
def test_the_kernel_reads_the_table_as_numpy_does(table):
    x = _inputs(1)
    assert np.array_equal(_kernel_sqrt(x, table.words, table.emap32).view(np.uint32), table.sqrt(x).view(np.uint32))


def test_ieee_and_inexpressible_functions_give_no_table():
    t, note = sqrttab.measure(np.sqrt)
    assert t is None and note == "IEEE square roots"

    def two_ulp(x):
        s = np.sqrt(np.asarray(x, np.float32))
        b = s.view(np.uint32).copy()
        b[b % 7 == 3] += 2
        return b.view(np.float32)

    t, note = sqrttab.measure(two_ulp)
    assert t is None and "more than one ulp" in note


@pytest.mark.slow
def test_too_many_exponents_of_their_own_give_no_table(monkeypatch):
    monkeypatch.setattr(sqrttab, "MAX_SLOTS", 4)
    t, note = sqrttab.measure(estimate_and_refine)
    assert t is None and "need tables of their own (at most 2)" in note


@pytest.fixture(scope="module")
def built() -> sqrttab.SqrtTable:
    """A table of random bits with one exponent of its own (no measuring: the wire tests only)."""
    rng = np.random.default_rng(3)
    slots = rng.integers(0, 256, 3 * sqrttab.SLOT_BYTES, dtype=np.uint8)
    exponents = [-1] + [(e - 127) & 1 for e in range(1, 255)]
    exponents[254] = 2
    return sqrttab.SqrtTable.build(slots, exponents)


def test_wire_round_trip_and_public(built):
    table = built
    w = table.to_wire()
    back = sqrttab.SqrtTable.from_wire(w)
    assert back.digest == table.digest and np.array_equal(back.slots, table.slots)
    assert np.array_equal(back.emap, table.emap)
    optim = {"kind": "adam", "impl": "single", "sqrt": w}
    pub = sqrttab.public(optim)
    assert pub["sqrt"] == {"digest": table.digest} and optim["sqrt"] is w  # the original is kept
    assert sqrttab.public({"kind": "sgd"}) == {"kind": "sgd"}


def test_a_slot_of_its_own_travels_as_its_difference_from_its_parity_s():
    rng = np.random.default_rng(2)
    base = rng.integers(0, 256, 2 * sqrttab.SLOT_BYTES, dtype=np.uint8)
    own = base[sqrttab.SLOT_BYTES :].copy()  # exponent 127 (odd parity) where 2048 mantissas differ
    own[-256:] ^= 0xFF
    exponents = [-1] + [(e - 127) & 1 for e in range(1, 255)]
    exponents[254] = 2
    t = sqrttab.SqrtTable.build(np.concatenate([base, own]), exponents)
    w = t.to_wire()
    assert len(w["bits"]) < len(zlib.compress(base.tobytes(), 6)) + 4096
    back = sqrttab.SqrtTable.from_wire(w)
    assert np.array_equal(back.slots, t.slots) and back.digest == t.digest


def _bad(w: dict, **changes) -> dict:
    return {**w, **changes}


def test_malformed_tables_from_the_network_are_refused(built):
    table = built
    w = table.to_wire()
    n = table.nslots
    cases = {
        "not a map": ([1, 2], "must be a map"),
        "extra key": (_bad(w, extra=1), "must be a map"),
        "digest type": (_bad(w, digest=5), "digest"),
        "short map": (_bad(w, map=w["map"][:10]), "slot numbers"),
        "map out of range": (_bad(w, map=[sqrttab.MAX_SLOTS] * 255), "slot below"),
        "no slot at all": (_bad(w, map=[-1] * 255), "at least one"),
        "bits type": (_bad(w, bits="text"), "bits"),
        "too big": (_bad(w, bits=b"\0" * (sqrttab.MAX_WIRE_BYTES + 1)), "at most"),
    }
    for name, (d, want) in cases.items():
        problem = sqrttab.check(d)
        assert problem is not None and want in problem, name
        with pytest.raises(ValueError, match=want):
            sqrttab.SqrtTable.from_wire(d)
    raw = zlib.decompress(w["bits"])
    content = {
        "garbage": (_bad(w, bits=b"not zlib"), "does not decompress"),
        "truncated": (_bad(w, bits=zlib.compress(raw[:-1])), "not the"),
        # a bomb: far more than the map names, stopped at what it names
        "longer": (_bad(w, bits=zlib.compress(raw + bytes(64 << 20))), "not the"),
        "fewer slots named": (_bad(w, map=[min(s, n - 2) for s in w["map"]]), "not the"),
        "flipped bit": (_bad(w, bits=zlib.compress(bytes([raw[0] ^ 1]) + raw[1:])), "digest"),
        "digest": (_bad(w, digest="0" * 16), "digest"),
    }
    for name, (d, want) in content.items():
        with pytest.raises(ValueError, match=want) as caught:
            sqrttab.SqrtTable.from_wire(d)
        assert caught.value is not None, name


@pytest.mark.slow
def test_the_table_reaches_the_workers_not_status_or_manifests(world1, tmp_path):
    """torch's default AdamW on CPU, persisted: the workers replay it with the table (the
    checkpoint on disk restores bit for bit), while status replies and the manifest carry
    only its digest."""
    import json

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_hooks
    from shadow.testing import LocalCluster, assert_same_state
    from tests.helpers.loop import train_step
    from tests.helpers.tiny_trainer import build
    from trainer_hooks.optim.describe import cpu_sqrt_table

    local = tmp_path / "local"
    cluster = LocalCluster(tmp_path, args=(f"persist.local.dir={local}", "persist.local.every_n=1"))
    try:
        model, _, sched = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # torch's default: single-tensor
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="sqrt")
        desc = session.attachment.target.optim_desc
        assert desc["impl"] == "single" and desc["bit_exact"]
        for it in range(1, 5):
            train_step(ddp, opt, sched, it)
        assert session.close() == 4
        st = cluster.wait_status(
            lambda st: (st["persist"]["local"]["last_complete"] or {}).get("iteration") == 4, what="iteration 4 on disk"
        )
    finally:
        cluster.stop()
    table = cpu_sqrt_table()[0]
    shown = st["job"]["optim"]
    assert "bits" not in json.dumps(shown)
    if table is not None:
        assert shown["sqrt"] == {"digest": table.digest}
    manifests = sorted(local.rglob("manifest.json"))
    assert manifests, "no checkpoint on disk"
    for path in manifests:
        optim = json.loads(path.read_text())["optim"]
        assert "bits" not in json.dumps(optim) and optim["bit_exact"] is True
        if table is not None:
            assert optim["sqrt"] == {"digest": table.digest}
    fresh, _, _ = build(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    info = trainer_hooks.restore(fresh, fresh_opt, source=str(local), job="sqrt")
    assert info.iteration == 4 and info.tier == "local"
    assert_same_state(
        {"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()},
        {"model": model.state_dict(), "optimizer": opt.state_dict()},
    )
