"""A worker's files socket, from the client's side: one shard file of its disk, read whole
(:func:`read_file`) or put into place as it arrives (:func:`stream_into`), every chunk
checked on the way (mac mode: its GMAC tag). :mod:`shadow.restore.copies` reads a
node-local tier's copies through it; the server is :mod:`shadow.worker.files`."""

from __future__ import annotations

import os
import struct
import time

import numpy as np
import xxhash
import zmq

from shadow import security
from shadow.config.tuning import DEFAULT, Tuning
from shadow.core.errors import ShadowError
from shadow.persist import shardfile
from shadow.transport.client import dealer
from shadow.wire import messages as M
from shadow.wire import tags

HEAD_TIMEOUT_S = 10.0  # a worker asked for a file answers this fast, or is taken for gone


Auth = tuple[bytes, bytes] | None  # mac mode: (ticket, its key) for the worker's files socket


class _Busy(ShadowError):
    """The worker sends as many files as it will at once: ask again."""


def _request(
    endpoint: str, job: str, directory: str, shard: dict, tuning: Tuning, auth: Auth = None
) -> tuple[zmq.Socket, tags.ReplyKey | None]:
    """Ask the worker at ``endpoint`` for the file; returns the socket once its head says it
    comes (an error reply, a head for another size, or none within :data:`HEAD_TIMEOUT_S`:
    ``ShadowError``), and with ``auth`` (mac mode: a socket in clear) what the chunks'
    tags must check under. A worker busy with other reads is asked again, a little later
    each time, for up to ``tuning.fetch_timeout_s``."""
    deadline = time.monotonic() + tuning.fetch_timeout_s
    wait = 0.05
    while True:
        try:
            return _request_once(endpoint, job, directory, shard, tuning, auth)
        except _Busy as exc:
            if time.monotonic() + wait > deadline:
                raise ShadowError(f"{endpoint} stayed busy for {tuning.fetch_timeout_s:.0f} s: {exc}") from None
            time.sleep(wait)
            wait = min(1.0, wait * 2)


def _request_once(
    endpoint: str, job: str, directory: str, shard: dict, tuning: Tuning, auth: Auth
) -> tuple[zmq.Socket, tags.ReplyKey | None]:
    nbytes = int(shard["bytes"])
    fields: dict = {}
    if auth is not None:
        ticket, key = auth
        nonce = os.urandom(tags.SALT_SIZE)
        mac = tags.file_mac(key, job, directory, shard["file"], nbytes, nonce)
        fields = {"ticket": ticket, "nonce": nonce, "mac": mac}
    door = security.ticket_door(*auth) if auth is not None else None
    sock = dealer(zmq.Context.instance(), endpoint, tuning=tuning, rcvhwm=8, curve=auth is None, door=door)
    reply = None
    try:
        sock.send(M.encode("read_file", job=job, dir=directory, file=shard["file"], bytes=nbytes, **fields))
        head_s = min(HEAD_TIMEOUT_S, tuning.fetch_timeout_s)
        if not sock.poll(int(head_s * 1000)):
            raise ShadowError(f"no answer from {endpoint} within {head_s:.0f} s")
        head = M.decode(sock.recv())
        if head["t"] == "error":
            raise (_Busy if head["code"] == "busy" else ShadowError)(head["message"])
        if head["t"] != "file_reply" or head["bytes"] != nbytes or head["chunk"] <= 0:
            raise ShadowError(f"{endpoint} answered {head['t']!r} for {nbytes} bytes: not the file asked for")
        if (auth is None) != ("salt" not in head):
            raise ShadowError(
                f"{endpoint} answered {'without' if auth else 'under'} a MAC a read "
                f"{'whose ticket asks for one' if auth else 'without a ticket'}"
            )
        if auth is not None:
            try:
                reply = tags.file_reply_key(auth[1], fields["mac"], head["salt"])
            except ValueError as exc:
                raise ShadowError(f"{endpoint}: {exc}") from None
    except M.MessageError as exc:
        sock.close(linger=0)
        raise ShadowError(f"{endpoint} sent a malformed reply: {exc}") from None
    except BaseException:
        sock.close(linger=0)
        raise
    return sock, reply


