"""``shadow restore --help`` names every format ``shadow restore format=`` accepts (issue 52:
hf_trainer and lightning worked but were not listed), and a key parsed as a choice can no
longer be documented with fewer values than it accepts."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

from shadow.cli._compose import parse
from shadow.cli._help import keys
from shadow.config import RestoreConfig
from shadow.config.choices import Choice, Format
from tests.conftest import ROOT


def _accepted_formats() -> list[str]:
    """The formats the restore command's parser takes (the enum it parses ``format`` with)."""
    out = []
    for value in Format.values():
        assert parse(RestoreConfig, [f"format={value}"]).format == value
        out.append(value)
    assert {"torch", "dcp", "safetensors", "hf_trainer", "lightning"} <= set(out)
    return out


def _named(value: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", text) is not None


def _help(*args: str) -> str:
    res = subprocess.run([sys.executable, "-m", "shadow", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_restore_help_lists_every_accepted_format():
    accepted = _accepted_formats()
    line = next(ln for ln in _help("restore", "--help").splitlines() if ln.strip().startswith("format="))
    assert [v for v in accepted if not _named(v, line)] == [], line
    summary = next(ln for ln in _help("--help").splitlines() if ln.strip().startswith("restore "))
    assert [v for v in accepted if not _named(v, summary)] == [], summary


class _Colour(Choice):
    red = "red"
    green = "green"
    blue_green = "blue_green"


@dataclass
class _Paint:
    colour: _Colour = _Colour.red  #: red (warm) or green
    other: _Colour = _Colour.green


def test_a_choice_keys_help_names_the_values_its_comment_leaves_out():
    rows = {k: h for k, _, h in keys(_Paint)}
    assert rows["colour"] == "red (warm) or green; also blue_green"
    assert rows["other"] == "one of red, green, blue_green"
