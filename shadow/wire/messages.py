"""Control messages: msgpack maps with a fixed, versioned schema.

Every message is ``{"t": type, "v": version, ...fields}``, in that order (:func:`encode`
writes the type first, then the version). Decoding never executes anything (no pickle):

1. the type is peeked from the first bytes, without decoding the body: a map whose first
   key is ``"t"`` (a short string) and whose second is ``"v"``;
2. the message must fit its type's :class:`Limits` (:data:`LIMITS`): total bytes, then
   msgpack's ``max_str_len``/``max_bin_len``/``max_array_len``/``max_map_len`` (and no
   ext types) while the body is decoded, with the garbage collector paused, and at most
   as many arrays and maps in all as its longest array may hold (:func:`unpack_bounded`:
   a body of empty containers, one byte each, cannot build millions of objects);
3. each field's type is checked against :data:`SCHEMAS`; a field that is neither in the
   schema nor in :data:`OPTIONAL` is rejected (``unknown_field``).

Every refusal is a :class:`MessageError` whose ``reason`` is a short metric label.
:func:`socket_limit` gives a socket's ``ZMQ_MAXMSGSIZE`` from the types it receives
(:data:`RECEIVES`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any, NamedTuple

import msgpack

from shadow.config.tuning import DEFAULT
from shadow.wire.schemas import ERROR_CODES, OPTIONAL, RECEIVES, SCHEMAS, VERSION

__all__ = [
    "ERROR_CODES",
    "LIMITS",
    "OPTIONAL",
    "RECEIVES",
    "SCHEMAS",
    "VERSION",
    "Limits",
    "MessageError",
    "decode",
    "encode",
    "limits",
    "peek_type",
    "socket_limit",
    "unpack_bounded",
    "validate",
]

_KiB, _MiB = 1 << 10, 1 << 20


class Limits(NamedTuple):
    """What one message of a type may hold. ``bytes`` is checked before anything is
    decoded; the rest are msgpack's limits while the body is decoded (no ext types)."""

    bytes: int  # the whole encoded message
    str: int  # the longest string (max_str_len)
    bin: int  # the longest byte string (max_bin_len)
    array: int  # the longest array (max_array_len)
    map: int  # the most entries in one map (max_map_len)


#: Most types: scalars, endpoints, short reasons and error texts.
SMALL = Limits(64 * _KiB, 16 * _KiB, 4 * _KiB, 4096, 256)
#: Per-rank lists (a worker's next sequence number per rank, a trainer's sent counts per
#: worker, a job's workers) and rejection counters by reason.
PER_RANK = Limits(1 * _MiB, 16 * _KiB, 4 * _KiB, 1 << 16, 4096)
#: A model layout: one ``[name, shape, offset, numel, group, requires_grad]`` per parameter
#: (30 to 100 bytes each: some 600 Ki parameters in 64 MiB, at most 2 Mi entries). A string
#: costs about one byte of memory per byte received, so its limit only has to stay well
#: below the total: long parameter names pass. The one byte string is the replay's square
#: root table (``optim["sqrt"]["bits"]``, :data:`shadow.core.sqrttab.MAX_WIRE_BYTES`).
LAYOUT = Limits(64 * _MiB, 2 * _MiB, 4 * _MiB, 1 << 21, 1 << 16)

