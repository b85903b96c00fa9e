"""Model state outside the optimizer (a frozen layer in no param group, BatchNorm running
statistics, a buffer spanning several chunks): captured at attach, sent again when it
changes, and restored bit for bit in every format with ``strict=True`` loading."""

from __future__ import annotations

import queue
import subprocess
import sys

import pytest
import torch

from shadow.config.tuning import Tuning
from shadow.core.errors import LayoutMismatchError
from shadow.export import extras as read_extras
from shadow.testing import LocalCluster
from tests.conftest import ROOT, rank_logs, run_ranks
from tests.helpers.tiny_trainer import build
from trainer_hooks.capture import extras as _extras
from trainer_hooks.session import extras as _tracking

STEPS = 6
POKE = 4  # the frozen layer and the big buffer change in place before this iteration's forward
CHUNK = 64 << 10  # the big buffer (200 KB) spans several chunks, spread over both workers


def _shadow(*args: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "shadow", *args], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and torch.equal(got[k], w), k


def _fresh():
    return build(seed=11, extras=True)


@pytest.mark.slow
def test_frozen_layer_and_buffers_in_every_format(tmp_path):
    local = tmp_path / "ckpt"
    cluster = LocalCluster(
        tmp_path, args=(f"persist.local.dir={local}", "persist.local.every_n=1", "persist.local.keep=0")
    )
    try:
        out, dumps = tmp_path / "out", tmp_path / "dumps"
        assert run_ranks(
            tmp_path,
            "--coordinator",
            cluster.address,
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--extras",
            "--poke-at",
            str(POKE),
            "--dump-dir",
            str(dumps),
            env={"SHADOW_EXTRA_CHUNK_BYTES": str(CHUNK)},
        ) == [0, 0], rank_logs(tmp_path)
        live = {k: torch.load(dumps / f"it{k}-rank0.pt", weights_only=True)["model"] for k in (POKE - 1, STEPS)}
        assert not torch.equal(live[POKE - 1]["base.weight"], live[STEPS]["base.weight"])
        assert not torch.equal(live[POKE - 1]["bn.running_mean"], live[STEPS]["bn.running_mean"])
        final = live[STEPS]
        assert {
            "base.weight",
            "base.bias",
            "bn.running_mean",
            "bn.running_var",
            "bn.num_batches_tracked",
            "table",
        } <= set(final)

        # trainer_hooks.restore into a fresh model (memory tier)
        import trainer_hooks

        model, opt, sched = _fresh()
        info = trainer_hooks.restore(model, opt, source=cluster.address, scheduler=sched, rank=0)
        assert info.iteration == STEPS and info.tier == "memory"
        _same(model.state_dict(), final)

        # shadow restore in each format, and shadow export: strict loads into a fresh model
        _shadow("restore", f"source={cluster.address}", f"out={tmp_path / 'c.pt'}", "format=torch")
        model = _fresh()[0]
        model.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True)["model"], strict=True)
        _same(model.state_dict(), final)

        from safetensors.torch import load_file

        _shadow("restore", f"source={cluster.address}", f"out={tmp_path / 'c.safetensors'}", "format=safetensors")
        _shadow("export", f"source={cluster.address}", f"out={tmp_path / 'w.safetensors'}")
        for name in ("c.safetensors", "w.safetensors"):
            model = _fresh()[0]
            model.load_state_dict(load_file(tmp_path / name), strict=True)
            _same(model.state_dict(), final)

        import torch.distributed.checkpoint as dcp

        _shadow("restore", f"source={cluster.address}", f"out={tmp_path / 'dcp'}", "format=dcp")
        model = _fresh()[0]
        sd = model.state_dict()
        dcp.load({"model": sd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # every key must be there
        model.load_state_dict(sd, strict=True)
        _same(model.state_dict(), final)

        # the persisted checkpoints hold each iteration's values: before and after the change
        _shadow("restore", f"source={local}", f"out={tmp_path / 'old.pt'}", "format=torch", f"iteration={POKE - 1}")
        model = _fresh()[0]
        model.load_state_dict(torch.load(tmp_path / "old.pt", weights_only=True)["model"], strict=True)
        _same(model.state_dict(), live[POKE - 1])
        model, opt, sched = _fresh()
        cluster.wait_status(  # the tier may lag the trainers (or have skipped it once, then asked again)
            lambda st: (st["persist"]["local"]["last_complete"] or {}).get("iteration", -1) >= STEPS,
            what=f"iteration {STEPS} on the local tier",
        )
        trainer_hooks.restore(model, opt, source=str(local), scheduler=sched, iteration=STEPS, rank=0)
        _same(model.state_dict(), final)
    finally:
        cluster.stop()


WORKERS = [{"shard": 0}, {"shard": 1}, {"shard": 0}]  # two shards, shard 0 with two replicas


def _emit(tracker, k: int, chunks: dict, everything: bool = False) -> tuple[list[int], set[int]]:
    """Run one commit's worth of the tracker; fold what it sent into ``chunks`` as the
    workers do (newest chunk per key); returns the counts per worker and the tensors sent."""
    q: queue.Queue = queue.Queue()
    counts = tracker.emit(k, q, everything=everything)
    sent, per_worker = set(), [0] * len(WORKERS)
    while not q.empty():
        item = q.get()
        per_worker[item.worker] += len(item.chunks)
        for key, view in item.chunks:
            assert ((key >> 32) + (key & 0xFFFFFFFF)) % 2 == WORKERS[item.worker]["shard"]  # its shard's replicas
            chunks[key] = bytes(view)
            sent.add(key >> 32)
    assert per_worker == counts
    return counts, sent


def test_tracker_sends_what_changed_only():
    model, opt, _ = build(extras=True)
    tracker = _tracking.ExtrasTracker(model, [p for g in opt.param_groups for p in g["params"]], WORKERS, Tuning())
    names = {n: j + 1 for j, n in enumerate(tracker.names)}
    assert set(names) == {
        "base.weight",
        "base.bias",
        "table",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    }
    chunks: dict = {}
    counts, sent = _emit(tracker, 0, chunks, everything=True)
    assert sent == {0, *names.values()} and counts[0] == counts[2] > 0 and counts[1] > 0
    for k in (1, 2):  # nothing changed: nothing is copied or sent
        assert _emit(tracker, k, chunks) == ([0, 0, 0], set())
    with torch.no_grad():
        model.base.weight.add_(1.0)  # base.bias is re-read with it (same module) but unchanged: not sent
    assert _emit(tracker, 3, chunks)[1] == {names["base.weight"]}
    model.train()
    model.bn(torch.randn(8, 24))  # the kernel updates the running stats without moving their _version
    assert _emit(tracker, 4, chunks)[1] == {
        names["bn.running_mean"],
        names["bn.running_var"],
        names["bn.num_batches_tracked"],
    }
    model.table = torch.arange(7.0)  # reassigned, new shape: the index goes again
    assert _emit(tracker, 5, chunks)[1] == {0, names["table"]}
    decoded, aliases, order = read_extras.decode(chunks)
    assert order == list(model.state_dict()) and aliases == {}
    _same(decoded, {n: model.state_dict()[n] for n in decoded})


class Odd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.frozen = torch.nn.Linear(3, 300).to(torch.bfloat16).requires_grad_(False)
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))
        self.register_buffer("mask", torch.rand(13) > 0.5)
        self.register_buffer("empty", torch.zeros(0, 4))
        self.register_buffer("f64", torch.randn(2, 5, dtype=torch.float64))
        self.register_buffer("scratch", torch.ones(3), persistent=False)
        self.register_buffer("tied", self.mask)  # the same buffer under a second name


