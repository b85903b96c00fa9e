"""This user's own key set: what keeps other local accounts and port squatters out of a
cluster started without keys of its own.

A cluster bound to loopback with no ``security.server_key`` runs with CURVE all the same,
with the pairs in this user's key directory (:func:`directory`: ``$XDG_CONFIG_HOME/shadow/keys``,
else ``~/.config/shadow/keys``): one server pair and one pair per role (worker, trainer,
client, admin), each role's public key its allow list. The first shadow process of the user
that needs it creates the whole set at once (built in a private scratch directory, renamed
into place; a process that loses the race takes the winner's), and every later one (the
cluster's workers, trainer ranks, ``shadow status``) finds it without configuration. Another
account cannot read the secrets (0700 directory, 0600 files, checked at every load and
refused otherwise), so it cannot connect; a process squatting the coordinator's port
without the server's secret cannot complete a handshake, so no client takes its answers.

Keyless stays possible only when asked for: ``security.insecure=true`` on a command,
``SHADOW_INSECURE=1`` for a trainer or another library client."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from shadow.config.choices import ROLES
from shadow.security.keys import ClientKeys, SecurityError, load_public, load_secret
from shadow.security.private import dir_problem, private_problem

logger = logging.getLogger(__name__)

ENV_INSECURE = "SHADOW_INSECURE"  #: "1": a library client (a trainer) connects without keys
PAIRS = ("server", *ROLES)  #: the pairs of a key set, each NAME.key and NAME.key_secret


def insecure_from_env() -> bool:
    """Whether ``SHADOW_INSECURE`` asks this process to connect without keys."""
    value = os.environ.get(ENV_INSECURE, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise SecurityError(f"{ENV_INSECURE}={value!r} is not 1 or 0; set {ENV_INSECURE}=1 only to reach a keyless cluster")


def directory() -> Path:
    """Where this user's key set lives: ``$XDG_CONFIG_HOME/shadow/keys`` (else
    ``~/.config/shadow/keys``); where that directory's parent cannot be made private (a home
    that cannot be written), ``shadow-keys-<uid>/keys`` under the temporary directory, which
    is refused, not taken, when another account made it first."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    home = Path(base) / "shadow"
    if not private_problem(str(home)):
        return home / "keys"
    fallback = Path(tempfile.gettempdir()) / f"shadow-keys-{os.getuid()}"
    problem = private_problem(str(fallback))
    if problem:
        raise SecurityError(
            f"no private place for this user's key set: {home} cannot be used ({private_problem(str(home))}) "
            f"nor {fallback} ({problem}). Point XDG_CONFIG_HOME at a directory of yours, or give the cluster "
            "keys (`shadow keygen`, security.server_key)"
        )
    logger.warning(
        "%s cannot be used (%s); this user's key set lives in %s", home, private_problem(str(home)), fallback
    )
    return fallback / "keys"