#: Per-type limits; a type not named here gets :data:`SMALL`. ``persisted`` and
#: ``fetch_reply`` carry commit records and grow with ``Tuning.max_commit_bytes``
#: (:func:`limits`).
#:
#: ==================================================  ======  =======  ===========  =======  ======
#: type                                                bytes   str      bin          array    map
#: ==================================================  ======  =======  ===========  =======  ======
#: all others (:data:`SMALL`)                          64 KiB  16 KiB   4 KiB        4 Ki     256
#: heartbeat, trainer_hb, attached (:data:`PER_RANK`)  1 MiB   16 KiB   4 KiB        64 Ki    4 Ki
#: forget (checkpoint directories)                    1 MiB   16 KiB   4 KiB        64 Ki    4 Ki
#: jobs_reply (a map per job the cluster knows)       1 MiB   16 KiB   4 KiB        64 Ki    4 Ki
#: attach, configure, rejoin, restore_info_reply       64 MiB  2 MiB    4 MiB        2 Mi     64 Ki
#: catalog_reply (a manifest file per checkpoint)      256 MiB 64 KiB   64 MiB       64 Ki    4 Ki
#: status_reply (the cluster view)                     64 MiB  64 KiB   4 KiB        1 Mi     64 Ki
#: agent (an agent's jobs and their reports)           64 MiB  64 KiB   4 KiB        1 Mi     64 Ki
#: agent_jobs (the jobs an agent runs)                 1 MiB   16 KiB   4 KiB        64 Ki    4 Ki
#: persisted (a commit record minus its step lists)    16 MiB  64 KiB   commit       2 Mi     4 Ki
#:                                                     +64 KiB
#: fetch_reply (steps per parameter, a commit blob     1 GiB   64 KiB   16 MiB or    4 Mi     64 Ki
#: per rank, a checksum per chunk)                                      commit
#: ==================================================  ======  =======  ===========  =======  ======
#:
#: ("commit": ``Tuning.max_commit_bytes``, 16 MiB by default.)
_SIZED: dict[str, Limits] = {
    "heartbeat": PER_RANK,
    "trainer_hb": PER_RANK,
    "attached": PER_RANK,
    "attach": LAYOUT,
    "configure": LAYOUT,
    "rejoin": LAYOUT,  # its assignment carries the configure message it holds
    "restore_info_reply": LAYOUT,
    "forget": PER_RANK,
    "jobs_reply": PER_RANK,  # the coordinator leaves out what would not fit (left_out)
    "catalog_reply": Limits(256 * _MiB, 64 * _KiB, 64 * _MiB, 1 << 16, 4096),
    "status_reply": Limits(64 * _MiB, 64 * _KiB, 4 * _KiB, 1 << 20, 1 << 16),
    "agent": Limits(64 * _MiB, 64 * _KiB, 4 * _KiB, 1 << 20, 1 << 16),  # its jobs' reports
    "agent_jobs": PER_RANK,
    "persisted": Limits(16 * _MiB + 64 * _KiB, 64 * _KiB, 16 * _MiB, 1 << 21, 4096),
    "fetch_reply": Limits(1 << 30, 64 * _KiB, 16 * _MiB, 1 << 22, 1 << 16),
}
LIMITS: dict[str, Limits] = {kind: _SIZED.get(kind, SMALL) for kind in SCHEMAS}
_COMMIT_CARRIERS = ("persisted", "fetch_reply")

_PEEK_BYTES = 128  # a map header, "t", the type (at most _MAX_TYPE_LEN), "v" and the version fit
_MAX_TYPE_LEN = 64
_MAP_MARKERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def limits(kind: str, commit_bytes: int = DEFAULT.max_commit_bytes) -> Limits:
    """The limits of message type ``kind`` (``KeyError`` for an unknown type); the types that
    carry commit records grow with ``commit_bytes`` (``Tuning.max_commit_bytes``)."""
    lim = LIMITS[kind]
    if kind == "fetch_reply_mac":  # a fetch_reply, encoded, with a salt and a tag beside it
        outer = limits("fetch_reply", commit_bytes).bytes
        return Limits(outer, 64, outer - 4 * _KiB, 16, 16)
    if kind in _COMMIT_CARRIERS:
        commit = int(commit_bytes)
        lim = lim._replace(bytes=max(lim.bytes, commit + 64 * _KiB), bin=max(lim.bin, commit))
    return lim


def socket_limit(kinds: Iterable[str], commit_bytes: int = DEFAULT.max_commit_bytes) -> int:
    """The largest message, in bytes, among types ``kinds`` (a key of :data:`RECEIVES`
    or the types themselves): a socket's ``ZMQ_MAXMSGSIZE``."""
    if isinstance(kinds, str):
        kinds = RECEIVES[kinds]
    return max(limits(k, commit_bytes).bytes for k in kinds)