def _chunks(sock: zmq.Socket, endpoint: str, nbytes: int, tuning: Tuning, reply: tags.ReplyKey | None = None):
    """The file's chunks as they arrive (buffers valid until the next one), ``nbytes`` in
    all; a worker silent for ``tuning.fetch_timeout_s`` or sending too much: ``ShadowError``.
    With ``reply`` (mac mode) each chunk comes as its tag and its bytes, and one whose tag
    does not check (altered, moved, or not from that worker) is a ``ShadowError`` before its
    bytes are used."""
    wait, done, index = int(tuning.fetch_timeout_s * 1000), 0, 0
    while done < nbytes:
        if not sock.poll(wait):
            raise ShadowError(
                f"{endpoint} sent {done} of {nbytes} bytes, then nothing for {tuning.fetch_timeout_s:.0f} s"
            )
        index += 1
        if reply is None:
            buf = sock.recv(copy=False).buffer
        else:
            frames = sock.recv_multipart(copy=False)
            if len(frames) != 2:
                raise ShadowError(f"{endpoint}: chunk {index} of the file is {len(frames)} frames, not a tag and bytes")
            buf = frames[1].buffer
            if not reply.check(index, buf, frames[0].bytes):
                raise ShadowError(
                    f"{endpoint}: chunk {index} of the file fails its MAC (altered on the way, or not from that worker)"
                )
        if len(buf) == 0 or done + len(buf) > nbytes:
            raise ShadowError(f"{endpoint} sent more than the {nbytes} bytes of the file")
        yield done, buf
        done += len(buf)


def read_file(
    endpoint: str, job: str, directory: str, shard: dict, tuning: Tuning = DEFAULT, auth: Auth = None
) -> bytes:
    """Shard file ``shard["file"]`` of checkpoint directory ``directory`` of ``job`` from the
    worker whose files socket is ``endpoint``: its ``shard["bytes"]`` bytes (unchecked: the
    caller compares them with the manifest). A worker silent for ``tuning.fetch_timeout_s``
    fails it; so does an error reply (no such file there, not a shard file) and one that
    does not answer within :data:`HEAD_TIMEOUT_S` (a live worker answers at once, whatever
    else it is sending: its host may be gone while the coordinator still lists it). ``auth``:
    mac mode's ticket and key for that worker (the coordinator's restore info)."""
    nbytes = int(shard["bytes"])
    sock, reply = _request(endpoint, job, directory, shard, tuning, auth)
    try:
        out = bytearray(nbytes)
        for pos, buf in _chunks(sock, endpoint, nbytes, tuning, reply):
            out[pos : pos + len(buf)] = buf
        return bytes(out)
    finally:
        sock.close(linger=0)


def stream_into(
    endpoint: str, job: str, directory: str, shard: dict, target, tuning: Tuning = DEFAULT, auth: Auth = None
):
    """As :func:`read_file`, a plain shard file put straight into place as it arrives:
    ``target(name, dtype, count)`` says where each tensor goes (None: a fresh array), as for
    :func:`shadow.persist.shardfile.read_into`, whose ``(metadata, tensors, xxh3 of the whole
    file, size)`` it returns. Nothing is checked against the manifest here; a header that does
    not parse is a ``ShadowError``."""
    nbytes = int(shard["bytes"])
    sock, reply = _request(endpoint, job, directory, shard, tuning, auth)
    h = xxhash.xxh3_64()
    head = bytearray()  # the file's first bytes, until its header is whole
    places: list[tuple[int, int, np.ndarray]] = []  # (file lo, file hi, where), in file order
    tensors: dict[str, np.ndarray] = {}
    meta: dict | None = None  # once the header is parsed
    try:
        for pos, buf in _chunks(sock, endpoint, nbytes, tuning, reply):
            h.update(buf)
            if meta is None:
                head += buf
                if len(head) < 8 or len(head) < 8 + struct.unpack_from("<Q", head)[0]:
                    continue
                try:
                    meta, base, specs = shardfile.tensor_specs(memoryview(head), nbytes)
                except ValueError as exc:
                    raise ShadowError(f"{endpoint}: the shard file's header: {exc}") from None
                for name, dt, lo, hi in specs:
                    count = (hi - lo) // dt.itemsize
                    arr = target(name, dt, count)
                    arr = np.empty(count, dtype=dt) if arr is None else arr
                    if arr.dtype != dt or arr.size != count:
                        raise ShadowError(f"tensor {name!r} is {dt} x {count}, not what the layout expects")
                    tensors[name] = arr
                    places.append((base + lo, base + hi, arr.view(np.uint8)))
                pos, buf = 0, memoryview(head)
            _scatter(places, pos, buf)
    finally:
        sock.close(linger=0)
    if meta is None:
        raise ShadowError(f"{endpoint}: the shard file ends inside its header")
    return meta, tensors, h.intdigest(), nbytes


def _scatter(places: list[tuple[int, int, np.ndarray]], pos: int, buf) -> None:
    """Copy the file's bytes ``buf``, starting at file position ``pos``, into the places
    they belong to."""
    data = np.frombuffer(buf, dtype=np.uint8)
    end = pos + len(data)
    for lo, hi, where in places:
        if hi <= pos or lo >= end:
            continue
        a, b = max(lo, pos), min(hi, end)
        where[a - lo : b - lo] = data[a - pos : b - pos]
