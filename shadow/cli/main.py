"""The ``shadow`` command line (also ``python -m shadow``): Hydra-composed typed configs
(``key=value`` overrides, ``--config-dir``/``--config-name``, ``--cfg job``) handed to
one function per command."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from shadow.cli._commands import (
    cmd_drop,
    cmd_export,
    cmd_jobs,
    cmd_keygen,
    cmd_ls,
    cmd_plan,
    cmd_restore,
    cmd_status,
    cmd_verify,
)
from shadow.cli._compose import UsageError, compose, split, to_yaml
from shadow.cli._help import command_help, usage
from shadow.cli._services import cmd_agent, cmd_cluster, cmd_coordinator, cmd_worker

COMMANDS: dict[str, Callable[[Any], int]] = {  # each takes its command's config
    "cluster": cmd_cluster,
    "coordinator": cmd_coordinator,
    "worker": cmd_worker,
    "agent": cmd_agent,
    "status": cmd_status,
    "restore": cmd_restore,
    "export": cmd_export,
    "ls": cmd_ls,
    "verify": cmd_verify,
    "jobs": cmd_jobs,
    "drop": cmd_drop,
    "keygen": cmd_keygen,
    "plan": cmd_plan,
}
# commands that connect to a cluster as a CURVE client (drop: with an admin key)
CLIENTS = ("status", "restore", "export", "ls", "verify", "jobs", "drop")
ADMIN_COMMANDS = ("drop",)  # the clients that connect with the admin pair of this user's key set


def main(argv: list[str] | None = None) -> int:
    from_process = argv is None  # this process was started for this command
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "worker" and from_process:
        from shadow.worker import malloc

        malloc.reexec()  # with malloc on huge pages, where available (once)
    if name not in COMMANDS:
        print(f"shadow: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        args = split(rest)
        if args.help:
            print(command_help(name))
            return 0
        cfg = compose(name, args)
    except UsageError as exc:
        print(f"shadow {name}: {exc}\n(`shadow {name} --help` lists the keys)", file=sys.stderr)
        return 2
    if args.show:
        print(to_yaml(cfg).rstrip("\n"))
        return 0
    from shadow.core.errors import ShadowError

    try:
        sec = getattr(cfg, "security", None)
        if name in CLIENTS and sec is not None:
            from shadow import security

            if sec.enabled:
                security.set_client(security.client_from_config(sec))
            elif sec.insecure:
                security.set_client(None)  # a keyless cluster's client
            else:  # this user's key set, found (or made) when the command first connects
                security.set_role("admin" if name in ADMIN_COMMANDS else "client")
        return COMMANDS[name](cfg)
    except (ShadowError, OSError, ValueError) as exc:
        print(f"shadow {name}: {exc}", file=sys.stderr)
        return 1
