"""A keyed cluster's keys for tests and benchmarks, laid out as ``shadow keygen role=...``
writes them."""

from __future__ import annotations

from collections.abc import Mapping

from shadow import security


def role_keys(root, scoped: Mapping[str, tuple[str, str]] | None = None) -> dict:
    """The server pair, a pair per role with its allow directory, the cluster's security
    arguments (``args``) and each connecting role's :class:`~shadow.security.ClientKeys`.
    ``scoped``: more keys, by name, each ``(role, job)``: a trainer's or a client's pair
    limited to that job (or pattern of jobs), in ``<role>s/<job>/`` as ``shadow keygen
    role=... job=...`` writes it; returned under its name."""
    security.generate(root, "server")
    for role in ("worker", "trainer", "client", "admin"):
        security.generate(root / f"{role}s", role)
    args = (
        f"security.server_key={root / 'server.key_secret'}",
        f"security.client_key={root / 'workers' / 'worker.key_secret'}",
        *(f"security.allow_{r}s={root / f'{r}s'}" for r in ("worker", "trainer", "client", "admin")),
    )
    keys = {
        r: security.client_keys(root / "server.key", root / f"{r}s" / f"{r}.key_secret")
        for r in ("trainer", "client", "admin")
    }
    for name, (role, job) in (scoped or {}).items():
        where = root / f"{role}s" / job
        security.generate(where, name)
        keys[name] = security.client_keys(root / "server.key", where / f"{name}.key_secret")
    return {"args": args, **keys}