def test_any_dtype_roundtrips_in_small_chunks():
    torch.manual_seed(0)
    model = Odd()
    tuning = Tuning(extra_chunk_bytes=64)  # every tensor and the index span several chunks
    tracker = _tracking.ExtrasTracker(model, list(model.lin.parameters()), WORKERS, tuning)
    chunks: dict = {}
    _emit(tracker, 0, chunks, everything=True)
    assert len(chunks) > 20
    decoded, aliases, _ = read_extras.decode(chunks)
    assert aliases == {"tied": "mask"} and "scratch" not in decoded and "lin.weight" not in decoded
    want = model.state_dict()
    _same(decoded, {k: v for k, v in want.items() if k in decoded})
    full = read_extras.model_state(
        {"lin.weight": want["lin.weight"], "lin.bias": want["lin.bias"]}, chunks, {"aliases": {}}
    )
    assert list(full) == list(want)
    fresh = Odd()
    fresh.load_state_dict(full, strict=True)
    _same(fresh.state_dict(), want)


def test_restore_refuses_mismatched_extras_before_changing_anything():
    model, opt, _ = build(extras=True)
    params = [p for g in opt.param_groups for p in g["params"]]
    sd = dict(model.state_dict())
    names = list(_extras.collect(model, params)[0])
    plan = _extras.load_plan(model, params, sd, names)
    assert {id(t) for t, _ in plan} == {id(t) for n, t in model.state_dict(keep_vars=True).items() if n in names}
    with pytest.raises(LayoutMismatchError, match="'table'"):
        _extras.load_plan(model, params, dict(sd, table=torch.zeros(3)), names)
    with pytest.raises(LayoutMismatchError, match="'base.bias' is missing"):
        _extras.load_plan(model, params, {k: v for k, v in sd.items() if k != "base.bias"}, names)
    with pytest.raises(LayoutMismatchError, match="'gone' is not in this model"):
        _extras.load_plan(model, params, sd, names + ["gone"])
    assert _extras.load_plan(model, params, {}, None) == []  # a checkpoint taken without extras
