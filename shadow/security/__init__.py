"""Who may connect and send what: ZeroMQ CURVE keys and roles (:mod:`.keys`), the ZAP guard
(:mod:`.guard`), doors for the sockets in clear (:mod:`.doors`), this process's client keys
(:mod:`.current`), this user's key set (:mod:`.keyset`) and the ``security`` config.

A cluster has one server key pair (coordinator and workers bind with it) and one allow
directory of public keys per role (:data:`ROLES`: worker, trainer, client, admin). Everything
that connects (a worker, a trainer rank, ``shadow status``/``restore``/``ls``, an admin)
carries its own pair and the cluster's public key. The :class:`Guard` admits a key with
its role, and only on a socket that takes that role; the role travels with every message
received on the connection (ZeroMQ's ``User-Id`` property, :func:`role_of`), so a server
checks who sent each message. A trainer's or a client's key can be limited to named jobs
(a job-scoped role, :class:`Peer`): its public half sits in a subdirectory of the role's
allow directory named after the job (or a pattern of job names), and the scope travels with
its role. Keys travel as z85 text (40 bytes), as ``zmq.auth`` writes them.
"""

from shadow.config.choices import ROLES
from shadow.security.current import current_client, reset_client, set_client, set_role
from shadow.security.doors import DOOR_DOMAIN, DOOR_WAIT_S, TEMPORARY, Door, ticket_door
from shadow.security.guard import DOMAIN, ZAP_ENDPOINT, Guard, doorkeeper, guard_from_config
from shadow.security.keys import (
    ENV_CLIENT_KEY,
    ENV_SERVER_KEY,
    SCOPED_ROLES,
    ClientKeys,
    Peer,
    SecurityError,
    client,
    client_from_config,
    client_from_env,
    client_keys,
    generate,
    load_allow_list,
    load_peers,
    load_public,
    load_roles,
    load_secret,
    peer_of,
    role_of,
)

__all__ = [
    "DOMAIN",
    "DOOR_DOMAIN",
    "DOOR_WAIT_S",
    "ENV_CLIENT_KEY",
    "ENV_SERVER_KEY",
    "ROLES",
    "SCOPED_ROLES",
    "TEMPORARY",
    "ZAP_ENDPOINT",
    "ClientKeys",
    "Door",
    "Guard",
    "Peer",
    "SecurityError",
    "client",
    "client_from_config",
    "client_from_env",
    "client_keys",
    "current_client",
    "doorkeeper",
    "generate",
    "guard_from_config",
    "load_allow_list",
    "load_public",
    "load_peers",
    "load_roles",
    "load_secret",
    "peer_of",
    "reset_client",
    "role_of",
    "set_client",
    "set_role",
    "ticket_door",
]
