"""The trainer side by part: the step recorder alone (no sockets, no callbacks), an
attachment's pipeline driven without a session or sockets (its sender made by the factory
it is given), fault injection as a sender factory (nothing patched), the attach options,
the explicit ``attach`` signature, the hook slot (one per DDP model, plain reduction when
no session is attached), what ``close`` releases, and what a failed ``Attachment.open``
or resync leaves behind (nothing)."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import re
import threading
import time
import weakref

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.core.errors import ShadowUsageError
from tests.conftest import ROOT
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build
from trainer_hooks.capture.model import build_layout
from trainer_hooks.session import bootstrap
from trainer_hooks.session import commit as commit_parts
from trainer_hooks.session.attachment import Attachment
from trainer_hooks.session.hook import HookSlot
from trainer_hooks.session.items import Refused
from trainer_hooks.session.options import AttachOptions
from trainer_hooks.session.recorder import StepRecorder


def _recorder(**options):
    model, opt, sched = build()
    return model, opt, StepRecorder(opt, AttachOptions(**options))


_EARLIER: set[threading.Thread] = set()  # sender threads a failed test elsewhere left running


def _senders() -> list[threading.Thread]:
    """Live sender threads, but for any the test that ran before this one left behind."""
    live = [t for t in threading.enumerate() if t.name.startswith("shadow-sender") and t.is_alive()]
    return [t for t in live if t not in _EARLIER]


@pytest.fixture(autouse=True)
def _note_earlier_senders():
    """What this file's sender checks ignore: a sender left running by an earlier test (its
    own failure, reported there) would otherwise fail every check here too."""
    _EARLIER.clear()
    _EARLIER.update(t for t in threading.enumerate() if t.name.startswith("shadow-sender"))


def test_the_recorder_tracks_an_iteration_without_sockets():
    model, opt, rec = _recorder(extra_state=lambda: {"pos": torch.tensor([11])}, tokens=lambda: 480)
    layout, params = build_layout(model, opt)
    rec.start(5, 2)
    with rec.lock:
        assert rec.bucket(0) == 6 and rec.bucket(1) == 6
        with pytest.raises(ShadowUsageError, match="bucket 0 was all-reduced twice in iteration 6"):
            rec.bucket(0)
        rec.staged([3, 4], [(0, 1)])
        rec.staged([1, 0], [])
    params[0].grad = torch.full_like(params[0], 0.125)  # every other param has no gradient: skipped
    rec.read_probes(params)  # before the step: the probed gradients, copied
    kept, grads = rec.probes
    assert kept == [(0, 1)] and grads.get().tolist() == [0.125] and rec.samples == []
    rec.unscaled(torch.tensor(0.25))  # tensors, as GradScaler and clip_grad_norm_ leave them: not read here
    rec.clipped(torch.tensor(0.5))
    k, sent = rec.advance()
    assert (k, sent, rec.next, rec.seen) == (6, [4, 4], 7, set())
    commit = rec.record(k, sent, False, torch.tensor(8.0), torch.tensor(0.0), params, rank=0)
    assert "clip" not in commit.replay and commit.replay["skipped"] == list(range(1, len(params)))
    # the sender resolves what the step copied: 1.0 staged, times 0.25 then 0.5, is what the step used
    replay = commit_parts._resolve(commit, {(0, 1): 1.0}, layout)
    assert replay["iteration"] == 6 and replay["clip"] == 0.5 and replay["inv_scale"] == 0.25
    assert replay["grad_scale"] == 8.0 and replay["tokens"] == 480 and not replay["skip_step"]
    with pytest.raises(Refused, match="changed between DDP's all-reduce and optimizer.step"):
        commit_parts._resolve(commit, {(0, 1): 2.0}, layout)
    extra = commit.extra.get()
    assert torch.equal(extra["pos"], torch.tensor([11])) and rec.last_record == (commit.rng, commit.extra)
    assert rec.clip is None and rec.inv_scale is None and rec.probes is None  # they belong to one iteration
    # nothing to wait for: the caller takes it at once (the recorder calls nothing back)
    assert rec.ready and rec.take_ready() is commit and rec.take_ready() is None and rec.take_pending() is None
    # a fused optimizer under GradScaler skips on the device: found_inf decides, read by the sender
    rec.advance()
    skipped = rec.record(7, [0, 0], False, torch.tensor(8.0), torch.tensor(1.0), params, rank=0)
    assert commit_parts._resolve(skipped, {}, layout)["skip_step"] is True


def test_the_recorder_waits_for_the_scheduler_and_scaler():
    _, opt, sched = build()
    scaler = torch.amp.GradScaler("cpu")
    rec = StepRecorder(opt, AttachOptions(scheduler=sched, scaler=scaler))
    assert list(inspect.signature(StepRecorder).parameters) == ["optimizer", "options"]  # nothing to call back
    rec.start(0, 1)
    k, sent = rec.advance()
    first = rec.record(k, sent, True, None, None, [], rank=1)
    assert rec.take_ready() is None and rec.pending is first  # it waits, pending
    assert rec.stepped("scaler") is None and rec.take_ready() is None
    assert rec.stepped("scheduler") is None  # once per step until the loop shows otherwise
    assert rec.take_ready() is first and rec.pending is None
    rec.window_closed()
    k, sent = rec.advance()
    second = rec.record(k, sent, True, None, None, [], rank=1)
    assert not rec.ready and rec.awaiting == {"scheduler", "scaler"}
    rec.stepped("scaler")
    assert rec.take_ready() is None
    rec.stepped("scheduler")
    assert rec.ready and rec.take_ready() is second
    # the scheduler steps once more after that commit left: the recorder says so, nothing else
    late = rec.stepped("scheduler")
    assert late.iteration == 2 and "stepped 2 times after optimizer step 2" in late.why
    assert rec.take_ready() is None


class _Socket:
    """A connection to the coordinator that keeps what is sent on it."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False

    def send(self, data, flags=0) -> None:
        self.sent.append(bytes(data))

    def close(self, linger=None) -> None:
        self.closed = True