@dataclass(frozen=True)
class KeySet:
    """The pairs in one key directory (see the module's docstring)."""

    dir: Path

    def secret(self, name: str) -> Path:
        return self.dir / f"{name}.key_secret"

    def public(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    def client(self, role: str) -> ClientKeys:
        """The keys a process of ``role`` connects with."""
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        return ClientKeys(load_public(self.public("server")), *load_secret(self.secret(role)))

    def server_fields(self) -> dict[str, str]:
        """``security.*`` of a service of this set: the server pair, each role's public key as
        its allow list, and the worker pair (a worker connects to its coordinator with it)."""
        return {
            "server_key": str(self.secret("server")),
            "client_key": str(self.secret("worker")),
            **{f"allow_{r}s": str(self.public(r)) for r in ROLES},
        }


def _problem(path: Path) -> str:
    """Why ``path`` is not a usable key set of this user ("" if it is)."""
    try:
        problem = dir_problem(os.lstat(path), 0o077)
    except OSError as exc:
        return f"cannot read it ({exc})"
    if problem:
        return problem
    for name in PAIRS:
        for file, mask in ((path / f"{name}.key_secret", 0o077), (path / f"{name}.key", 0o022)):
            try:
                f = os.lstat(file)
            except FileNotFoundError:
                return f"{file.name} is missing"
            except OSError as exc:
                return f"cannot read {file.name} ({exc})"
            if not stat.S_ISREG(f.st_mode):
                return f"{file.name} is not a plain file (a link?)"
            if f.st_uid != os.getuid():
                return f"{file.name} belongs to uid {f.st_uid}, not to this user"
            if f.st_mode & mask:
                return f"{file.name} may be used by other accounts (mode {stat.S_IMODE(f.st_mode):o})"
    return ""


def _create(path: Path, client: bool = False) -> None:
    """Make the whole set in a private scratch directory beside ``path``, then rename it into
    place; when another process made it first, keep theirs. ``client``: made by a process
    about to connect (a trainer, a command), said louder: a cluster already running with
    a set that was deleted since cannot be reached with this new one."""
    parent = str(path.parent)
    problem = private_problem(parent)
    if problem:
        raise SecurityError(
            f"cannot make this user's key set under {parent}: {problem}. Fix that directory (mode 700, owned by "
            "you), point XDG_CONFIG_HOME elsewhere, or give the cluster keys (`shadow keygen`, security.server_key)"
        )
    scratch = tempfile.mkdtemp(prefix=".keys-", dir=parent)  # 0700
    try:
        for name in PAIRS:
            _, secret = zmq.auth.create_certificates(scratch, name)
            os.chmod(secret, 0o600)
        try:
            os.rename(scratch, path)
        except OSError:
            if not path.exists():
                raise
            return  # another process of this user made it first: use theirs
        if client:
            logger.warning(
                "made a new shadow key set for this user in %s: there was none. A cluster started before with a "
                "set that was deleted since refuses this process and every one after it; restart that cluster "
                "(it takes this set)",
                path,
            )
        else:
            logger.info("made this user's shadow key set in %s (server pair and one pair per role)", path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def ensure(path: str | os.PathLike | None = None, client: bool = False) -> KeySet:
    """This user's key set (at ``path``, default :func:`directory`), made when missing and
    checked: raises :class:`SecurityError` naming the problem and the fix when another account
    could read or replace it. ``client``: asked by a process about to connect (see :func:`_create`)."""
    where = Path(path) if path is not None else directory()
    if not os.path.lexists(where):
        _create(where, client)
    problem = _problem(where)
    if problem:
        raise SecurityError(
            f"this user's shadow key set {where} cannot be used: {problem}. Remove it (`rm -r {where}`) and the "
            "next start makes a new one (restart the cluster and its trainers then), or give keys explicitly "
            "(security.server_key and security.allow_*; trainers SHADOW_CURVE_SERVER_KEY/SHADOW_CURVE_CLIENT_KEY)"
        )
    return KeySet(where)


def check_given(server_key: str | os.PathLike) -> None:
    """A service given ``security.server_key`` explicitly that lies in this user's key set
    (a cluster hands its workers the set's files by path) checks the set as :func:`ensure`
    does, without making one: another account able to read it, or the set gone, is a
    :class:`SecurityError` naming the fix, not a key used unchecked."""
    try:
        where = directory()
        inside = Path(server_key).resolve().parent == where.resolve()
    except (OSError, SecurityError):  # no key set of this user's here: the file is not in one
        return
    if not inside:
        return
    if not os.path.lexists(where):
        raise SecurityError(
            f"this user's shadow key set {where} is gone (deleted since the cluster started): the running "
            "cluster's keys cannot be read again; restart the cluster (`shadow cluster`), which makes a new set"
        )
    problem = _problem(where)
    if problem:
        raise SecurityError(
            f"this user's shadow key set {where} cannot be used: {problem}. Remove it (`rm -r {where}`) and "
            "restart the cluster and its trainers (the next start makes a new one)"
        )


def loopback(host: str) -> bool:
    """Whether ``host`` (an interface name or address) is this machine's loopback."""
    return host in ("localhost", "::1") or host.startswith("127.")
