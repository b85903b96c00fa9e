"""A worker's node-local checkpoint files: serving them to restore clients, telling the
coordinator which disk they are on, and deleting those the coordinator's retention dropped.

The local tier of a cluster is a directory on each worker's own host (the worker's
``local_dir=``, else the cluster's ``persist.local.dir``). The coordinator keeps the
manifests; a restore client that cannot see a worker's disk asks the worker for the shard
files (``read_file`` on this socket, a ROUTER of its own on a thread of its own, so disk
reads never hold up the apply path). Each reply is a ``file_reply`` head, sent at once,
then the file in ``FILE_CHUNK_BYTES`` messages; the files being sent (every rank of a
restarting job may ask for the same shard) go a chunk each in turn, each as its client's
queue (``SNDHWM`` 2) has room, and one whose client reads nothing for ``SEND_TIMEOUT_S``
is dropped. At most ``MAX_TRANSFERS`` files are sent at once, one per connection; a read
beyond that is answered "busy" (the client asks again), so what readers cost the worker is
bounded (about ``MAX_TRANSFERS`` x 3 chunks) however many connect or stop reading. The
client checks the whole file against the manifest's checksum. Only files
a checkpoint has are served: a valid job name, a checkpoint directory's name, a shard
file's name, a regular file of the size the client expects (its manifest's), under this
worker's root.

In mac mode (a keyed cluster, ``security.data=mac``) the socket is in clear, like the data
and serve sockets: a ``read_file`` must carry a ticket the coordinator handed out (over
CURVE) for this worker's :attr:`FileServer.key`, which the worker draws when it starts and
tells the coordinator in its register, and the request's MAC under the ticket's key; each
chunk then comes as two frames, its GMAC tag and its bytes, under a key bound to the
request and to a fresh salt in the head (:func:`shadow.wire.tags.file_reply_key`). A read
without a valid ticket is refused and counted (``files_bad_ticket``). With ``curve`` the
socket is a CURVE server admitting the reading roles, as without ``mac``.

Threads: the worker's main thread calls :meth:`FileServer.open`, :meth:`learn`,
:meth:`forget`, :attr:`disk` and :meth:`close`; one ``shadow-files`` thread owns the socket
and does the disk accesses after start-up (serving, the disk's id, deletes); :meth:`open`
reads the id of the worker's own ``local_dir`` itself, so the register carries it. They
share ``_todo`` (a queue) and ``disk`` / ``_roots`` (replaced whole, never changed in
place)."""

from __future__ import annotations

import hmac
import logging
import os
import queue
import re
import shutil
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass

import zmq

from shadow import security
from shadow.core.jobs import job_name_problem
from shadow.persist import disks
from shadow.persist.checkpoints import dir_key
from shadow.storage.local import open_under
from shadow.transport import SocketFactory
from shadow.transport.sockets import DOOR_CONNECTIONS
from shadow.wire import messages as M
from shadow.wire import tags
from shadow.worker.address import Binding

logger = logging.getLogger(__name__)

FILE_CHUNK_BYTES = 4 << 20  # one message of a file reply
SEND_TIMEOUT_S = 10.0  # a client that reads nothing this long is dropped
MAX_TRANSFERS = 4  # files sent at once (one per connection)
READERS = ("trainer", "client", "admin")  # the roles that may read checkpoint files (restores)
_SHARD = re.compile(r"shard-\d{5}-of-\d{5}(\.safetensors|\.shard\.zst)")
# what a checkpoint directory holds: its shards, its manifest, and their temporary files
_CHECKPOINT_FILE = re.compile(r"(shard-\d{5}-of-\d{5}(\.safetensors|\.shard\.zst)|manifest\.json)(\.[\w-]+\.tmp)?")


def _not_a_checkpoint(path: str) -> str:
    """Why the directory ``path`` is not one a checkpoint write made ("" if it is): it may
    hold only regular files named as a checkpoint's. Retention deletes nothing else, so a
    ``forget`` (or a ``local_dir`` it was told) cannot make a worker delete other data."""
    try:
        with os.scandir(path) as entries:
            for e in entries:
                if not e.is_file(follow_symlinks=False) or not _CHECKPOINT_FILE.fullmatch(e.name):
                    return f"it holds {e.name!r}, which no checkpoint write makes"
    except OSError as exc:
        return f"cannot list it ({exc})"
    return ""


