"""Trainer-side pieces that need no processes: codec, staging ring, layout building,
optimizer checks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from shadow.export import blob as _codec
from trainer_hooks import UnsupportedOptimizerError
from trainer_hooks.capture import rng as _rng
from trainer_hooks.capture.model import LayoutError, build_layout
from trainer_hooks.optim.describe import cpu_sqrt_table, describe
from trainer_hooks.session.staging import RingFullError, StagingRing


def test_codec_roundtrip_keeps_tensors_and_tuples():
    obj = {
        "a": (1, 2.5, "x"),
        "t": torch.arange(6, dtype=torch.int16).reshape(2, 3),
        3: [None, b"\x00\x01"],
        "e": torch.empty(0),
        "nested": {"b": (torch.tensor(1.5),)},
    }
    back = _codec.unpack(_codec.pack(obj))
    assert back["a"] == (1, 2.5, "x") and isinstance(back["a"], tuple)
    assert torch.equal(back["t"], obj["t"]) and back["t"].dtype == torch.int16
    assert back[3] == [None, b"\x00\x01"] and back["e"].numel() == 0
    assert torch.equal(back["nested"]["b"][0], torch.tensor(1.5))


def test_codec_names_the_bad_value():
    with pytest.raises(_codec.EncodeError, match=r"\['extra'\]\['fn'\].*function"):
        _codec.pack({"extra": {"ok": 1, "fn": lambda: 0}})


def test_rng_capture_restore_roundtrip():
    state = _codec.unpack(_codec.pack(_rng.capture()))
    a = (torch.rand(3), random.random(), __import__("numpy").random.rand())
    _rng.restore(state)
    b = (torch.rand(3), random.random(), __import__("numpy").random.rand())
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]


def test_staging_ring_never_hands_out_live_space():
    ring = StagingRing(100)
    rnd = random.Random(0)
    live, owned = [], set()
    for _ in range(5000):
        if live and rnd.random() < 0.5:
            off, n = live.pop(0)
            ring.release(off, n)
            owned -= set(range(off, off + n))
        else:
            n = rnd.randint(1, 40)
            try:
                off = ring.alloc(n, timeout=0.0)
            except RingFullError:
                continue
            cells = set(range(off, off + n))
            assert not cells & owned and off + n <= 100
            owned |= cells
            live.append((off, n))


def test_staging_ring_times_out_when_full():
    ring = StagingRing(10)
    ring.alloc(10, timeout=0)
    with pytest.raises(RingFullError, match="stayed full"):
        ring.alloc(1, timeout=0.05)
    with pytest.raises(ValueError, match="exceeds the staging ring"):
        ring.alloc(11, timeout=0)


def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))


def test_layout_follows_optimizer_order_and_model_names():
    m = _model()
    opt = torch.optim.AdamW([{"params": [m[1].weight]}, {"params": [m[0].weight, m[0].bias, m[1].bias]}])
    layout, params = build_layout(m, opt)
    assert [p.name for p in layout.params] == ["1.weight", "0.weight", "0.bias", "1.bias"]
    assert [p.group for p in layout.params] == [0, 1, 1, 1]
    assert params[1] is m[0].weight


def test_layout_rejects_foreign_and_non_fp32_params():
    m = _model()
    with pytest.raises(LayoutError, match="not a parameter of the model"):
        build_layout(m, torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]))
    m.double()
    with pytest.raises(LayoutError, match="fp32"):
        build_layout(m, torch.optim.AdamW(m.parameters()))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.RMSprop(ps, lr=0.1),
        lambda ps: torch.optim.Adam(ps, capturable=True),
        lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01), fused=True),
    ],
)
def test_unsupported_optimizers_name_the_supported_ones(make):
    with pytest.raises(UnsupportedOptimizerError, match="torch.optim.AdamW, torch.optim.SGD"):
        describe(make(_model().parameters()))


@pytest.mark.parametrize("flags", [{"foreach": False}, {"foreach": True}, {}], ids=["single", "foreach", "default"])
def test_unfused_optimizer_is_replayed_exactly_with_this_cpu_s_square_roots(flags):
    d = describe(torch.optim.AdamW(_model().parameters(), **flags))
    assert d["impl"] in ("single", "foreach") and d["bit_exact"]
    table, _ = cpu_sqrt_table()
    assert ("sqrt" in d) == (table is not None)  # no table where torch's sqrt is IEEE's
    d = describe(torch.optim.AdamW(_model().parameters(), fused=True))
    assert d["impl"] == "fused" and d["bit_exact"] and "sqrt" not in d


def test_an_optimizer_the_replay_cannot_match_is_refused_unless_exact_false(monkeypatch):
    from shadow.core.sqrttab import SLOT_BYTES, SqrtTable
    from trainer_hooks.optim import describe as _optim

    # a table that steps every square root: the replay can no longer match torch here
    wrong = SqrtTable.build(np.full(2 * SLOT_BYTES, 0xFF, np.uint8), [-1] + [(e - 127) & 1 for e in range(1, 255)])
    monkeypatch.setattr(_optim, "cpu_sqrt_table", lambda: (wrong, "a wrong table"))
    with pytest.raises(UnsupportedOptimizerError, match=r"deviates by up to \d+ ulp.*exact=False") as caught:
        describe(torch.optim.AdamW(_model().parameters(), foreach=False))
    assert "CPU AdamW (single)" in str(caught.value) and "fused=True" in str(caught.value)
    with pytest.warns(UserWarning, match="exact=False"):
        d = describe(torch.optim.AdamW(_model().parameters(), foreach=False), exact=False)
    assert d["impl"] == "single" and d["bit_exact"] is False


def test_calibration_keeps_torch_thread_count():
    """numba's first call sets the OpenMP thread count torch shares; attach must not leave
    a 1-thread-per-rank trainer with more threads (it oversubscribed every core: 2.8x
    slower steps on the 32M GPT benchmark)."""
    import subprocess
    import sys

    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from trainer_hooks.optim import describe as _optim\n"
        "_optim.calibrate()\n"
        "print(torch.get_num_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "1", out.stdout + out.stderr


def test_a_busy_metrics_port_does_not_fail_the_attach(monkeypatch, caplog):
    """The metrics port taken by another process: the rank logs it and trains on."""
    import socket

    from trainer_hooks.session import metrics as _metrics

    monkeypatch.setattr(_metrics, "_server", None)
    monkeypatch.setattr(_metrics, "_session", None)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        session = type("FakeSession", (), {"rank": 3})()
        _metrics.publish(session, busy.getsockname()[1])  # must not raise
    assert _metrics._server is None and _metrics._session() is session
    assert "no metrics endpoint" in caplog.text and "pick another metrics_port" in caplog.text