class MessageError(ValueError):
    """A control message failed to decode or validate."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def encode(kind: str, **fields: Any) -> bytes:
    """Encode a control message, checking it against its schema first."""
    msg = {"t": kind, "v": VERSION, **fields}
    validate(msg)
    return msgpack.packb(msg, use_bin_type=True)


def peek_type(raw: bytes | memoryview) -> str:
    """The type of an encoded message, read from its first bytes only (the body stays
    undecoded): a map whose first key is ``"t"`` (a known type) and whose second is
    ``"v"`` (this build's version)."""
    head = bytes(raw[:_PEEK_BYTES])
    if not head or head[0] == 0xC1:  # 0xc1 is never used by msgpack
        raise MessageError("undecodable", "not a msgpack message")
    if head[0] not in _MAP_MARKERS:
        raise MessageError("not_a_map", f"control message begins with byte {head[0]:#04x}, expected a map")
    u = msgpack.Unpacker(
        raw=False,
        max_buffer_size=_PEEK_BYTES,
        max_str_len=_MAX_TYPE_LEN,
        max_bin_len=0,
        max_array_len=0,
        max_map_len=0,
        max_ext_len=0,
    )
    u.feed(head)
    order = 'a control message is a map that begins with its type "t", then its version "v"'
    try:
        if u.read_map_header() < 2 or u.unpack() != "t":
            raise MessageError("bad_order", order)
        try:
            kind = u.unpack()
        except msgpack.OutOfData:
            if len(head) < _PEEK_BYTES:
                raise
            raise MessageError("unknown_type", "message type is not a short string") from None
        except ValueError:  # over _MAX_TYPE_LEN, or a container
            raise MessageError("unknown_type", "message type is not a short string") from None
        if u.unpack() != "v":
            raise MessageError("bad_order", order)
        version = u.unpack()
    except MessageError:
        raise
    except msgpack.OutOfData:
        raise MessageError("undecodable", "message ends inside its type and version") from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError("bad_order", f"{order} ({type(exc).__name__})") from None
    if type(version) is not int or version != VERSION:
        raise MessageError("bad_version", f"message version {version!r}, this build speaks {VERSION}")
    if not isinstance(kind, str) or kind not in SCHEMAS:
        raise MessageError("unknown_type", f"unknown message type {kind!r}")
    return kind


def decode(raw: bytes | memoryview, commit_bytes: int = DEFAULT.max_commit_bytes) -> dict:
    """Decode and validate one control message within its type's :func:`limits`
    (``commit_bytes``: the receiver's ``Tuning.max_commit_bytes``)."""
    kind = peek_type(raw)
    lim = limits(kind, commit_bytes)
    if len(raw) > lim.bytes:
        raise MessageError("too_large", f"{kind} message of {len(raw)} bytes exceeds its limit of {lim.bytes}")
    try:
        msg = unpack_bounded(raw, lim)
    except ValueError as exc:
        if "exceeds max_" in str(exc):  # msgpack: "N exceeds max_array_len(M)"
            raise MessageError("too_large", f"{kind} message: {str(exc)[:200]}") from None
        raise MessageError("undecodable", f"not a msgpack message ({type(exc).__name__})") from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError("undecodable", f"not a msgpack message ({type(exc).__name__})") from None
    if not isinstance(msg, dict) or msg.get("t") != kind:  # e.g. a second "t" key
        raise MessageError("bad_order", f"message peeked as {kind!r} decodes otherwise")
    validate(msg)
    return msg


class _Containers:
    """Counts the arrays and maps a decode builds; past ``cap`` the decode stops."""

    __slots__ = ("cap", "n")

    def __init__(self, cap: int) -> None:
        self.cap, self.n = cap, 0

    def __call__(self, obj: Any) -> Any:
        self.n += 1
        if self.n > self.cap:
            raise ValueError(f"{self.n} arrays and maps exceeds max_containers({self.cap})")
        return obj


def unpack_bounded(raw: bytes | memoryview, lim: Limits, containers: int | None = None) -> Any:
    """msgpack ``raw`` within ``lim`` (no ext types), with at most ``containers`` arrays and
    maps in all (default: ``lim.array``), the garbage collector paused while it decodes.
    Over a limit: ``ValueError`` whose text holds "exceeds max_"; other damage raises what
    msgpack raises."""
    count = _Containers(lim.array if containers is None else containers)
    paused = gc.isenabled()  # a body of many small containers decodes several times faster without collections
    gc.disable()
    try:
        return msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=False,
            max_str_len=lim.str,
            max_bin_len=lim.bin,
            max_array_len=lim.array,
            max_map_len=lim.map,
            max_ext_len=0,
            list_hook=count,
            object_hook=count,
        )
    finally:
        if paused:
            gc.enable()


def validate(msg: Any) -> None:
    if not isinstance(msg, dict):
        raise MessageError("not_a_map", f"control message is a {type(msg).__name__}, expected a map")
    kind, version = msg.get("t"), msg.get("v")
    if version != VERSION:
        raise MessageError("bad_version", f"message version {version!r}, this build speaks {VERSION}")
    if not isinstance(kind, str) or kind not in SCHEMAS:
        raise MessageError("unknown_type", f"unknown message type {kind!r}")
    schema = SCHEMAS[kind]
    optional = OPTIONAL.get(kind, {})
    for name in msg:
        if name not in schema and name not in optional and name not in ("t", "v"):
            raise MessageError("unknown_field", f"{kind} message has an unknown field {str(name)[:64]!r}")
    for name, types in schema.items():
        if name not in msg:
            raise MessageError("missing_field", f"{kind} message lacks field {name!r}")
        _check_field(kind, name, msg[name], types)
    for name, types in optional.items():
        if name in msg:
            _check_field(kind, name, msg[name], types)
    if kind == "error" and msg["code"] not in ERROR_CODES:
        raise MessageError("bad_field", f"error.code {msg['code'][:32]!r} is not one of {ERROR_CODES}")


def _check_field(kind: str, name: str, value: Any, types: tuple[type, ...]) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise MessageError(
            "bad_field", f"{kind}.{name} is a {type(value).__name__}, expected {'/'.join(t.__name__ for t in types)}"
        )