@dataclass
class _Transfer:
    """A file being sent to one client."""

    ident: bytes
    fd: int
    size: int
    path: str
    progress: float  # monotonic time a chunk last went out
    done: int = 0
    waiting: bool = False  # its client's queue was full at the last try
    reply: tags.ReplyKey | None = None  # mac mode: what tags its chunks
    index: int = 0  # chunks sent
    ready: list | None = None  # the next chunk's frames, read (and tagged) but not sent yet


def file_problem(job: object, directory: object, name: object) -> str | None:
    """Why ``job/directory/name`` is not a checkpoint's shard file (None if it may be)."""
    problem = job_name_problem(job)
    if problem is not None:
        return problem
    if not isinstance(directory, str) or dir_key(directory) is None or "/" in directory:
        return f"{directory!r:.80} is not a checkpoint directory's name"
    if not isinstance(name, str) or not _SHARD.fullmatch(name):
        return f"{name!r:.80} is not a shard file's name"
    return None


class FileServer:
    """The files socket and the thread behind it (see the module's text)."""

    def __init__(
        self,
        sockets: SocketFactory,
        binding: Binding,
        local_dir: str = "",
        keyed: bool = False,
        rejected: Counter | None = None,
    ) -> None:
        """``keyed``: mac mode (a socket in clear; every read needs a ticket for :attr:`key`);
        ``rejected``: where refused reads are counted, by reason (the worker's counters)."""
        self.sockets, self.binding = sockets, binding
        self.key = tags.new_key() if keyed else None  # what this worker's files tickets derive from
        self.rejected: Counter = rejected if rejected is not None else Counter()
        self.override = os.path.abspath(local_dir) if local_dir else ""
        self._roots = (self.override, "")  # (this worker's own, the cluster's)
        self.modes: tuple[int, int] | None = None  # (file_mode, dir_mode) for the disk's mark, once a configure says
        self.disk: dict | None = None  # {"id", "dir", "host"} of the root, once known
        self.endpoint = ""
        self.served = self.refused = 0
        self._todo: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def root(self) -> str:
        """Where this worker's local tier is ("" while unknown)."""
        own, cluster = self._roots
        return own or cluster

    def open(self) -> str:
        """Bind the files socket and start the thread; returns the endpoint to advertise."""
        sock = self.sockets.router(
            M.socket_limit("files"),
            READERS,
            sndhwm=2,
            send_timeout_s=1.0,
            curve=self.key is None,
            door=self.door,
            door_cap=lambda: DOOR_CONNECTIONS,
        )
        self.endpoint = self.binding.bind(sock)
        self._thread = threading.Thread(target=self._loop, args=(sock,), name="shadow-files", daemon=True)
        self._thread.start()
        if self.override:  # known now: the register says it (a restore may come before any heartbeat)
            self._identify()
        return self.endpoint

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def learn(self, cluster_dir: str, file_mode: int | None = None, dir_mode: int | None = None) -> None:
        """The cluster's ``persist.local.dir`` (a configure or a register said it); this
        worker's own ``local_dir`` wins over it."""
        cluster = os.path.abspath(cluster_dir) if cluster_dir else ""
        if file_mode is not None and dir_mode is not None:
            self.modes = (file_mode, dir_mode)
        if cluster != self._roots[1]:
            self._roots = (self.override, cluster)
            self._todo.put(("identify",))

    def forget(self, job: str, names: list[str]) -> None:
        """Delete checkpoint directories ``names`` of ``job`` from this worker's disk (the
        coordinator's retention, or a checkpoint that failed)."""
        self._todo.put(("forget", job, list(names)))

    # -- the thread --------------------------------------------------------------------
    def _loop(self, sock: zmq.Socket) -> None:
        sending: list[_Transfer] = []  # files being sent, a chunk each in turn
        try:
            while not self._stop.is_set():
                self._chores()
                if sock.poll(0 if sending else 200):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        frames = []
                    # curve mode: who sent it (a job-scoped reader reads its jobs' files only)
                    peer = security.peer_of(frames[-1]) if frames and self.key is None else None
                    parts = [f.bytes for f in frames]
                    try:
                        t = self._serve(sock, parts, sending, peer) if parts else None
                    except Exception:  # a bug meeting an input: logged, the thread goes on
                        logger.exception("serving a file failed; the files socket carries on")
                        t = None
                    if t is not None:
                        sending.append(t)
                for t in list(sending):
                    if self._advance(sock, t):
                        os.close(t.fd)
                        sending.remove(t)
                if sending and all(t.waiting for t in sending):
                    time.sleep(0.001)  # every client's queue is full: let the network drain them
        finally:
            for t in sending:
                os.close(t.fd)
            sock.close(linger=0)

    def _chores(self) -> None:
        while True:
            try:
                item = self._todo.get_nowait()
            except queue.Empty:
                return
            if item[0] == "identify":
                self._identify()
            elif item[0] == "forget":
                self._delete(item[1], item[2])

    def _identify(self) -> None:
        if not self.root:
            return
        file_mode, dir_mode = self.modes if self.modes else (0o600, 0o700)
        self.disk = disks.describe(self.root, file_mode, dir_mode)
        logger.info("local tier on this worker: %s (disk %s)", self.disk["dir"], self.disk["id"] or "unknown")

    def _delete(self, job: str, names: list[str]) -> None:
        root = self.root
        for name in names:
            if not root or file_problem(job, name, "shard-00000-of-00001.safetensors") is not None:
                continue
            path = os.path.join(root, job, name)
            if os.path.realpath(path) != os.path.join(os.path.realpath(root), job, name):
                logger.warning("did not delete %s: a link leads out of this worker's tier", path)
                continue
            why = _not_a_checkpoint(path) if os.path.isdir(path) else ""
            if why:
                logger.warning("did not delete %s: %s", path, why)
                continue
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning("could not delete %s from this worker's disk: %s", path, exc)
                continue
            logger.info("deleted %s (retention)", path)

    def _error(self, sock: zmq.Socket, ident: bytes, code: str, text: str) -> None:
        """Refuse a request with an error reply, never waiting for it: a peer that does not
        read its replies (its queue full) gets none, and the thread serving every reader
        goes on at once (it waited up to the socket's send timeout per reply before)."""
        self.refused += 1
        try:
            sock.send_multipart([ident, M.encode("error", code=code, message=text)], zmq.NOBLOCK)
        except zmq.ZMQError:  # queue full (a reader that does not read), or the peer has gone
            self.rejected["files_reply_dropped"] += 1

    def _serve(
        self, sock: zmq.Socket, parts: list[bytes], sending: list[_Transfer], peer: security.Peer | None = None
    ) -> _Transfer | None:
        """One request: refused at once, or the file opened, its head sent and its
        transfer returned (sent a chunk at a time, in turn with the others in ``sending``).
        ``peer``: who sent it, in curve mode (a job-scoped reader reads its jobs only)."""
        if len(parts) != 2:
            self.refused += 1
            self.rejected["files_malformed"] += 1
            return None
        ident = parts[0]
        try:
            msg = M.decode(parts[1])
            if msg["t"] != "read_file":
                raise M.MessageError("unexpected", f"files socket got {msg['t']!r}")
        except M.MessageError as exc:
            self.rejected["files_" + exc.reason] += 1
            self._error(sock, ident, "malformed", str(exc))
            return None
        reply = None
        if self.key is not None:
            reply = self._ticket(msg)
            if reply is None:
                self.rejected["files_bad_ticket"] += 1
                self._error(
                    sock,
                    ident,
                    "refused",
                    "this read carries no valid ticket of this worker (none, forged, or from before it "
                    "restarted): ask the coordinator for the restore info again",
                )
                return None
            if not tags.files_ticket_reads(self.key, msg["ticket"], msg["job"]):
                self.rejected["files_scope"] += 1
                self._error(
                    sock,
                    ident,
                    "refused",
                    f"this read's ticket is of a job-scoped reader and does not read job {msg['job']!r}: "
                    "ask the coordinator for the restore info of that job with a key of it",
                )
                return None
        elif peer is not None and not peer.may(msg["job"]):
            self.rejected["files_scope"] += 1
            self._error(sock, ident, "refused", f"this {peer.role} key may not read job {msg['job']!r}'s files")
            return None
        if len(sending) >= MAX_TRANSFERS or any(t.ident == ident for t in sending):
            self.rejected["files_busy"] += 1
            self._error(
                sock,
                ident,
                "busy",
                f"busy: this worker sends {MAX_TRANSFERS} files at once, one per connection; ask again shortly",
            )
            return None
        problem = file_problem(msg["job"], msg["dir"], msg["file"])
        root = self.root
        if problem is None and not root:
            problem = "this worker has no local tier (no persist.local.dir or local_dir yet)"
        if problem is not None:
            self._error(sock, ident, "refused", problem)
            return None
        path = os.path.join(root, msg["job"], msg["dir"], msg["file"])
        try:
            fd = open_under(root, (msg["job"], msg["dir"], msg["file"]))
        except FileNotFoundError:
            self._error(sock, ident, "refused", f"no such file on this worker's disk: {path}")
            return None
        except OSError as exc:
            self._error(sock, ident, "refused", f"cannot read {path} on this worker: {exc}")
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != msg["bytes"]:
                raise ValueError(f"{path} is not a regular file of {msg['bytes']} bytes on this worker")
            salt = {"salt": reply[1]} if reply is not None else {}
            sock.send_multipart(
                [ident, M.encode("file_reply", bytes=info.st_size, chunk=FILE_CHUNK_BYTES, **salt)], zmq.NOBLOCK
            )
        except (ValueError, OSError, zmq.ZMQError) as exc:
            os.close(fd)
            if isinstance(exc, ValueError):
                self._error(sock, ident, "refused", str(exc))
            return None
        return _Transfer(ident, fd, info.st_size, path, time.monotonic(), reply=reply[0] if reply else None)

    def door(self, user: bytes, password: bytes) -> str:
        """Admit a connection to the files socket in clear (on the guard's thread): the holder
        of a ticket of this worker proving its key (:func:`shadow.wire.tags.door`); else the
        reason it is refused."""
        ticket = tags.user_ticket(user)
        if ticket is None or self.key is None:
            return "user"
        return "" if hmac.compare_digest(tags.door(tags.ticket_key(self.key, ticket)), password) else "key"

    def _ticket(self, msg: dict) -> tuple[tags.ReplyKey, bytes] | None:
        """Mac mode: what tags the reply to ``msg`` and the salt that goes in its head, if
        the request carries a ticket of this worker and its MAC checks; else None."""
        ticket, nonce, mac = msg.get("ticket"), msg.get("nonce"), msg.get("mac")
        if not (
            isinstance(ticket, bytes)
            and len(ticket) == tags.TICKET_SIZE
            and isinstance(nonce, bytes)
            and len(nonce) == tags.SALT_SIZE
            and isinstance(mac, bytes)
        ):
            return None
        assert self.key is not None
        key = tags.ticket_key(self.key, ticket)
        if not tags.file_mac_ok(key, msg["job"], msg["dir"], msg["file"], msg["bytes"], nonce, mac):
            return None
        salt = os.urandom(tags.SALT_SIZE)
        return tags.file_reply_key(key, mac, salt), salt

    def _advance(self, sock: zmq.Socket, t: _Transfer) -> bool:
        """Send the next chunk of ``t`` if its client's queue has room; True once it is done
        or given up (the client went away, read nothing for ``SEND_TIMEOUT_S``, or the file
        could not be read: the client then times out and its restore goes on elsewhere)."""
        now = time.monotonic()
        try:
            if t.ready is None:  # read (and tag) once, however long its client takes to have room
                data = os.pread(t.fd, min(FILE_CHUNK_BYTES, t.size - t.done), t.done)
                if not data:
                    raise OSError(f"{t.path} ended at {t.done} of {t.size} bytes")
                t.ready = [t.ident, data] if t.reply is None else [t.ident, t.reply.tag(t.index + 1, data), data]
            sock.send_multipart(t.ready, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # its queue is full
            t.waiting = True
            if now - t.progress > SEND_TIMEOUT_S:
                logger.warning("dropped a file reply (%s): the client read nothing for %.0f s", t.path, SEND_TIMEOUT_S)
                return True
            return False
        except zmq.ZMQError as exc:  # the client went away
            logger.warning("dropped a file reply (%s): %s", t.path, exc)
            return True
        except OSError as exc:
            logger.error("reading %s for a restore failed: %s", t.path, exc)
            return True
        t.done += len(t.ready[-1])
        t.index, t.ready = t.index + 1, None
        t.progress, t.waiting = now, False
        if t.done < t.size:
            return False
        self.served += 1
        logger.info("served %s (%d bytes) to a restore", t.path, t.size)
        return True
