"""Key files and client keys: the cluster's server pair, each role's allow list of public
keys, this process's CURVE client pair, and the role an admitted key has (read from each
message's ``User-Id``). Keys travel as z85 text (40 bytes), as ``zmq.auth`` writes them."""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.auth
from zmq.utils import z85

from shadow.config.choices import ROLES, SCOPED_ROLES
from shadow.core.errors import ShadowError
from shadow.core.jobs import job_pattern_problem

if TYPE_CHECKING:
    from shadow.config.security import SecurityConfig

logger = logging.getLogger(__name__)

ENV_SERVER_KEY = "SHADOW_CURVE_SERVER_KEY"  #: path to the cluster's public key file
ENV_CLIENT_KEY = "SHADOW_CURVE_CLIENT_KEY"  #: path to this client's .key_secret file


class SecurityError(ShadowError, ValueError):
    """A key file is missing, of the wrong kind, or unreadable."""


def generate(directory: str | os.PathLike, name: str, overwrite: bool = False) -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` (0600) under ``directory``."""
    directory = Path(directory)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if not overwrite:
        for path in (public, secret):
            if path.exists():
                raise SecurityError(
                    f"{path} already exists; pick another name= or pass overwrite=true "
                    "(clients and allow lists holding the old key stop working)"
                )
    if not directory.exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)  # whatever the umask: the keys directory is the owner's alone
    elif directory.stat().st_mode & 0o022:
        logger.warning(
            "%s may be written by other accounts (mode %o): one of them could replace a key; make it 0700",
            directory,
            directory.stat().st_mode & 0o777,
        )
    # the pair is written into a private (0700) scratch directory so the secret is never readable by others
    scratch = tempfile.mkdtemp(prefix=f".{name}-", dir=directory)
    try:
        tmp_public, tmp_secret = zmq.auth.create_certificates(scratch, name)
        os.chmod(tmp_secret, 0o600)
        os.replace(tmp_secret, secret)
        os.replace(tmp_public, public)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("wrote CURVE key pair %s and %s", public, secret)
    return public, secret


def _load(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if not p.is_file():
        raise SecurityError(
            f"CURVE key file {p} does not exist; create it with "
            f"`shadow keygen dir={p.parent} name={p.name.split('.')[0] or 'server'}`"
        )
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise SecurityError(
            f"CURVE key file {p} is unreadable or garbled ({exc}); regenerate it with `shadow keygen`"
        ) from None
    if not all(_is_z85_key(k) for k in (public, secret) if k is not None):
        raise SecurityError(
            f"CURVE key file {p} holds a key that is not 40 z85 characters; regenerate it with `shadow keygen`"
        )
    return public, secret


def _is_z85_key(key: bytes) -> bool:
    return len(key) == 40 and all(c in z85.Z85CHARS for c in key)


def load_secret(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a ``.key_secret`` file."""
    public, secret = _load(path)
    if secret is None:
        raise SecurityError(f"{path} holds only a public key: this is the public half; pass the .key_secret file")
    return public, secret


def load_public(path: str | os.PathLike) -> bytes:
    """The z85 public key from a ``.key`` (or ``.key_secret``) file."""
    return _load(path)[0]


def load_allow_list(path: str | os.PathLike) -> set[bytes]:
    """z85 public keys from a directory of ``*.key`` files, or from one key file."""
    p = Path(path)
    if p.is_file():
        return {load_public(p)}
    if not p.is_dir():
        raise SecurityError(f"allow list {p} does not exist; make a directory holding the clients' .key files")
    keys = {load_public(f) for f in sorted(p.glob("*.key"))}
    if not keys and not _scope_dirs(p):
        raise SecurityError(f"allow list {p} holds no *.key files; copy each client's public .key file there")
    return keys


@dataclass(frozen=True)
class Peer:
    """Who an admitted key is: its role, and the jobs it is limited to (``jobs`` None: every
    job; else job names and ``fnmatch`` patterns of them, e.g. ``team-a-*``)."""

    role: str
    jobs: tuple[str, ...] | None = None

    def may(self, job: str | None) -> bool:
        """Whether this peer may read or act on job ``job`` (None: no job named: only an
        unscoped peer)."""
        if self.jobs is None:
            return True
        return job is not None and any(fnmatch.fnmatchcase(job, pattern) for pattern in self.jobs)

    def user_id(self) -> bytes:
        """What the guard attaches to each of the peer's messages (ZeroMQ's ``User-Id``):
        ``role`` or ``role:pattern,pattern``."""
        return (self.role if self.jobs is None else f"{self.role}:{','.join(self.jobs)}").encode()

    @classmethod
    def parse(cls, user_id: str) -> Peer | None:
        role, _, jobs = user_id.partition(":")
        if role not in ROLES or (jobs and role not in SCOPED_ROLES):
            return None
        return cls(role, tuple(jobs.split(",")) if jobs else None)


def _scope_dirs(path: Path) -> list[Path]:
    return sorted(d for d in path.iterdir() if d.is_dir() and not d.name.startswith(".")) if path.is_dir() else []


def load_peers(allow: Mapping[str, str | os.PathLike]) -> dict[bytes, Peer]:
    """Public key -> :class:`Peer`, from each role's allow list (``{role: directory or key
    file}``). A key directly in a role's directory has that role over every job; a key in a
    subdirectory of a trainer's or a client's directory is limited to the jobs the
    subdirectory names (its name: a job name or a pattern, ``team-a-*``), and a key in
    several such subdirectories to all of them. A key allowed under two roles is an error: a
    key has one role."""
    peers: dict[bytes, Peer] = {}
    scopes: dict[bytes, set[str]] = {}
    for role, path in allow.items():
        if role not in ROLES:
            raise SecurityError(f"unknown role {role!r}; the roles are {ROLES}")
        found: list[tuple[bytes, str | None]] = [(k, None) for k in load_allow_list(path)]
        for d in _scope_dirs(Path(path)):
            keys = {load_public(f) for f in sorted(d.glob("*.key"))}
            if not keys:
                continue
            if role not in SCOPED_ROLES:
                raise SecurityError(
                    f"{d} holds {role} keys in a job's directory, but a {role} key cannot be limited to jobs "
                    f"(only {' and '.join(SCOPED_ROLES)} keys can); move them up into {path}"
                )
            problem = job_pattern_problem(d.name)
            if problem is not None:
                raise SecurityError(f"{d}: {problem}; rename it")
            found += [(k, d.name) for k in keys]
        if not found:
            raise SecurityError(f"allow list {path} holds no *.key files; copy each client's public .key file there")
        for key, scope in found:
            held = peers.get(key)
            if held is not None and held.role != role:
                raise SecurityError(
                    f"public key {key.decode()} is allowed as both {held.role} and {role} (in {path}); "
                    "a key has one role: make a pair per role with `shadow keygen role=...`"
                )
            peers[key] = Peer(role)
            if scope is None:
                scopes[key] = set()  # every job: an unscoped entry of the key wins
            elif scopes.get(key, {""}):
                scopes.setdefault(key, set()).add(scope)
    return {k: Peer(p.role, tuple(sorted(scopes[k])) if scopes.get(k) else None) for k, p in peers.items()}


def load_roles(allow: Mapping[str, str | os.PathLike]) -> dict[bytes, str]:
    """Public key -> role, from each role's allow list (see :func:`load_peers`)."""
    return {k: p.role for k, p in load_peers(allow).items()}


def peer_of(frame: zmq.Frame) -> Peer | None:
    """Who sent ``frame`` (received with ``copy=False`` on a socket a :class:`Guard` checks):
    its role and job scope; None on a socket without authentication."""
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:  # no ZAP handler: nothing was authenticated
        return None
    return Peer.parse(user_id) if isinstance(user_id, str) else None


def role_of(frame: zmq.Frame) -> str | None:
    """The role of the peer that sent ``frame`` (see :func:`peer_of`), or None on a socket
    without authentication."""
    peer = peer_of(frame)
    return peer.role if peer is not None else None


def _z85(key: bytes) -> str:
    return z85.encode(key).decode() if len(key) == 32 else key.decode(errors="replace")


def client(sock: zmq.Socket, server_public: bytes, keypair: tuple[bytes, bytes]) -> None:
    """Make ``sock`` a CURVE client of the server with ``server_public``; call before ``connect``."""
    sock.curve_serverkey = server_public
    sock.curve_publickey, sock.curve_secretkey = keypair


@dataclass(frozen=True)
class ClientKeys:
    """What a CURVE client needs: the server's public key and its own pair (z85)."""

    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> None:
        client(sock, self.server_public, (self.public, self.secret))


def client_keys(server_public: str | os.PathLike, client_key: str | os.PathLike) -> ClientKeys:
    return ClientKeys(load_public(server_public), *load_secret(client_key))


def client_from_env() -> ClientKeys | None:
    """Client keys from ``SHADOW_CURVE_SERVER_KEY`` and ``SHADOW_CURVE_CLIENT_KEY`` (None if neither is set)."""
    server, mine = os.environ.get(ENV_SERVER_KEY, ""), os.environ.get(ENV_CLIENT_KEY, "")
    if not server and not mine:
        return None
    if not (server and mine):
        missing = ENV_CLIENT_KEY if server else ENV_SERVER_KEY
        raise SecurityError(
            f"{ENV_SERVER_KEY} and {ENV_CLIENT_KEY} go together but {missing} is not set; set both "
            "(the cluster's public .key file and this client's .key_secret file) or neither"
        )
    return client_keys(server, mine)


def client_from_config(cfg: SecurityConfig) -> ClientKeys | None:
    """Client keys from ``security.client_key`` (this process's own pair) and the cluster's
    public key (``security.server_public``, or the public half of ``security.server_key`` for a
    worker, which holds the server pair). None when this process has no key of its own."""
    if not cfg.client_key:
        return None
    server = load_public(cfg.server_public) if cfg.server_public else load_secret(cfg.server_key)[0]
    return ClientKeys(server, *load_secret(cfg.client_key))
