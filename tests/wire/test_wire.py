"""Frame and control-message pack/unpack and rejection."""

from __future__ import annotations

import struct

import msgpack
import pytest

from shadow.wire import frames as F
from shadow.wire import messages as M
from shadow.wire import tags


def header(**kw):
    base = dict(
        kind=F.Kind.GRAD,
        field=F.Field.GRAD,
        job=7,
        epoch=3,
        rank=1,
        world=2,
        layout=0xABC,
        iteration=42,
        seq=5,
        runs=((16, 100, 123), (200, 4, 9)),
    )
    base.update(kw)
    return F.Header(**base)


def test_header_roundtrip():
    h = header()
    assert F.unpack_header(h.pack(), max_runs=8) == h


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda b: b[:10], "truncated"),
        (lambda b: b"XXXX" + b[4:], "bad_magic"),
        (lambda b: b[:4] + struct.pack("<H", 99) + b[6:], "bad_version"),
        (lambda b: b[:6] + bytes([9]) + b[7:], "bad_kind"),
        (lambda b: b + b"\0", "bad_length"),
        (lambda b: b[:-1], "bad_length"),
    ],
)
def test_header_rejections(mutate, reason):
    with pytest.raises(F.FrameError) as ei:
        F.unpack_header(mutate(header().pack()), max_runs=8)
    assert ei.value.reason == reason


def test_header_limits_runs_and_ranks():
    with pytest.raises(F.FrameError) as ei:
        F.unpack_header(header().pack(), max_runs=1)
    assert ei.value.reason == "too_many_runs"
    with pytest.raises(F.FrameError) as ei:
        F.unpack_header(header(rank=2, world=2).pack(), max_runs=8)
    assert ei.value.reason == "bad_rank"


def test_checksum_detects_bitflip():
    data = bytearray(b"\x01" * 4096)
    c = F.checksum(data)
    data[1000] ^= 0x10
    assert F.checksum(data) != c


def test_message_roundtrip():
    raw = M.encode("prepared", epoch=2, iteration=9, tokens=None)
    assert M.decode(raw) == {"t": "prepared", "v": M.VERSION, "epoch": 2, "iteration": 9, "tokens": None}


@pytest.mark.parametrize(
    "raw,reason",
    [
        (b"\xc1garbage", "undecodable"),
        (msgpack.packb([1, 2]), "not_a_map"),
        (msgpack.packb({"t": "prepared", "v": 99, "epoch": 1, "iteration": 1, "tokens": 0}), "bad_version"),
        (msgpack.packb({"t": "nope", "v": 1}), "unknown_type"),
        (msgpack.packb({"t": "prepared", "v": 1, "epoch": 1}), "missing_field"),
        (msgpack.packb({"t": "prepared", "v": 1, "epoch": "1", "iteration": 1, "tokens": 0}), "bad_field"),
        (msgpack.packb({"t": "prepared", "v": 1, "epoch": True, "iteration": 1, "tokens": 0}), "bad_field"),
    ],
)
def test_message_rejections(raw, reason):
    with pytest.raises(M.MessageError) as ei:
        M.decode(raw)
    assert ei.value.reason == reason


def test_encode_validates():
    with pytest.raises(M.MessageError):
        M.encode("prepared", epoch=1)


def test_header_checksum_catches_any_flipped_bit():
    """A flipped bit anywhere after the version (ids, iteration, sequence, run offsets,
    sizes, payload checksums) is caught before any payload is read."""
    raw = bytearray(header().pack())
    for byte in range(8, len(raw)):
        flipped = bytearray(raw)
        flipped[byte] ^= 0x04
        with pytest.raises(F.FrameError) as ei:
            F.unpack_header(bytes(flipped), max_runs=1 << 20)
        assert ei.value.reason in ("bad_header_checksum", "bad_kind", "bad_length", "too_many_runs", "bad_rank"), byte


KEY = tags.rank_key(b"k" * 32, 1)


def keyed_header(key: bytes = KEY, **kw) -> tuple[F.Header, tags.DataKey]:
    t = tags.DataKey(key)
    nonce = t.nonce()
    payloads = [b"\1" * 400, b"\2" * 16]
    runs = ((16, 100, t.tag(nonce, 1, payloads[0])), (200, 4, t.tag(nonce, 2, payloads[1])))
    return header(runs=runs, nonce=nonce, **kw), t


def test_keyed_header_roundtrip_and_its_parts_check_under_their_own_item():
    h, t = keyed_header()
    got = F.unpack_header(h.pack(t), max_runs=8, tags=lambda rank: t if rank == 1 else None)
    assert got == h and got.nonce == h.nonce and h.nonce != tags.ZERO_NONCE
    assert t.check(h.nonce, 1, b"\1" * 400, h.runs[0][2])
    assert not t.check(h.nonce, 2, b"\1" * 400, h.runs[0][2])  # a part moved to another place in the table
    assert not t.check(t.nonce(), 1, b"\1" * 400, h.runs[0][2])  # another message's nonce
    assert not t.check(h.nonce, 1, b"\1" * 399 + b"\0", h.runs[0][2])


def test_keyed_header_refuses_any_flipped_bit_another_key_and_a_checksum():
    """On a keyed wire every bit after the version is under the MAC; a frame tagged with
    another rank's key, or with a plain checksum (a sender without the key), fails it."""
    h, t = keyed_header()
    raw = bytearray(h.pack(t))
    for byte in range(8, len(raw)):
        flipped = bytearray(raw)
        flipped[byte] ^= 0x04
        with pytest.raises(F.FrameError) as ei:
            F.unpack_header(bytes(flipped), max_runs=1 << 20, tags=t)
        assert ei.value.reason in ("bad_mac", "bad_kind", "bad_length", "too_many_runs", "bad_rank"), byte
    other = tags.DataKey(tags.rank_key(b"k" * 32, 0))  # rank 0's key for the same worker
    for forged in (h.pack(other), header().pack()):
        with pytest.raises(F.FrameError) as ei:
            F.unpack_header(forged, max_runs=8, tags=t)
        assert ei.value.reason == "bad_mac"
    with pytest.raises(F.FrameError) as ei:  # a rank the receiver has no key for
        F.unpack_header(h.pack(t), max_runs=8, tags=lambda rank: None)
    assert ei.value.reason == "bad_rank"


def test_data_keys_are_fresh_and_one_per_rank():
    a, b = tags.new_key(), tags.new_key()
    assert a != b and len(a) == tags.KEY_SIZE
    assert tags.rank_key(a, 0) != tags.rank_key(a, 1) != tags.rank_key(b, 1)
    per_rank = tags.for_ranks(a, 3)
    assert len(per_rank) == 3 and all(t.keyed for t in per_rank)
    assert tags.for_ranks(None, 3) == () and tags.for_key(None) is tags.PLAIN and not tags.PLAIN.keyed
    with pytest.raises(ValueError, match="32 bytes"):
        tags.DataKey(b"short")


def test_error_replies_carry_a_code_from_a_fixed_set():
    for code in M.ERROR_CODES:
        assert M.decode(M.encode("error", code=code, message="x"))["code"] == code
    with pytest.raises(M.MessageError, match="lacks field 'code'"):
        M.encode("error", message="x")
    with pytest.raises(M.MessageError, match="error.code 'nope' is not one of"):
        M.encode("error", code="nope", message="x")
