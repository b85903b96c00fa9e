"""Signed manifests: an HMAC-SHA256 over a checkpoint's manifest, so that a reader holding
the key refuses one that anyone without the key has changed.

A manifest decides what a restore returns -- the job, iteration, generation, layout and
optimizer, and for each shard its range, file name, size and xxh3 checksum -- and the
checksums only catch corruption: whoever can write the tier can rewrite a manifest to
match altered shards. With ``persist.sign=true`` the coordinator adds ``signature`` to
each manifest, ``hmac-sha256:<hex>`` over :func:`canonical` (every field but the
signature, as sorted compact JSON, after a domain tag), keyed with the bytes of the file
``security.manifest_key``. A reader given the key (:func:`check`) refuses a manifest
whose signature is missing or does not match; a reader without one reads it unchecked.

The key is the file's bytes as they are, at least :data:`KEY_BYTES` of them; make one with
``head -c 32 /dev/urandom > manifest.key && chmod 600 manifest.key`` and give the same
file to the coordinator and to whatever restores or verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import stat

from shadow.core.errors import CheckpointError

logger = logging.getLogger(__name__)

FIELD = "signature"  #: the manifest field holding the signature
ALG = "hmac-sha256"
KEY_BYTES = 32  #: the shortest key accepted
ENV = "SHADOW_MANIFEST_KEY"  #: a key file's path, for readers given no key (restore, verify, ls)
_TAG = b"shadow-manifest-signature/1\n"  # domain separation: this key signs nothing else
MAKE_ONE = "head -c 32 /dev/urandom > manifest.key && chmod 600 manifest.key"


class SignatureError(CheckpointError):
    """A manifest's signature is missing or wrong: it may have been tampered with."""


def load_key(path: str) -> bytes:
    """The manifest key in the file at ``path`` (its bytes as they are); a ``ValueError``
    saying how to make one if it is missing, unreadable or shorter than :data:`KEY_BYTES`.
    A key file others may read is used, with a warning."""
    how = f"make one with `{MAKE_ONE}`"
    if not path:
        raise ValueError(f"no manifest key file given (security.manifest_key or {ENV}); {how}")
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # a directory, or a FIFO that would block
            raise ValueError(f"manifest key file {path} is not a regular file; {how}")
        with open(path, "rb") as f:
            key = f.read(1 << 16)
    except FileNotFoundError:
        raise ValueError(f"manifest key file {path} does not exist; {how}") from None
    except OSError as exc:
        raise ValueError(
            f"manifest key file {path} cannot be read ({exc.strerror or exc}): check its owner and mode, or {how}"
        ) from None
    if len(key) < KEY_BYTES:
        raise ValueError(f"manifest key file {path} holds {len(key)} bytes, fewer than {KEY_BYTES}; {how}")
    if mode & 0o077:
        logger.warning(
            "manifest key file %s is readable by others (mode %04o): anyone who reads it can sign "
            "checkpoints; chmod 600 %s",
            path,
            stat.S_IMODE(mode),
            path,
        )
    return key


def env_key() -> bytes | None:
    """The key in the file ``$SHADOW_MANIFEST_KEY`` names (:func:`load_key`), None if unset."""
    path = os.environ.get(ENV, "")
    return load_key(path) if path else None


GENERATION_TAG = b"shadow-generation-signature/1\n"  # a generation record's (shadow.persist.generations)


def canonical(manifest: dict, tag: bytes = _TAG) -> bytes:
    """The bytes a signature covers: every field of ``manifest`` but :data:`FIELD`, as sorted,
    compact JSON (a manifest read back from its file gives the same bytes), after ``tag``
    (what kind of record it is: a manifest's signature signs no generation record)."""
    body = {k: v for k, v in manifest.items() if k != FIELD}
    return tag + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _checked(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) < KEY_BYTES:
        raise ValueError(f"a manifest key is at least {KEY_BYTES} bytes (see shadow.persist.signing.load_key)")
    return key


def sign(manifest: dict, key: bytes, tag: bytes = _TAG) -> str:
    """The signature of ``manifest`` (``hmac-sha256:<hex>``), to be stored as its :data:`FIELD`."""
    return f"{ALG}:" + hmac.new(_checked(key), canonical(manifest, tag), hashlib.sha256).hexdigest()


def signed(manifest: dict, key: bytes, tag: bytes = _TAG) -> dict:
    """``manifest`` with its signature (a copy)."""
    return {**manifest, FIELD: sign(manifest, key, tag)}


def _what(manifest: dict) -> str:
    return f"the manifest of job {manifest.get('job')!r} iteration {manifest.get('iteration')!r}"


def check(manifest: dict, key: bytes, tag: bytes = _TAG, what: str = "") -> None:
    """Raise :class:`SignatureError` unless ``manifest`` carries a valid signature by ``key``
    (``what`` names the record in the error; default: a manifest's job and iteration)."""
    want = sign(manifest, key, tag)
    got = manifest.get(FIELD)
    what = what or _what(manifest)
    if got is None:
        raise SignatureError(
            f"{what} is not signed, but a manifest key was given: it may have been tampered with "
            "(or was written before persist.sign was on)"
        )
    if not isinstance(got, str) or not hmac.compare_digest(got.encode(), want.encode()):
        raise SignatureError(
            f"{what} fails its signature check: it may have been tampered with (or was signed with another key)"
        )
