"""``Tuning``: one typed home for the knobs, built once: argument, then environment, then default."""

from __future__ import annotations

import dataclasses

import pytest

from shadow.config.tuning import ENV, NAMES, Tuning


def test_precedence_is_argument_then_environment_then_default():
    env = {"SHADOW_MAX_LAG": "7", "SHADOW_WORKER_LOST_S": "1.5"}
    t = Tuning.load(env, worker_lost_s=2.5)
    assert t.worker_lost_s == 2.5  # the argument wins over the environment
    assert t.max_lag_iterations == 7 and isinstance(t.max_lag_iterations, int)  # the environment over the default
    assert t.heartbeat_s == Tuning().heartbeat_s == 0.5  # the default
    assert Tuning.load(env, max_lag_iterations=None).max_lag_iterations == 7  # None: not given


def test_it_is_frozen_and_replace_checks_again():
    t = Tuning()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.max_runs = 3  # type: ignore[misc]
    assert t.replace(max_runs=3).max_runs == 3 and t.max_runs == 65536
    with pytest.raises(ValueError, match=r"tuning.max_runs=-1 must be >= 0"):
        t.replace(max_runs=-1)


@pytest.mark.parametrize(
    "env,match",
    [
        ({"SHADOW_HEARTBEAT_S": "fast"}, r"SHADOW_HEARTBEAT_S='fast' is not a number"),
        ({"SHADOW_WORKER_SLOTS": "2.5"}, r"tuning.worker_slots=2.5 must be a whole number"),
        ({"SHADOW_FETCH_TIMEOUT_S": "-1"}, r"tuning.fetch_timeout_s=-1.0 must be >= 0"),
    ],
)
def test_a_bad_value_names_the_knob(env, match):
    with pytest.raises(ValueError, match=match):
        Tuning.load(env)


def test_an_unknown_field_is_refused_with_the_list():
    with pytest.raises(ValueError, match=r"unknown tuning field\(s\) \['max_lag'\]"):
        Tuning.load({}, max_lag=3)


def test_environ_rebuilds_the_same_tuning_in_a_child_process():
    t = Tuning.load({}, worker_lost_s=1.5, seq_window_messages=64)
    assert t.environ() == {"SHADOW_WORKER_LOST_S": "1.5", "SHADOW_SEQ_WINDOW": "64"}
    assert Tuning.load(t.environ()) == t
    assert Tuning().environ() == {}


def test_every_field_has_a_unit_or_a_count_in_its_name_and_one_variable():
    units = ("_s", "_bytes", "_iterations", "_messages", "_elements", "_port")
    counts = ("worker_slots", "worker_hugepages", "max_runs", "serve_max_fetches", "persist_buffers")
    counts += ("attach_pending_jobs", "attach_pending_ranks", "compress_threads")
    for name in NAMES:
        assert name.endswith(units) or name in counts, name
    assert len(set(NAMES.values())) == len(NAMES) and ENV[NAMES["max_lag_iterations"]] == "max_lag_iterations"


def test_services_take_a_tuning_group_on_the_command_line(monkeypatch):
    from shadow.cli._compose import UsageError, parse
    from shadow.config import ClusterConfig, WorkerConfig

    monkeypatch.setenv("SHADOW_HEARTBEAT_S", "0.25")
    cfg = parse(ClusterConfig, ["workers=2", "tuning.worker_lost_s=1.5"])
    t = cfg.tuning.resolve()
    assert t.worker_lost_s == 1.5 and t.heartbeat_s == 0.25  # the command line, then the environment
    assert t.environ() == {"SHADOW_WORKER_LOST_S": "1.5", "SHADOW_HEARTBEAT_S": "0.25"}  # what its workers get
    assert parse(WorkerConfig, ["tuning.seq_window_messages=64"]).tuning.resolve().seq_window_messages == 64
    for bad, said in (
        ("tuning.worker_lost_s=-1", "must be >= 0"),
        ("tuning.max_lag=3", "unknown key 'tuning.max_lag'"),
        ("tuning.max_runs=many", "takes an integer"),
        ("tuning=3", "tuning is a section"),
    ):
        with pytest.raises(UsageError, match=said):
            parse(ClusterConfig, [bad])


def test_the_coordinator_runs_with_the_tuning_it_is_given():
    from shadow.coordinator.outbox import RecordingOutbox
    from shadow.coordinator.server import Coordinator

    t = Tuning.load({}, worker_lost_s=0.75, persist_skip_log_s=5.0)
    coord = Coordinator("tcp://127.0.0.1:1", workers=1, outbox=RecordingOutbox(), tuning=t)
    assert coord.state.tuning is t and coord.persist.tuning is t


def test_the_worker_and_its_parts_run_with_the_tuning_they_are_given():
    from shadow.worker.server import Worker

    t = Tuning.load({}, serve_max_fetches=3, seq_window_messages=8)
    w = Worker("tcp://127.0.0.1:1", tuning=t)
    assert w.state.tuning is t
    assert w.fetches.state is w.state and w.data.state is w.state and w.apply.state is w.state


def test_no_module_reads_a_knob_from_the_environment_but_tuning():
    """One home, read once: every SHADOW_<knob> variable is read by ``Tuning.load`` only,
    and the module that held the knobs before it is gone."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    assert not (root / "shadow" / "knobs.py").exists()
    names = "|".join(re.escape(v) for v in ENV)
    read = re.compile(rf"(?:environ(?:\.get)?|getenv)\(\s*[\"'](?:{names})[\"']|environ\[\s*[\"'](?:{names})[\"']")
    offenders = []
    for path in [*(root / "shadow").rglob("*.py"), *(root / "trainer_hooks").rglob("*.py")]:
        if path.name == "tuning.py" or read.search(path.read_text()) is None:
            continue
        offenders.append(str(path.relative_to(root)))
    assert offenders == []
    assert "knobs" not in {p.stem for p in (root / "shadow").glob("*.py")}


def test_the_wire_limits_follow_the_tuning_they_are_given():
    from shadow.transport import data_limit, fetch_limit
    from shadow.transport.receive import FrameReceiver
    from shadow.wire import frames as F

    big = Tuning(max_commit_bytes=96 << 20, fetch_chunk_bytes=128 << 20, max_runs=1 << 20)
    assert data_limit(big) >= 96 << 20 and data_limit(big) >= F.HEADER_SIZE + (1 << 20) * F.RUN_SIZE
    assert data_limit(big) > data_limit()
    assert fetch_limit(Tuning(fetch_chunk_bytes=3 << 30)) == 3 << 30 > fetch_limit()  # a client takes whole chunks
    rx = FrameReceiver(None, big)
    assert (rx.max_runs, rx.max_commit_bytes) == (1 << 20, 96 << 20)
