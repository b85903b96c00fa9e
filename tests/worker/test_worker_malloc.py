"""Workers start with glibc's malloc on transparent huge pages (shadow/worker/malloc.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shadow.worker import malloc

needs_it = pytest.mark.skipif(not malloc.wanted({}), reason="no glibc 2.35+ with transparent huge pages here")


@needs_it
def test_environ_adds_the_tunable_once_and_keeps_others():
    env = malloc.environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + malloc.TUNABLE and env["X"] == "1"
    assert malloc.environ(env) == env  # already there: unchanged
    assert malloc.environ({})["GLIBC_TUNABLES"] == malloc.TUNABLE


def test_turned_off_by_the_knob():
    off = {"SHADOW_WORKER_HUGEPAGES": "0"}
    assert not malloc.wanted(off)
    assert "GLIBC_TUNABLES" not in malloc.environ(off)


@needs_it
def test_reexec_starts_the_same_command_again_with_the_tunable():
    code = "import os; from shadow.worker import malloc; malloc.reexec(); print(os.environ.get('GLIBC_TUNABLES'))"
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == malloc.TUNABLE