def _drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_an_attachment_runs_the_pipeline_with_the_sender_it_is_given(world1):
    """No session, no sockets: the attachment is built with a handshake answer and a sender
    factory, its bucket handler stages what DDP reduces, and its step drives the recorder
    and queues the commit the recorder hands back once the scheduler has stepped."""
    import msgpack

    from shadow.wire import messages as M
    from trainer_hooks.session.handshake import Handshake
    from trainer_hooks.session.items import CommitItem, GradItem
    from trainer_hooks.session.recovery import ErrorLatch
    from trainer_hooks.session.sender import Sender
    from trainer_hooks.session.target import Target

    model, opt, sched = build()
    ddp = DDP(model)
    target = Target.of(ddp, opt, exact=True)
    total = target.layout.total
    reply = {"epoch": 3, "job_id": 7, "workers": [{"start": 0, "stop": total, "data": "tcp://127.0.0.1:9"}]}
    answer = Handshake.from_reply("tcp://127.0.0.1:8", 0, reply)
    with pytest.raises(dataclasses.FrozenInstanceError):
        answer.epoch = 4  # the answer is fixed for the epoch
    made = []

    def factory(*args, **kwargs):
        made.append(Sender(*args, **kwargs))  # never started: its queue is what the test reads
        return made[-1]

    options = AttachOptions(scheduler=sched)
    rec, dealer = StepRecorder(opt, options), _Socket()
    att = Attachment(target, answer, options, ErrorLatch(), rec, dealer, sender_factory=factory)
    rec.start(0, len(answer.shards))
    assert made == [att.sender] and att.sender.endpoints == ["tcp://127.0.0.1:9"] and att.sender.epoch == 3
    assert "sender_class" not in vars(Attachment)
    slot = HookSlot.of(ddp)
    slot.bind(att.on_bucket, None, None)
    try:
        torch.manual_seed(1)
        x, y = torch.randint(0, 37, (4, 6)), torch.randint(0, 37, (4,))
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        att.before_step()
        att.read_probes()
        opt.step()
        att.after_step(False)
    finally:
        slot.unbind(att.on_bucket)
    grads = _drain(att.sender.q)
    assert grads and all(isinstance(i, GradItem) and i.iteration == 1 for i in grads)
    assert rec.pending is not None and rec.pending.iteration == 1  # waits for the scheduler
    sched.step()
    att.stepped("scheduler")
    (item,) = _drain(att.sender.q)
    assert isinstance(item, CommitItem) and item.iteration == 1 and rec.pending is None
    ring = att.ring.array
    probed = {(pidx, elem): ring[g.ring_off + pos] for g in grads for pos, pidx, elem in g.probes}
    _, (body,) = item.make(probed)  # what the sender thread does: the probed gradients check out
    replay = msgpack.unpackb(body, raw=False)["replay"]
    assert replay["iteration"] == 1 and replay["sent"] == sum(g.nelem for g in grads) and not replay["skip_step"]
    att.close(wait=False)
    assert dealer.closed and M.decode(dealer.sent[-1])["t"] == "detach" and att.ring is None


