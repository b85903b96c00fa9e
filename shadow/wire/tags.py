"""What vouches for a data frame's bytes: a checksum on a wire without keys, a MAC with them.

Every data message carries a 12-byte nonce in its header and a 16-byte tag for the header
(with its run table) and for each payload part. Which kind of tag a receiver expects comes
from its own configuration, never from the frame:

* :data:`PLAIN` (a cluster without keys, on loopback): xxh3-64 (the same checksum as the
  shard files'), which catches damage and nothing else; the nonce is zero.
* :class:`DataKey` (a keyed cluster): GMAC, that is AES-256-GCM with the bytes as associated
  data and nothing encrypted, from ``cryptography`` (OpenSSL). The header's tag covers every
  header field (job, epoch, rank, world, layout, iteration, sequence number, run count, the
  nonce) and the run table, whose entries hold the parts' tags; so a part is bound to its
  place in its message, and the message to its sender, its epoch and its sequence number.
  A sender draws a fresh random nonce per message; item ``i`` of the message (0: the header,
  ``i``: part ``i``) is tagged under ``nonce + i`` (mod 2**96), so no two items share a nonce
  while fewer than about 2**32 messages are sent under one key. Keys are fresh each time a
  worker is configured (:func:`new_key`), one per (worker, rank) (:func:`rank_key`): a rank
  cannot tag frames as another rank, and nothing from an earlier epoch or an earlier
  configuration checks out.

GMAC was chosen on speed: per core it runs at 1.6-22 GB/s on the machines measured (VAES
and VPCLMULQDQ where the CPU has them), 1-4x xxh3 and 3-12x keyed BLAKE3 or HMAC-SHA256
(``benchmarks/bench_transport.py`` measures all of them in process). A nonce-less MAC would
have been more forgiving of a repeated nonce; random 96-bit nonces per message keep the
chance of one negligible.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Protocol

import msgpack
import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_SIZE = 12
TAG_SIZE = 16
KEY_SIZE = 32
ZERO_NONCE = bytes(NONCE_SIZE)
_MOD = 1 << (8 * NONCE_SIZE)


class Tags(Protocol):
    """Tags the items of one data message (0: header and run table; i >= 1: part i)."""

    keyed: bool

    def nonce(self) -> bytes:
        """A nonce for a new message."""
        ...

    def tag(self, nonce: bytes, item: int, buf) -> int:
        """The tag of ``buf`` as item ``item`` of the message with ``nonce`` (at most 128 bits)."""
        ...

    def check(self, nonce: bytes, item: int, buf, tag: int) -> bool:
        """Whether ``tag`` is ``buf``'s, as item ``item`` of the message with ``nonce``."""
        ...


class _Plain:
    """xxh3-64: damage is caught, nothing is authenticated."""

    keyed = False

    def nonce(self) -> bytes:
        return ZERO_NONCE

    def tag(self, nonce: bytes, item: int, buf) -> int:
        return xxhash.xxh3_64_intdigest(buf)

    def check(self, nonce: bytes, item: int, buf, tag: int) -> bool:
        return xxhash.xxh3_64_intdigest(buf) == tag


PLAIN: Tags = _Plain()


class DataKey:
    """GMAC under one (worker, rank) key of one configuration (:func:`rank_key`)."""

    keyed = True

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != KEY_SIZE:
            raise ValueError(f"a data key is {KEY_SIZE} bytes, got {len(key) if isinstance(key, bytes) else key!r}")
        self._aes = AESGCM(key)
        self.door = door(key)  # what proves this key at the data socket's handshake

    def nonce(self) -> bytes:
        return os.urandom(NONCE_SIZE)

    @staticmethod
    def _item(nonce: bytes, item: int) -> bytes:
        if item == 0:
            return nonce
        return ((int.from_bytes(nonce, "little") + item) % _MOD).to_bytes(NONCE_SIZE, "little")

    def tag(self, nonce: bytes, item: int, buf) -> int:
        return int.from_bytes(self._aes.encrypt(self._item(nonce, item), b"", _flat(buf)), "little")

    def check(self, nonce: bytes, item: int, buf, tag: int) -> bool:
        try:
            self._aes.decrypt(self._item(nonce, item), tag.to_bytes(TAG_SIZE, "little"), _flat(buf))
        except InvalidTag:
            return False
        return True


