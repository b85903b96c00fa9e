"""A keyed cluster's keys for tests and benchmarks, laid out as ``shadow keygen role=...``
writes them."""

from __future__ import annotations

from shadow import security


def role_keys(root) -> dict:
    """The server pair, a pair per role with its allow directory, the cluster's security
    arguments (``args``) and each connecting role's :class:`~shadow.security.ClientKeys`."""
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
    return {"args": args, **keys}
