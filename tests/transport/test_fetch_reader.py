"""The one fetch_reply reader (shadow/transport/fetch.py) that restores and peer copies share."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

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


def _reader(out: dict, n: int = 10) -> fetch.ReplyReader:
    return fetch.ReplyReader(
        epoch=3,
        iteration=7,
        start=0,
        stop=n,
        fields=FIELDS,
        who="w",
        target=lambda fld: fetch.as_bytes(out[int(fld)]),
    )


def _read(parts, n: int = 10):
    out = {f: np.zeros(n, dtype=np.float32) for f in FIELDS}
    reader = fetch.read_reply(fetch.ListParts(parts), _reader(out, n))
    fetch.param_indices(reader.head["steps"], 1, "w", "a step")
    return out, reader.extras


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
        (lambda p: _reply(sums=[1, 2]), "malformed"),  # fewer checksums than chunks
        (lambda p: _reply(extras=[[5, "two", 3]]), "malformed"),
        (lambda p: p[:1], "malformed"),  # the head alone
    ],
)
def test_every_defect_is_named_and_only_some_are_worth_a_retry(damage, code):
    with pytest.raises(fetch.FetchError) as err:
        _read(damage(_reply()))
    assert err.value.code == code
    assert err.value.retry == (code in ("moved_on", "busy", "damaged"))


def test_a_reply_fed_part_by_part_from_a_socket_lands_as_each_part_arrives():
    """Each part its own message (a worker's framing): the reader takes what is there
    (zmq.Again: nothing read) and resumes when more comes; the head alone places nothing."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://feed")
    b.connect("inproc://feed")
    try:
        out = {f: np.zeros(10, dtype=np.float32) for f in FIELDS}
        reader, parts = _reader(out), fetch.SocketParts(b, zmq.NOBLOCK)
        with pytest.raises(zmq.Again):
            reader.feed(parts)
        reply = _reply()
        a.send(reply[0])
        assert not reader.feed(parts) and reader.total == 80 and reader.received == 0
        with pytest.raises(zmq.Again):
            reader.feed(parts)
        for i, part in enumerate(reply[1:], start=1):
            a.send(part)
            assert reader.feed(parts) == (i == len(reply) - 1)
            if i == 3:  # the first array's chunks (16, 16, 8 bytes) in place, the second still zero
                assert reader.received == 40 and not out[FIELDS[1]].any()
                assert np.array_equal(out[FIELDS[0]], np.arange(10, dtype=np.float32) + 100 * FIELDS[0])
        reader.finish(parts)
        assert all(np.array_equal(out[f], np.arange(10, dtype=np.float32) + 100 * f) for f in FIELDS)
        assert reader.extras == {5: b"xy"} and reader.received == reader.total
        with pytest.raises(RuntimeError):
            reader.feed(parts)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