def _flat(buf):
    """``buf`` as a byte buffer OpenSSL reads in place (a float32 view is cast, not copied)."""
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def door(key: bytes) -> bytes:
    """The password that proves ``key`` (a rank's data key, a ticket's key) at the handshake of
    a socket in clear (ZeroMQ PLAIN, which sends it in clear): 64 hex digits of an HMAC under
    the key, so that what a listener learns from it forges no frame, fetch or read."""
    return hmac.digest(key, b"shadow door v1", hashlib.sha256).hex().encode()


def rank_user(rank: int) -> bytes:
    """The user name a rank gives at a worker's data socket (its password: its key's :func:`door`)."""
    return b"rank %d" % rank


def ticket_user(ticket: bytes) -> bytes:
    """The user name a ticket's holder gives at a serve or files socket (its password: the
    ticket key's :func:`door`)."""
    return ticket.hex().encode()


def user_ticket(user: bytes) -> bytes | None:
    """The ticket in a user name from :func:`ticket_user` (None: not one)."""
    if len(user) != 2 * TICKET_SIZE:
        return None
    try:
        return bytes.fromhex(user.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None


def new_key() -> bytes:
    """A fresh worker data key (the coordinator draws one per worker configuration)."""
    return os.urandom(KEY_SIZE)


def rank_key(worker_key: bytes, rank: int) -> bytes:
    """Rank ``rank``'s key for the worker whose configuration holds ``worker_key``."""
    return hmac.digest(worker_key, b"shadow data v1 rank %d" % rank, hashlib.sha256)


def for_key(key: bytes | None) -> Tags:
    """What a rank tags its frames to one worker with: its key from the coordinator, or
    :data:`PLAIN` when the coordinator gave none (a cluster without keys)."""
    return DataKey(key) if key else PLAIN


def for_ranks(worker_key: bytes | None, world: int) -> tuple[Tags, ...]:
    """A worker's tags per rank: :data:`PLAIN` without a key (an empty tuple means all plain)."""
    if worker_key is None:
        return ()
    return tuple(DataKey(rank_key(worker_key, r)) for r in range(world))


# -- fetch replies in mac mode ----------------------------------------------------------
# A keyed cluster in mac mode serves shards over a socket in clear too. What authorises a
# fetch is a ticket: the coordinator, asked over CURVE by a peer of a reading role, draws a
# random ticket per worker and hands it out with its key, HMAC(serve key, ticket), where
# the serve key derives from the worker key of the worker's configuration; the worker
# derives the same key from the ticket. The request carries the ticket and an HMAC of what
# it asks for under the ticket's key; the reply a fresh random salt, and each item (0: the
# head, then the chunks, then the extras) a GMAC under HMAC(ticket key, salt), nonce = the
# item's index. A fresh salt per reply keeps nonces unique however often a ticket is used.

TICKET_SIZE = 16
SALT_SIZE = 16


def serve_key(worker_key: bytes) -> bytes:
    """The key a worker's tickets derive from, for the configuration holding ``worker_key``."""
    return hmac.digest(worker_key, b"shadow serve v1", hashlib.sha256)


def new_ticket() -> bytes:
    return os.urandom(TICKET_SIZE)


_SCOPE_TAG = 8  # bytes of a files ticket that say which jobs it reads


def _scope_tag(key: bytes, job: str | None) -> bytes:
    what = b"*" if job is None else b"job " + job.encode()
    return hmac.digest(key, b"shadow ticket scope v1 " + what, hashlib.sha256)[:_SCOPE_TAG]


def files_ticket(key: bytes, job: str | None = None) -> bytes:
    """A ticket for a worker's files socket whose files key is ``key``: one that reads every
    job's files, or (``job``) that job's only, for a job-scoped reader. Its first bytes are a
    tag under ``key`` of what it reads, so that a holder cannot widen it: a ticket of its own
    making has no key to go with it."""
    return _scope_tag(key, job) + os.urandom(TICKET_SIZE - _SCOPE_TAG)


def files_ticket_reads(key: bytes, ticket: bytes, job: str) -> bool:
    """Whether a files ticket of ``key`` may read job ``job``'s files (its tag names every
    job, or that job)."""
    head = ticket[:_SCOPE_TAG]
    return hmac.compare_digest(head, _scope_tag(key, None)) or hmac.compare_digest(head, _scope_tag(key, job))


def ticket_key(serve: bytes, ticket: bytes) -> bytes:
    """The key that goes with ``ticket`` at the worker whose serve key is ``serve``."""
    return hmac.digest(serve, b"shadow ticket v1 " + ticket, hashlib.sha256)


def fetch_mac(key: bytes, epoch: int, iteration: int) -> bytes:
    """A fetch request's MAC under its ticket's key (what it asks for, nothing else)."""
    return hmac.digest(key, b"shadow fetch v1 %d %d" % (epoch, iteration), hashlib.sha256)


def fetch_mac_ok(key: bytes, epoch: int, iteration: int, mac: bytes) -> bool:
    return hmac.compare_digest(fetch_mac(key, epoch, iteration), mac)


class ReplyKey:
    """GMAC over the items of one fetch reply: under HMAC(ticket key, ``salt``), item ``i``
    under nonce ``i``."""

    def __init__(self, key: bytes, salt: bytes) -> None:
        if len(salt) != SALT_SIZE:
            raise ValueError(f"a reply salt is {SALT_SIZE} bytes, got {len(salt)}")
        self._aes = AESGCM(hmac.digest(key, b"shadow reply v1 " + salt, hashlib.sha256))

    def tag(self, item: int, buf) -> bytes:
        return self._aes.encrypt(item.to_bytes(NONCE_SIZE, "little"), b"", _flat(buf))

    def check(self, item: int, buf, tag) -> bool:
        if not isinstance(tag, bytes) or len(tag) != TAG_SIZE:
            return False
        try:
            self._aes.decrypt(item.to_bytes(NONCE_SIZE, "little"), tag, _flat(buf))
        except InvalidTag:
            return False
        return True


# -- files-socket replies in mac mode ---------------------------------------------------
# A worker's files socket is in clear in mac mode too. Its tickets derive from a key the
# worker draws when it starts (:func:`new_key`) and tells the coordinator in its register
# (over CURVE), not from a configuration's key: a worker serves its disk's shard files
# before any job is configured (a restore after the whole cluster restarted). A
# ``read_file`` carries the ticket, a fresh random nonce of the client's and a MAC of what
# it asks for (:func:`file_mac`); the reply a fresh salt of the worker's, and each chunk a
# GMAC under a key bound to the request's MAC and the salt (:func:`file_reply_key`),
# nonce = the chunk's index (from 1): a chunk cannot be moved, and a reply answers no
# other request.


def file_mac(key: bytes, job: str, directory: str, name: str, nbytes: int, nonce: bytes) -> bytes:
    """A ``read_file`` request's MAC under its ticket's key."""
    what = msgpack.packb([job, directory, name, nbytes, nonce], use_bin_type=True)
    return hmac.digest(key, b"shadow file v1 " + what, hashlib.sha256)


def file_mac_ok(key: bytes, job: str, directory: str, name: str, nbytes: int, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(file_mac(key, job, directory, name, nbytes, nonce), mac)


def file_reply_key(key: bytes, request_mac: bytes, salt: bytes) -> ReplyKey:
    """What tags the chunks of the reply to the request whose MAC is ``request_mac``."""
    return ReplyKey(hmac.digest(key, b"shadow file reply v1 " + request_mac, hashlib.sha256), salt)
