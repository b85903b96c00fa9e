"""The short commands: ``status``, ``restore``, ``export``, ``ls``, ``verify``, ``keygen``.
Results go to stdout (a rich table, or JSON with ``--json``); problems to stderr."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from shadow.config import ExportConfig, KeygenConfig, ListConfig, PlanConfig, RestoreConfig, StatusConfig, VerifyConfig


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def cmd_status(cfg: StatusConfig) -> int:
    import zmq

    from shadow.client import dealer, request
    from shadow.wire import messages as M

    def fetch() -> dict:
        sock = dealer(zmq.Context.instance(), cfg.address)
        try:
            return request(sock, cfg.address, M.encode("status"), cfg.timeout, ("status_reply",))["status"]
        finally:
            sock.close(linger=0)

    st = fetch()
    if cfg.json:
        _print_json(st)
        return 0
    from shadow.cli._render import render_status, status_view, stdout_console

    if not cfg.watch:
        render_status(st, cfg.address)
        return 0
    from rich.live import Live

    with Live(status_view(st, cfg.address), auto_refresh=False, console=stdout_console()) as live:
        try:
            while True:
                time.sleep(cfg.watch)
                live.update(status_view(fetch(), cfg.address), refresh=True)
        except KeyboardInterrupt:
            pass
    return 0


def _sign_key(cfg) -> bytes | None:
    """The manifest key a command checks signed checkpoints with: the file its
    ``security.manifest_key`` (``verify``: ``manifest_key``) names, else ``$SHADOW_MANIFEST_KEY``;
    None (neither set): signatures are not checked. A key file that is missing or short is an error."""
    from shadow.persist import signing

    given = getattr(cfg, "manifest_key", "") or getattr(getattr(cfg, "security", None), "manifest_key", "")
    path = given or os.environ.get(signing.ENV, "")
    return signing.load_key(path) if path else None


def _signature(info) -> str:
    """How a listed checkpoint's signature stands: ``verified`` (checked with the key),
    ``unchecked`` (signed, but no key was given) or ``none`` (not signed)."""
    return "verified" if info.verified else ("unchecked" if info.signed else "none")


def _note_unchecked(cmd: str, infos: list, key: bytes | None) -> None:
    if key is None and any(i.signed for i in infos):
        print(
            f"shadow {cmd}: these manifests are signed, but no manifest key was given (security.manifest_key "
            "or SHADOW_MANIFEST_KEY): signatures were not checked",
            file=sys.stderr,
        )


def _read(source: str, job, iteration, timeout: float, sign_key: bytes | None = None):
    from shadow.cli._render import byte_progress
    from shadow.restore import resolve

    with byte_progress(f"reading the checkpoint behind {source}") as progress:
        return resolve(source, job=job, iteration=iteration, timeout=timeout, progress=progress, sign_key=sign_key)


def cmd_restore(cfg: RestoreConfig) -> int:
    from shadow.cli._render import stage

    t0 = time.monotonic()
    _check_out(cfg.out)
    snap = _read(cfg.source, cfg.job, cfg.iteration, cfg.timeout, _sign_key(cfg))
    with stage(f"writing {cfg.out} ({cfg.format})"):
        from shadow.export import export

        export(snap, cfg.out, cfg.format)
    print(
        f"wrote {cfg.out} ({cfg.format}): job {snap.job} iteration {snap.iteration}, {len(snap.layout.params)} "
        f"parameters, {_size(cfg.out) / 2**20:.1f} MiB, from {snap.tier} ({snap.source}) in "
        f"{time.monotonic() - t0:.2f} s"
    )
    return 0


def cmd_export(cfg: ExportConfig) -> int:
    from shadow.cli._render import stage

    t0 = time.monotonic()
    _check_out(cfg.out)
    snap = _read(cfg.source, cfg.job, cfg.iteration, cfg.timeout, _sign_key(cfg))
    with stage(f"writing {cfg.out} ({cfg.format}, {cfg.dtype})"):
        from shadow.export import export_weights

        info = export_weights(snap, cfg.out, cfg.format, cfg.dtype)
    tied = f", {len(info['aliases'])} tied" if info["aliases"] else ""
    print(
        f"wrote {cfg.out} ({cfg.format}, {cfg.dtype}): model weights of job {snap.job} iteration "
        f"{snap.iteration}, {info['tensors']} tensors{tied}, {_size(cfg.out) / 2**20:.1f} MiB, from {snap.tier} "
        f"({snap.source}) in {time.monotonic() - t0:.2f} s"
    )
    return 0


def _check_out(out: str) -> None:
    """A missing parent of ``out=``, or a host without torch (a service-only install), is an
    error before the checkpoint is read, not after."""
    from shadow.export import check_out, require_torch

    check_out(out)
    require_torch(f"writing {out}")


def _missing_dir(source: str) -> str | None:
    """``"no such directory: ..."`` when ``source`` (a path or fsspec URL) is not a
    directory, else None; an empty listing of a mistyped path would look like no checkpoints."""
    from shadow.storage import storage_for

    st = storage_for(source)
    return None if st.isdir(st.base) else f"no such directory: {source}"


def _unreadable(c) -> dict:
    """What ``ls``/``verify`` report for a manifest the catalog skipped (an ``unreadable``
    :class:`~shadow.restore.Candidate`)."""
    return {"job": c.job, "iteration": c.iteration, "path": c.path, "error": f"unreadable manifest: {c.error}"}


def _ls_row(c) -> dict:
    """One row of ``shadow ls`` for a :class:`~shadow.restore.Candidate` (a tier's complete
    one also says how its signature stands, :func:`_signature`)."""
    if c.tier == "memory":
        return {"job": c.job, "iteration": c.iteration, "tier": "memory", "time": None, "bytes": None} | {
            "state": "complete",
            "path": c.path,
        }
    if c.state == "unreadable":
        return dict(_unreadable(c), tier=c.tier, time=None, bytes=None, state=c.state)
    row = {"job": c.job, "iteration": c.iteration, "generation": c.generation, "tier": c.tier, "time": c.time}
    row["bytes"] = c.bytes
    if c.state != "incomplete":
        row["raw_bytes"] = c.raw_bytes
    if c.handle is not None:
        row["signature"] = _signature(c.handle)
    return row | {"state": c.state, "path": c.path}


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)


def cmd_ls(cfg: ListConfig) -> int:
    from shadow.restore import MemorySource, open_source
    from shadow.restore.resolve import cluster_tiers

    key = _sign_key(cfg)
    src = open_source(cfg.source, cfg.timeout, sign_key=key)
    if not isinstance(src, MemorySource) and _missing_dir(cfg.source):
        print(f"shadow ls: {_missing_dir(cfg.source)}", file=sys.stderr)
        return 1
    listed = src.candidates(cfg.job)
    if isinstance(src, MemorySource):  # then the cluster's tiers
        listed += [c for tier in cluster_tiers(src, key) for c in tier.candidates(cfg.job)]
    rows = [_ls_row(c) for c in listed]
    _note_unchecked("ls", [c.handle for c in listed if c.tier != "memory" and c.handle is not None], key)
    if cfg.json:
        print(json.dumps(rows, indent=2))
    else:
        from shadow.cli._render import render_checkpoints

        render_checkpoints(rows, cfg.source)
    return 0


def cmd_verify(cfg: VerifyConfig) -> int:
    from shadow.persist import checkpoints
    from shadow.restore import MemorySource, TierSource
    from shadow.restore.resolve import cluster_tiers, is_endpoint
    from shadow.storage import source_tier

    key = _sign_key(cfg)
    if is_endpoint(cfg.source):  # a cluster: its tiers, every copy of every shard
        src = MemorySource(cfg.source, cfg.timeout)
        src.candidates(cfg.job)
        sources: list = cluster_tiers(src, key)
    elif _missing_dir(cfg.source):
        print(f"shadow verify: {_missing_dir(cfg.source)}", file=sys.stderr)
        return 1
    else:
        sources = [TierSource(source_tier(cfg.source), cfg.source, sign_key=key)]
    listed = [c for s in sources for c in s.candidates(cfg.job)]
    by_tier = {s.name: s for s in sources}
    found = [c.handle for c in listed if c.loadable]
    bad = [_unreadable(c) for c in listed if c.state == "unreadable"]
    if cfg.iteration is not None:
        found = [c for c in found if c.iteration == cfg.iteration]
        bad = [b for b in bad if b["iteration"] == cfg.iteration]
    if not found and not bad:
        what = "complete checkpoint" + (f" of iteration {cfg.iteration}" if cfg.iteration is not None else "")
        print(f"shadow verify: no {what} under {cfg.source}", file=sys.stderr)
        return 1
    results: list[dict[str, Any]] = []
    for c in found:
        copies = getattr(by_tier.get(c.tier), "verify_copies", None)  # a node-local tier: each disk's copy
        problems = copies(c) if copies is not None else checkpoints.verify(c)
        if cfg.deep and not problems:
            try:
                checkpoints.load(c, check=True)
            except Exception as exc:  # every way a decode can fail is a finding, not a crash
                problems.append(f"decoding: {type(exc).__name__}: {exc}")
        results.append(
            {
                "job": c.job,
                "iteration": c.iteration,
                "ok": not problems,
                "problems": problems,
                "shards": len(c.manifest["shards"]),
                "bytes": c.bytes,
                "path": c.path,
                "signature": _signature(c),
                "tier": c.tier,
            }
        )
    _note_unchecked("verify", found, key)
    results += [
        {
            "job": b["job"],
            "iteration": b["iteration"],
            "ok": False,
            "problems": [f"{b['path']}: {b['error']}"],
            "shards": None,
            "bytes": None,
            "path": b["path"],
            "signature": None,
            "tier": b.get("tier"),
        }
        for b in bad
    ]
    cluster = len(sources) > 1 or is_endpoint(cfg.source)
    if cfg.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            name = f"{r['job']} iteration {r['iteration']}" + (f" ({r['tier']} tier)" if cluster else "")
            if r["shards"] is None:
                print(f"{name}: UNREADABLE")
            else:
                signed = {"verified": ", signature verified", "unchecked": ", signed (not checked: no key)"}
                print(
                    f"{name}: {'OK' if r['ok'] else 'CORRUPT'} ({r['shards']} "
                    f"shards, {r['bytes'] / 2**20:.1f} MiB{signed.get(r['signature'], '')})"
                )
            for p in r["problems"]:
                print(f"  {p}")
    return 0 if all(r["ok"] for r in results) else 1


def cmd_keygen(cfg: KeygenConfig) -> int:
    from shadow.security import generate

    public, secret = generate(cfg.dir, cfg.name, overwrite=cfg.overwrite)
    print(f"public key: {public}")
    print(f"secret key: {secret} (mode 0600; keep it private)")
    if cfg.role == "server":
        print(f"coordinator and workers: security.server_key={secret} and the allow lists, e.g.")
        print("  security.allow_workers=keys/workers security.allow_trainers=keys/trainers")
        print("  security.allow_clients=keys/clients security.allow_admins=keys/admins")
        print(f"everything that connects: security.server_public={public} (trainers: SHADOW_CURVE_SERVER_KEY={public})")
        return 0
    print(f"admit it as a {cfg.role}: its public key must be in the cluster's security.allow_{cfg.role}s directory")
    if cfg.role == "worker":
        print(f"on the worker (or shadow cluster): security.client_key={secret}")
    elif cfg.role == "trainer":
        print(f"on each trainer rank: SHADOW_CURVE_CLIENT_KEY={secret} (and SHADOW_CURVE_SERVER_KEY=<server.key>)")
    else:
        print(f"on this {cfg.role}: security.client_key={secret} security.server_public=<server.key>")
    return 0


def cmd_plan(cfg: PlanConfig) -> int:
    from shadow.plan import plan

    result = plan(cfg)
    if cfg.json:
        _print_json(result)
        return 0
    from shadow.cli._render import render_plan

    render_plan(result)
    return 0