def test_the_tally_adds_closed_attachments_and_counts_unprotected_steps(caplog):
    """A session's totals without a session: a closed attachment's figures are added once,
    steps taken while streaming nothing are counted (and warned about every ``warn_every``),
    and a live attachment's figures count on top of the totals, a closed one's do not."""
    from trainer_hooks.session.tally import Tally

    def figures(hook_s: float, buckets: int) -> dict:
        return {"hook_s": hook_s, "buckets": buckets, "blocked_s": 0.5, "bytes_out": 10, "messages_out": 2}

    tally = Tally(5, rank=0, warn_every=2)
    tally.add(dict(figures(1.0, 3), occupancy=0.1, high_water=0.2))
    with caplog.at_level("WARNING", logger="trainer_hooks.session.tally"):
        for k in range(6, 9):
            tally.step("the cluster is gone", k, 4)
    assert (tally.unprotected, tally.unprotected_total, tally.unprotected_since) == (3, 3, 6)
    assert sum("WITHOUT new checkpoints" in r.getMessage() for r in caplog.records) == 1
    tally.step(None, 9, 9)
    assert (tally.unprotected, tally.unprotected_total) == (0, 3)
    now = dict(figures(2.0, 1), occupancy=0.3, high_water=0.4)
    state = {"iteration": 9, "degraded": None, "committed": 9, "base_kept": False, "shadow_errors": 0}
    live = tally.stats(now, True, **state)
    assert (live["hook_s"], live["buckets"], live["bytes_out"], live["steps"]) == (3.0, 4, 20, 4)
    assert live["hook_s_per_bucket"] == 0.75 and live["ring_occupancy"] == 0.3 and live["unprotected_steps_total"] == 3
    closed = tally.stats(now, False, **state)
    assert (closed["hook_s"], closed["buckets"], closed["blocked_s"]) == (1.0, 3, 0.5)


