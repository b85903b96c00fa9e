"""Checking a ``manifest.json`` read back from storage before anything trusts it.

A manifest is the commit marker of a checkpoint, but the directory it sits in is shared
with other jobs, older versions and people: one that does not parse, lacks a field,
has a field of the wrong type, names another job than its directory, or names a shard
file outside its own directory must be skipped (and reported), never crash a listing or
let a restore read someone else's files. Fields a reader does not use are not checked,
so manifests may grow.
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import struct
import time
from collections.abc import Callable
from typing import TypeGuard

from shadow.core.errors import CheckpointError
from shadow.core.jobs import job_name_problem
from shadow.persist import signing

logger = logging.getLogger(__name__)

FORMAT = "shadow-checkpoint/1"
_SHARD_INTS = ("index", "start", "stop", "bytes")
_SUFFIXES = (".safetensors", ".shard.zst")  # plain (shardfile) and compressed (zshard.SUFFIX) shards


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _shard_problem(i: int, s: object, count: int) -> str | None:
    if not isinstance(s, dict):
        return f"shards[{i}] is {type(s).__name__}, not an object"
    for key in _SHARD_INTS:
        if not _is_int(s.get(key)) or s[key] < 0:
            return f"shards[{i}].{key} is {s.get(key)!r}, not a whole number >= 0"
    if s["start"] > s["stop"]:
        return f"shards[{i}] has start {s['start']} > stop {s['stop']}"
    if s["index"] >= count:
        return f"shards[{i}].index is {s['index']}, not below the {count} shards"
    f = s.get("file")
    names = [f"shard-{s['index']:05d}-of-{count:05d}{suffix}" for suffix in _SUFFIXES]
    if f not in names:
        return f"shards[{i}].file is {f!r:.80}, not this shard's own file ({' or '.join(names)})"
    if not isinstance(s.get("checksum"), str):
        return f"shards[{i}].checksum is {s.get('checksum')!r}, not a string"
    if s.get("raw_bytes") is not None and not _is_int(s["raw_bytes"]):
        return f"shards[{i}].raw_bytes is {s['raw_bytes']!r}, not a whole number"
    return None


def manifest_problem(manifest: object, fmt: str, job_dir: str) -> str | None:
    """What is wrong with a parsed manifest found under the job directory ``job_dir``
    (its name), or None if a reader can trust the fields it uses."""
    if not isinstance(manifest, dict):
        return f"it holds a JSON {type(manifest).__name__}, not an object"
    if manifest.get("format") != fmt:
        return f"format {manifest.get('format')!r}, expected {fmt!r}"
    job = manifest.get("job")
    problem = job_name_problem(job)
    if problem is not None:
        return problem
    if job != job_dir:
        return f"it names job {job!r} but lies in the directory of job {job_dir!r}"
    it = manifest.get("iteration")
    if not _is_int(it) or it < 0:
        return f"iteration is {it!r}, not a whole number >= 0"
    gen = manifest.get("generation", 0)
    if not _is_int(gen) or gen < 0:
        return f"generation is {gen!r}, not a whole number >= 0"
    created = manifest.get("created")
    if created is not None and (not isinstance(created, (int, float)) or isinstance(created, bool)):
        return f"created is {created!r}, not a time"
    for key, kind in (("layout", dict), ("optim", dict), ("layout_hash", str)):
        if not isinstance(manifest.get(key), kind):
            return f"{key} is {type(manifest.get(key)).__name__}, not {kind.__name__}"
    world = manifest.get("world")
    if not _is_int(world) or world < 1:
        return f"world is {world!r}, not a whole number >= 1"
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        return f"shards is {shards!r:.60}, not a non-empty list"
    for i, s in enumerate(shards):
        problem = _shard_problem(i, s, len(shards))
        if problem is not None:
            return problem
    if len({s["index"] for s in shards}) != len(shards):
        return "two shards have the same index"
    return None


def new_manifest(
    job: str,
    iteration: int,
    epoch: int,
    tier: str,
    layout: dict,
    layout_hash: int,
    optim: dict,
    world: int,
    tokens,
    commit,
    shards: list[dict],
    generation: int = 0,
) -> dict:
    """A checkpoint's manifest: what the coordinator writes last, once every shard is durable."""
    return {
        "format": FORMAT,
        "job": job,
        "iteration": iteration,
        "generation": generation,
        "epoch": epoch,
        "tier": tier,
        "created": time.time(),
        "layout": layout,
        "layout_hash": f"{layout_hash:016x}",
        "optim": optim,
        "world": world,
        "tokens": tokens,
        "commit": commit,
        "shards": sorted(shards, key=lambda s: s["index"]),
    }


# what damaged bytes or failing storage raise on the way through a parser; anything else
# reading a checkpoint may be a bug, so its traceback is logged as well
_DAMAGE = (ValueError, OSError, EOFError, struct.error, RecursionError, OverflowError, MemoryError)


@contextlib.contextmanager
def _reading(what: str):
    """The boundary around reading one checkpoint (its manifest in :func:`list_checkpoints`,
    a shard in :func:`verify` and :func:`load`): whatever the read raises -- a manifest
    that parses but holds odd values, a truncated or corrupt plain or compressed shard, an
    ``OSError`` or a remote store client's own error type -- leaves it as a
    :class:`CheckpointError` naming ``what`` and the exception's type, so a listing reports
    the checkpoint and a restore falls back to an older one instead of crashing. Types
    that damage does not usually raise are logged with their traceback (a bug stays
    visible)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # see above: every failure of a read is a finding
        if not isinstance(exc, _DAMAGE):
            logger.warning("reading %s raised %s", what, type(exc).__name__, exc_info=True)
        raise CheckpointError(f"{what}: {type(exc).__name__}: {exc}") from exc


def read_manifest(
    raw: Callable[[], bytes], mpath: str, sign_key: bytes | None = None, skipped: list | None = None
) -> dict | None:
    """The manifest at ``mpath`` (its bytes from ``raw()``), or None -- with a warning, and
    ``(path, reason)`` appended to ``skipped`` -- when it does not parse, fails
    :func:`manifest_problem` (e.g. it names another job than its directory's) or, with
    ``sign_key``, its signature is missing or wrong."""
    try:
        with _reading(mpath):
            manifest = json.loads(raw())
            if sign_key is not None and isinstance(manifest, dict):  # before anything else trusts a field
                signing.check(manifest, sign_key)
            problem = manifest_problem(
                manifest, FORMAT, posixpath.basename(posixpath.dirname(posixpath.dirname(mpath)))
            )
        if problem is not None:
            raise CheckpointError(f"{mpath}: {problem}")
    except CheckpointError as exc:  # the reason without the path, which the caller has
        reason = str(exc).removeprefix(f"{mpath}: ").removeprefix("ValueError: ")
        what = "refusing" if isinstance(exc, signing.SignatureError) else "ignoring unreadable"
        logger.warning("%s manifest %s: %s", what, mpath, reason)
        if skipped is not None:
            skipped.append((mpath, reason))
        return None
    return manifest
