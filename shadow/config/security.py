"""Typed configuration of who may connect and with which keys: ``security.*`` on every
command (:class:`SecurityConfig`), and ``shadow keygen`` (:class:`KeygenConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from shadow.config.choices import ROLES, SCOPED_ROLES
from shadow.core.jobs import job_pattern_problem

DATA_MODES = ("mac", "curve")


@dataclass
class SecurityConfig:
    """ZeroMQ CURVE authentication and encryption, and who may do what. All empty: on
    loopback, this user's key set (:mod:`shadow.security.keyset`, made on first start), so no other
    local account can connect; beyond loopback, refused. Keyless only with ``insecure``.

    Make keys with ``shadow keygen role=...``. The coordinator and the workers bind with the
    cluster's pair (``server_key``) and admit the public keys in the ``allow_<role>s``
    directories, each key with that role; every process that connects (a worker, a trainer,
    a client such as ``shadow status``/``restore``/``ls``, an admin) carries its own pair
    (``client_key``) and the cluster's public key (``server_public``; a worker, which holds
    the server pair, needs none). ``data``: how a keyed worker's data socket takes gradient
    frames (docs/operations.md, "The gradient stream")."""

    server_key: str = ""  #: the cluster's secret key file (server.key_secret), for coordinator and workers
    server_public: str = ""  #: the cluster's public key file (server.key), for everything that connects
    client_key: str = ""  #: this process's own secret key file (a worker's, trainer's, client's or admin's)
    allow_workers: str = ""  #: directory of the workers' public .key files
    #: directory of the trainers' public .key files (in a subdirectory named after a job or a
    #: pattern of jobs: limited to those jobs)
    allow_trainers: str = ""
    #: directory of read-only clients' public .key files (status, ls, jobs, restore, export; in
    #: a subdirectory named after a job or a pattern of jobs: limited to those jobs)
    allow_clients: str = ""
    allow_admins: str = ""  #: directory of the admins' public .key files (what clients may, and drop)
    insecure: bool = False  #: no keys at all: a service anyone reaching it controls, or a client of one
    manifest_key: str = ""  #: file holding the key that signs manifests (persist.sign) and checks them
    data: str = "mac"  #: with keys, gradient frames: mac (in clear, per-rank MACs) or curve (encrypted too, slower)

    def allow(self) -> dict[str, str]:
        """Role -> its allow directory (the roles given one)."""
        return {r: getattr(self, f"allow_{r}s") for r in ROLES if getattr(self, f"allow_{r}s")}

    def __post_init__(self) -> None:
        if self.data not in DATA_MODES:
            raise ValueError(
                f"security.data={self.data!r} is not one of {DATA_MODES}: mac (authenticated, in clear, fast) "
                "or curve (encrypted too, about 10x slower per connection)"
            )
        if self.server_key and not self.allow():
            raise ValueError(
                f"security.server_key={self.server_key!r} needs the allow lists: security.allow_workers, "
                "allow_trainers, allow_clients and allow_admins, each a directory of public .key files "
                "(make pairs with `shadow keygen role=worker`, role=trainer, ...)"
            )
        if self.allow() and not self.server_key:
            given = ", ".join(f"security.allow_{r}s" for r in self.allow())
            raise ValueError(
                f"{given} needs security.server_key: the cluster's .key_secret file "
                "(make one with `shadow keygen role=server`)"
            )
        if self.client_key and not (self.server_public or self.server_key):
            raise ValueError(
                f"security.client_key={self.client_key!r} needs security.server_public: the "
                "cluster's public .key file (e.g. security.server_public=keys/server.key)"
            )
        if self.server_public and not self.client_key:
            raise ValueError(
                f"security.server_public={self.server_public!r} needs security.client_key: this "
                "process's own .key_secret file (make one with `shadow keygen role=client`, or the role it has)"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.server_key or self.client_key)

    def data_mode(self) -> str:
        """How this worker's data socket takes frames: ``plain`` (no keys: checksums),
        ``mac`` or ``curve`` (keyed; see :attr:`data`)."""
        return self.data if self.server_key else "plain"

    def check_workers_key(self, who: str) -> None:
        """A keyed cluster's workers connect with a worker key of their own, never the server's pair."""
        if self.server_key and not self.client_key:
            raise ValueError(
                f"{who} with security.server_key needs security.client_key: the workers' own key "
                "(make one with `shadow keygen role=worker` and put its .key in security.allow_workers)"
            )


KEY_ROLES = ("server", *ROLES)


@dataclass
class KeygenConfig:
    """Where ``shadow keygen`` writes a CURVE key pair, and for which role: ``server`` (the
    cluster's pair) or one of the roles that connect (worker, trainer, client, admin)."""

    role: str = "server"  #: server, worker, trainer, client or admin
    dir: str = ""  #: directory for NAME.key and NAME.key_secret (default: keys for the server, keys/ROLEs otherwise)
    name: str = ""  #: file stem (default: the role)
    overwrite: bool = False  #: replace an existing pair (holders of the old key stop working)
    #: limit a trainer's or a client's key to one job, or a pattern of job names (``team-a-*``):
    #: the pair goes in ``keys/<role>s/<job>/``, the directory that scopes it
    job: str = ""

    def __post_init__(self) -> None:
        if self.role not in KEY_ROLES:
            raise ValueError(f"role={self.role!r} is not one of {KEY_ROLES}")
        if self.job:
            if self.role not in SCOPED_ROLES:
                raise ValueError(
                    f"job={self.job!r}: {'an' if self.role[0] in 'aeiou' else 'a'} {self.role} key cannot be limited "
                    "to jobs; only "
                    f"{' and '.join(SCOPED_ROLES)} keys can (leave job= out)"
                )
            problem = job_pattern_problem(self.job)
            if problem is not None:
                raise ValueError(f"job={self.job!r}: {problem}")
        default = "keys" if self.role == "server" else f"keys/{self.role}s" + (f"/{self.job}" if self.job else "")
        self.dir = self.dir or default
        self.name = self.name or self.role
        if "/" in self.name or self.name.startswith("."):
            raise ValueError(f"name={self.name!r} is not a file stem; use e.g. name=worker0 or name=trainer")