def test_fault_injection_is_a_sender_factory_and_patches_nothing():
    """``testing.faults`` hands sessions a factory of faulty senders (through a context
    variable a session reads when built); no class attribute changes, and the faulty
    sender's data channels are the ones it was given, wrapped."""
    from shadow.config.tuning import Tuning
    from trainer_hooks import testing
    from trainer_hooks.session.items import NoEvents
    from trainer_hooks.session.sender import SENDER_FACTORY, Sender

    before = dict(vars(Attachment)), dict(vars(Sender))
    assert SENDER_FACTORY.get() is Sender
    opened = []

    def channels(ctx, endpoints, hwm, curve):
        opened.append((list(endpoints), hwm))
        return object()

    with testing.faults(net="drop=1.0,seed=5") as factory:
        assert SENDER_FACTORY.get() is factory
        s = factory(
            None,
            None,
            ["tcp://127.0.0.1:9"],
            None,
            job_id=7,
            epoch=3,
            rank=0,
            world=1,
            layout_hash=9,
            events=NoEvents(),
            tuning=Tuning(),
            channels=channels,
        )
        assert isinstance(s, testing.FaultySender) and s.net is not None and s.die_at is None
        data = s.open_data(["tcp://127.0.0.1:9"])
        assert isinstance(data, testing.FaultyDataSender) and data.net is s.net and len(opened) == 1
        s.net = None  # switched off on a live sender
        assert data.net is None
    assert SENDER_FACTORY.get() is Sender
    assert (dict(vars(Attachment)), dict(vars(Sender))) == before
    with pytest.raises(ValueError, match="unknown fault 'jam'"):
        testing.sender_factory(net="jam=1")
    assert testing.sender_factory(die_at="4:2").keywords == {"net_spec": None, "die_at": (4, 2)}


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(policy="wait"), "back-pressure policy 'wait'"),
        (dict(audit_every=-1), "audit_every=-1"),
        (dict(audit_every=1.5), "audit_every=1.5"),
        (dict(audit_every=True), "audit_every=True"),
        (dict(tokens=5), "tokens must be a callable"),
        (dict(extra_state={"a": 1}), "extra_state must be a callable"),
        (dict(comm_hook="bf16"), "comm_hook must be a DDP communication hook"),
        (dict(scaler=object()), "scaler must be a torch.amp.GradScaler"),
        (dict(scheduler=object()), "scheduler must be a torch.optim.lr_scheduler"),
        (dict(job="../x"), "job"),
    ],
)
def test_attach_options_are_checked_at_construction(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        AttachOptions(**bad)


def test_attach_options_are_typed_and_frozen():
    o = AttachOptions(audit_every=3, audit_strict=1)
    assert o.audit_every == 3 and o.audit_strict is True and o.observed == {}
    with pytest.raises(AttributeError):
        o.policy = "skip"


def test_a_session_takes_options_or_their_keywords_not_both(world1):
    model, opt, sched = build()
    with pytest.raises(TypeError, match="either as an AttachOptions or as keywords"):
        trainer_hooks.Session(DDP(model), opt, "tcp://127.0.0.1:1", AttachOptions(), job="x")
    with pytest.raises(TypeError, match="unexpected keyword argument 'polcy'"):
        trainer_hooks.Session(DDP(model), opt, "tcp://127.0.0.1:1", polcy="skip")
    with pytest.raises(ValueError, match="back-pressure policy"):
        trainer_hooks.Session(DDP(model), opt, "tcp://127.0.0.1:1", policy="wait")


def test_options_take_a_tuning_built_once_from_argument_environment_default(monkeypatch):
    from shadow.config.tuning import Tuning

    monkeypatch.setenv("SHADOW_BLOCK_TIMEOUT_S", "7.5")
    assert AttachOptions().tuning == Tuning(block_timeout_s=7.5)  # read when the options are built
    opts = AttachOptions()
    monkeypatch.setenv("SHADOW_BLOCK_TIMEOUT_S", "9")
    assert opts.tuning.block_timeout_s == 7.5  # and never again
    given = Tuning(ring_iterations=2)
    assert AttachOptions(tuning=given).tuning is given  # an argument wins over the environment
    with pytest.raises(TypeError, match="tuning must be a shadow.config.tuning.Tuning"):
        AttachOptions(tuning={"ring_iterations": 2})


def test_attach_names_every_argument():
    sig = inspect.signature(trainer_hooks.attach)
    assert list(sig.parameters) == [
        "ddp_model",
        "optimizer",
        "coordinator",
        "scheduler",
        "scaler",
        "extra_state",
        "tokens",
        "job",
        "iteration",
        "overwrite",
        "policy",
        "comm_hook",
        "comm_state",
        "audit_every",
        "audit_strict",
        "exact",
        "tuning",
        "resume",
        "resize",
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(sig.parameters.values())[3:])
    doc = trainer_hooks.attach.__doc__
    assert all(f"    {name}:" in doc for name in list(sig.parameters))


def test_no_fault_injection_in_production_modules():
    """Faults are wrappers (trainer_hooks/testing.py, shadow/testing/): no production module
    reads a fault setting or imports the testing code."""
    prod = [p for p in (ROOT / "trainer_hooks").rglob("*.py") if p.name != "testing.py"]
    service = [p for p in (ROOT / "shadow").rglob("*.py") if "testing" not in p.relative_to(ROOT / "shadow").parts]
    assert len(prod) > 10 and len(service) > 40
    for path in prod + service:
        text = path.read_text()
        assert "SHADOW_FAULT" not in text and "knobs.fault" not in text and "_exit(137)" not in text, path
        assert not re.search(r"^\s*(from|import) trainer_hooks(\.| import )testing", text, re.M), path
        assert not re.search(r"^\s*(from|import) shadow(\.| import )testing", text, re.M), path


def _grads(ddp, seed: int = 3) -> list[torch.Tensor]:
    ddp.zero_grad()
    torch.manual_seed(seed)  # the tiny model's forward draws from the global generator
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    return [p.grad.clone() for p in ddp.parameters() if p.grad is not None]


def test_a_hook_slot_reduces_like_ddp_and_routes_weakly(world1):
    plain = DDP(build()[0])
    model = build()[0]
    ddp = DDP(model)
    slot = HookSlot.of(ddp)
    assert HookSlot.of(ddp) is slot  # registered once per model
    want = _grads(plain)
    assert all(torch.equal(a, b) for a, b in zip(_grads(ddp), want, strict=True))

    class Route:
        def __init__(self):
            self.buckets = 0

        def __call__(self, fut, bucket):
            self.buckets += 1
            return fut

    route = Route()
    slot.bind(route.__call__, None, None)
    assert all(torch.equal(a, b) for a, b in zip(_grads(ddp), want, strict=True)) and route.buckets >= 1
    seen = route.buckets
    slot.unbind(route.__call__)
    _grads(ddp)
    assert route.buckets == seen
    slot.bind(route.__call__, None, None)
    ref = weakref.ref(route)
    del route
    gc.collect()
    assert ref() is None and slot.route is None  # the slot never keeps a session alive
    assert all(torch.equal(a, b) for a, b in zip(_grads(ddp), want, strict=True))


@pytest.mark.slow
def test_close_releases_the_ring_and_the_model_takes_a_new_session(world1, shared_cluster, job):
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    assert session.job == job and session.options.scheduler is sched
    ring = weakref.ref(session.attachment.ring.tensor)
    for it in range(1, 3):
        train_step(ddp, opt, sched, it)
    assert session.close() == 2
    st = session.stats()
    assert session.attachment.ring is None and st["ring_high_water"] > 0
    assert st["buckets"] >= 2 and st["hook_s_per_bucket"] == st["hook_s"] / st["buckets"] > 0
    gc.collect()
    assert ring() is None  # DDP's hook no longer reaches the staging memory
    gone = weakref.ref(session)
    del session
    gc.collect()
    assert gone() is None
    train_step(ddp, opt, sched, 3)  # plain DDP again
    again = trainer_hooks.attach(
        ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job, iteration=3, overwrite=True
    )  # the same DDP model: its one hook serves the new session
    train_step(ddp, opt, sched, 4)
    assert again.close() == 4 and not _senders()


@pytest.mark.slow
def test_a_failed_open_closes_what_it_opened(world1, shared_cluster, job, monkeypatch):
    model, opt, sched = build()

    def broken(att, carry):
        raise RuntimeError("bootstrap broke")

    monkeypatch.setattr(bootstrap, "bootstrap", broken)
    with pytest.raises(RuntimeError, match="bootstrap broke"):
        trainer_hooks.attach(DDP(model), opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    deadline = time.monotonic() + 10
    while _senders():
        assert time.monotonic() < deadline, "a sender thread outlived the failed attach"
        time.sleep(0.05)
    assert type(sched).__name__ == "LambdaLR" and type(sched).step is torch.optim.lr_scheduler.LambdaLR.step


@pytest.mark.slow
def test_a_failed_resync_stops_streaming_and_training_goes_on(world1, shared_cluster, job, monkeypatch):
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    for it in range(1, 3):
        train_step(ddp, opt, sched, it)
    deadline = time.monotonic() + 20
    while session.committed < 2:  # the cut the closed attachment keeps answering with
        assert time.monotonic() < deadline, session.committed
        time.sleep(0.05)

    def refuse(*args, **kwargs):
        raise ConnectionError("no coordinator")

    monkeypatch.setattr(Attachment, "open", refuse)
    session.attachment.recovery.on_resync()  # as if the coordinator asked
    for it in range(3, 6):
        train_step(ddp, opt, sched, it)  # never raises
    # the vote of iteration 3 is read (copied non-blocking) at the boundary after iteration 4
    assert session.degraded == "resync at iteration 4 failed: no coordinator"
    # the session is closed from the failed boundary on: iteration 4 is the last it recorded
    assert session.iteration == 4 and session.stats()["steps"] == 4 and not _senders()
    assert 2 <= session.close() <= 4  # the cut heard before the boundary (3 and 4 may have been committed)


def test_parameters_on_several_devices_are_named():
    from types import SimpleNamespace

    from trainer_hooks.session import device

    names = ["emb.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "ln.weight", "ln.bias"]
    layout = SimpleNamespace(params=[SimpleNamespace(name=n) for n in names])
    params = [torch.zeros(2, device="meta" if i == 1 else "cpu") for i in range(len(names))]
    with pytest.raises(
        ShadowUsageError,
        match=r"on 2 devices \(cpu: emb.weight, fc1.bias, fc2.weight, "
        r"fc2.bias and 2 more; meta: fc1.weight\).*model.to\(device\)",
    ):
        device.device_of(layout, params)
    assert device.device_of(layout, [torch.zeros(1)] * len(names)) == torch.device("cpu")
    assert not device.capturing()  # no CUDA here


@pytest.mark.slow
def test_a_captured_step_is_refused_at_the_step_not_in_backward(world1, shared_cluster, job, monkeypatch):
    from trainer_hooks.session import device

    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    try:
        train_step(ddp, opt, sched, 1)
        monkeypatch.setattr(device, "capturing", lambda: True)  # as under torch.cuda.graph(...)
        x = torch.randint(0, 37, (4, 6))
        ddp(x).sum().backward()  # nothing raised inside DDP
        with pytest.raises(ShadowUsageError, match="captured into a CUDA graph"):
            opt.step()
        assert session.stats()["shadow_errors"] == 0 and session.iteration == 1
    finally:
        monkeypatch.setattr(device, "capturing", lambda: False)
        session.close(wait=False)
