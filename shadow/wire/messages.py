"""Control messages: msgpack maps with a fixed, versioned schema.

Every message is ``{"t": type, "v": version, ...fields}``. Decoding never executes
anything (no pickle): msgpack with size limits, then a check of each field's type
against :data:`SCHEMAS`. Unknown types or missing/mistyped fields are rejected.
"""
from __future__ import annotations

from typing import Any

import msgpack

VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20

_num = (int, float)
# type -> {field: accepted python types}
SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    # worker -> coordinator
    "starting": {"pid": (int,), "worker_id": (int,), "seconds": (float, int)},  # compiling its kernels
    "register": {"data": (str,), "serve": (str,), "pid": (int,), "worker_id": (int,)},
    "configured": {"epoch": (int,)},
    "rejoin": {"data": (str,), "serve": (str,), "pid": (int,), "worker_id": (int,), "session": (dict, type(None))},
    "prepared": {"epoch": (int,), "iteration": (int,), "tokens": (int, type(None))},
    "persisted": {"epoch": (int,), "iteration": (int,), "tier": (str,), "shard": (int,), "ok": (bool,),
                  "error": (str,), "file": (str,), "start": (int,), "stop": (int,), "bytes": (int,),
                  "checksum": (str,), "seconds": (float, int), "commit": (dict, type(None)), "blob_ranks": (list,)},
    "applied": {"epoch": (int,), "iteration": (int,)},
    "stale": {"epoch": (int,), "reason": (str,)},
    "copied": {"epoch": (int,), "iteration": (int,), "seconds": (float, int)},
    "audited": {"epoch": (int,), "iteration": (int,), "ok": (bool,), "checked": (int,), "max_ulp": (int,),
                "first_param": (str,), "detail": (str,)},
    "heartbeat": {"epoch": (int,), "applied": (int,), "seen": (int,), "rejected": (dict,),
                  "frames_in": (int,), "bytes_in": (int,), "stale": (str,), "seq": (list,),
                  "replay_s": (float, int), "replayed": (int,)},
    # coordinator -> worker
    "registered": {"worker_id": (int,), "hold": (bool,)},
    "reset": {"reason": (str,)},
    "reregister": {},
    "configure": {"epoch": (int,), "job": (str,), "job_id": (int,), "layout": (dict,), "start": (int,),
                  "stop": (int,), "world": (int,), "optim": (dict,), "iteration": (int,), "persist": (dict,),
                  "shard": (int,), "shards": (int,), "peer": (dict, type(None))},
    "upload": {"epoch": (int,), "iteration": (int,), "bytes": (int,), "checksum": (str,)},
    "apply": {"epoch": (int,), "iteration": (int,), "persist": (bool,)},
    "shutdown": {},
    # trainer -> coordinator
    "attach": {"job": (str,), "rank": (int,), "world": (int,), "layout_hash": (int,),
               "layout": (dict, type(None)), "optim": (dict,), "iteration": (int,), "overwrite": (bool,),
               "restored": (dict, type(None))},  # the checkpoint this rank restored (job, iteration, generation, tier, path)
    "detach": {"epoch": (int,), "rank": (int,)},
    "replica_from": {"epoch": (int,), "rank": (int,), "worker": (int,), "gen": (int,), "iteration": (int,)},
    "lagging": {"epoch": (int,), "rank": (int,), "iteration": (int,), "applied": (int,)},
    "paused": {"epoch": (int,), "rank": (int,), "reason": (str,)},  # a rank stopped streaming on its own
    "trainer_hb": {"epoch": (int,), "rank": (int,), "world": (int,), "job_id": (int,), "seq": (list,)},
    # coordinator -> trainer
    "attached": {"epoch": (int,), "job_id": (int,), "workers": (list,)},
    "waiting": {"ready": (int,), "expected": (int,), "starting": (int,)},  # attach held: workers still starting
    "progress": {"epoch": (int,), "applied": (int,)},
    "alive": {"epoch": (int,)},  # the answer to every trainer_hb: a trainer that hears nothing is on its own
    "degraded": {"epoch": (int,), "reason": (str,)},
    "resync": {"epoch": (int,)},
    "replica_out": {"epoch": (int,), "worker": (int,)},
    "replica_in": {"epoch": (int,), "worker": (int,), "data": (str,), "gen": (int,)},
    "audit": {"epoch": (int,), "iteration": (int,), "ok": (bool,), "detail": (str,)},
    # anyone -> coordinator
    "status": {},
    "restore_info": {"job": (str, type(None))},
    # coordinator -> anyone
    "status_reply": {"status": (dict,)},
    "restore_info_reply": {"info": (dict,)},
    "error": {"message": (str,)},
    # client -> worker serve socket
    "fetch": {"epoch": (int,), "iteration": (int,)},
    # worker -> client; optional "extras": [[key, nbytes, xxh3], ...], chunks of the model state
    # outside the optimizer, sent after the arrays' chunks
    "fetch_reply": {"epoch": (int,), "iteration": (int,), "start": (int,), "stop": (int,),
                    "arrays": (list,), "steps": (list,), "has_state": (list,), "commits": (list,),
                    "replay": (dict, type(None)), "chunk": (int,),
                    "sums": (list,)},
}


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


def decode(raw: bytes | memoryview) -> dict:
    """Decode and validate one control message."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError("too_large", f"{len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError("undecodable", f"not a msgpack message ({type(exc).__name__})") from None
    validate(msg)
    return msg


def validate(msg: Any) -> None:
    if not isinstance(msg, dict):
        raise MessageError("not_a_map", f"control message is a {type(msg).__name__}, expected a map")
    kind, version = msg.get("t"), msg.get("v")
    if version != VERSION:
        raise MessageError("bad_version", f"message version {version!r}, this build speaks {VERSION}")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise MessageError("unknown_type", f"unknown message type {kind!r}")
    for name, types in schema.items():
        if name not in msg:
            raise MessageError("missing_field", f"{kind} message lacks field {name!r}")
        value = msg[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise MessageError(
                "bad_field", f"{kind}.{name} is a {type(value).__name__}, expected {'/'.join(t.__name__ for t in types)}"
            )
