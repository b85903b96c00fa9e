"""The one fetch_reply reader (shadow/transport/fetch.py) that restores and peer copies share."""

from __future__ import annotations

import numpy as np
import pytest

from shadow.transport import fetch
from shadow.wire import messages as M
from shadow.wire.frames import Field, checksum

FIELDS = [int(Field.PARAM), int(Field.EXP_AVG)]


def _reply(n: int = 10, chunk: int = 16, **over) -> list[bytes]:
    data = {f: np.arange(n, dtype=np.float32) + 100 * f for f in FIELDS}
    chunks = [bytes(data[f].view(np.uint8)[o : o + chunk]) for f in FIELDS for o in range(0, n * 4, chunk)]
    head = dict(
        epoch=3,
        iteration=7,
        start=0,
        stop=n,
        arrays=FIELDS,
        steps=[[0, 7.0]],
        has_state=[0],
        commits=[[0, b"c"]],
        replay=None,
        chunk=chunk,
        sums=[checksum(c) for c in chunks],
        extras=[[5, 2, checksum(b"xy")]],
    )
    head.update(over)
    return [M.encode("fetch_reply", **head), *chunks, b"xy"]


def _read(parts, n: int = 10):
    src = fetch.ListParts(parts)
    head = fetch.read_head(src, epoch=3, iteration=7, start=0, stop=n, fields=FIELDS, who="w")
    out = {f: np.zeros(n, dtype=np.float32) for f in FIELDS}
    fetch.read_arrays(src, head, lambda fld: fetch.as_bytes(out[int(fld)]), "w")
    extras = fetch.read_extras(src, head, "w")
    fetch.param_indices(head["steps"], 1, "w", "a step")
    return out, extras


def test_a_whole_reply_is_read_into_place():
    out, extras = _read(_reply())
    assert all(np.array_equal(out[f], np.arange(10, dtype=np.float32) + 100 * f) for f in FIELDS)
    assert extras == {5: b"xy"}


@pytest.mark.parametrize(
    "damage, code",
    [
        (lambda p: p[:3] + [p[3][:-4]] + p[4:], "malformed"),  # a short chunk
        (lambda p: p[:2] + [bytes(b ^ 1 for b in p[2])] + p[3:], "damaged"),  # applied over while sent
        (lambda p: p + [b"more"], "malformed"),
        (lambda p: p[:-1], "malformed"),  # the extras chunk missing
        (lambda p: [M.encode("error", code="moved_on", message="moved on to 8")], "moved_on"),
        (lambda p: [M.encode("error", code="timeout", message="not in time")], "error"),
        (lambda p: _reply(iteration=6), "mismatch"),
        (lambda p: _reply(stop=12), "mismatch"),
        (lambda p: _reply(steps=[[4, 1.0]]), "malformed"),  # a parameter index out of range
    ],
)
def test_every_defect_is_named_and_only_some_are_worth_a_retry(damage, code):
    with pytest.raises(fetch.FetchError) as err:
        _read(damage(_reply()))
    assert err.value.code == code
    assert err.value.retry == (code in ("moved_on", "busy", "damaged"))
