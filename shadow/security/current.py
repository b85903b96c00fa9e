"""This process's client keys: set by the CLI, else the environment's, else the pair of this
process's role of this user's key set (:mod:`shadow.security.keyset`)."""

from __future__ import annotations

from shadow.config.choices import ROLES
from shadow.security import keyset
from shadow.security.keys import ClientKeys, client_from_env

_UNSET = object()
_process_client: ClientKeys | None | object = _UNSET
_default_role = "trainer"


def set_client(keys: ClientKeys | None) -> None:
    """The keys every client socket of this process uses (the CLI sets them from its config);
    None: no keys (a keyless cluster's client, ``security.insecure=true``)."""
    global _process_client
    _process_client = keys


def reset_client() -> None:
    """Forget :func:`set_client`: back to the environment's keys, else this user's key set."""
    global _process_client
    _process_client = _UNSET


def set_role(role: str) -> None:
    """The role whose pair of this user's key set this process connects with when it has no
    keys of its own (default ``trainer``; the CLI's clients take ``client``, ``drop`` ``admin``)."""
    global _default_role
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    _default_role = role


def current_client() -> ClientKeys | None:
    """This process's client keys: as set by :func:`set_client`; else from the environment
    (``SHADOW_CURVE_SERVER_KEY``/``SHADOW_CURVE_CLIENT_KEY``); else none when
    ``SHADOW_INSECURE=1``; else the pair of this process's role (:func:`set_role`) of this user's key set
    (:mod:`shadow.security.keyset`, made on first use), which the user's loopback clusters admit."""
    if _process_client is not _UNSET:
        return _process_client  # type: ignore[return-value]
    keys = client_from_env()
    if keys is not None:
        return keys
    if keyset.insecure_from_env():
        return None
    return keyset.ensure(client=True).client(_default_role)
