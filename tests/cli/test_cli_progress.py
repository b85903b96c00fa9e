"""The CLI's spinner and progress bar appear only for steps that take over a second (on a
terminal), so quick restores and exports print nothing but their result."""

from __future__ import annotations

import time

import pytest
import rich.progress
import rich.status

from shadow.cli import _render
from shadow.cli._render import byte_progress, stage


@pytest.fixture
def shown(monkeypatch):
    """On a terminal; the bars and spinners started, by kind."""
    started: list[str] = []
    monkeypatch.setattr(_render, "on_terminal", lambda: True)
    monkeypatch.setattr(rich.progress.Progress, "start", lambda self: started.append("bar"))
    monkeypatch.setattr(rich.progress.Progress, "stop", lambda self: started.append("bar stopped"))
    monkeypatch.setattr(rich.status.Status, "start", lambda self: started.append("spinner"))
    return started


def test_a_quick_read_shows_no_bar(shown):
    with byte_progress("reading", after_s=0.5) as progress:
        for i in range(5):
            progress(i, 4)
    assert shown == []


def test_a_slow_read_shows_its_bar_from_the_first_update_after_the_delay(shown):
    with byte_progress("reading the checkpoint", after_s=0.1) as progress:
        progress(1, 4)
        assert shown == []
        time.sleep(0.2)
        progress(2, 4)
        progress(3, 4)
        assert shown == ["bar"]
    assert shown == ["bar", "bar stopped"]


def test_a_quick_stage_shows_no_spinner_and_a_slow_one_does(shown):
    with stage("writing out.pt", after_s=0.5):
        pass
    assert shown == []
    with stage("writing out.pt", after_s=0.05):
        time.sleep(0.3)
    assert shown == ["spinner"]


def test_not_on_a_terminal_nothing_is_shown(capsys):
    with byte_progress("reading", after_s=0.0) as progress:
        assert progress is None
    with stage("writing", after_s=0.0):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""


def _text(renderable) -> str:
    from rich.console import Console

    console = Console(record=True, width=300)
    console.print(renderable)
    return console.export_text()


def test_status_and_ls_say_when_a_replay_is_not_bit_exact(capsys):
    """attach(exact=False) is shown in shadow status (from the job's replay descriptor) and
    shadow ls (from each manifest); a bit-exact replay says so too."""
    job = {
        "name": "j",
        "epoch": 1,
        "status": "running",
        "world": 2,
        "committed": 5,
        "lag_iterations": 0,
        "lag_s": 0.0,
        "cut_time": time.time(),
        "resyncs": 0,
        "optim": {"kind": "adam", "impl": "single", "bit_exact": False, "sqrt": {"digest": "0" * 16}},
    }
    st = {"workers": [], "expected_workers": 0, "job": job}
    assert "NOT bit-exact (attached with exact=False" in _text(_render.status_panel(st, "tcp://x:1"))
    job["optim"]["bit_exact"] = True
    assert "replay: adam single, bit-exact (checked at attach)" in _text(_render.status_panel(st, "tcp://x:1"))
    row = {"job": "j", "iteration": 5, "tier": "local", "time": None, "bytes": 10, "state": "complete", "path": "p"}
    _render.render_checkpoints([dict(row, bit_exact=False), dict(row, iteration=4)], "src")
    out = capsys.readouterr().out
    assert out.count("not bit-exact: exact=False") == 1
