"""The short commands: ``status``, ``restore``, ``export``, ``ls``, ``verify``, ``jobs``, ``drop``,
``keygen``.
Results go to stdout (a rich table, or JSON with ``--json``); problems to stderr."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from shadow.config import (
    DropConfig,
    ExportConfig,
    JobsConfig,
    KeygenConfig,
    ListConfig,
    RestoreConfig,
    StatusConfig,
    VerifyConfig,
)
from shadow.core.errors import ShadowError
from shadow.planner.config import PlanConfig


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def cmd_status(cfg: StatusConfig) -> int:
    from shadow.transport.client import ask
    from shadow.wire import messages as M

    def fetch() -> dict:
        payload = M.encode("status", **({"job": cfg.job} if cfg.job else {}))
        return ask(cfg.address, payload, cfg.timeout, ("status_reply",))["status"]

    st = fetch()
    if cfg.json:
        _print_json(st)
        return 0
    from shadow.cli._render import stdout_console
    from shadow.cli._render_front import any_panel as status_panel
    from shadow.cli._render_front import render_any as render_status

    if not cfg.watch:
        _unreadable_status(render_status, st, cfg.address)
        return 0
    import signal

    from rich.live import Live

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    # the watch runs until Ctrl-C or SIGTERM, even when started with SIGINT ignored (a
    # background job of a non-interactive shell inherits it so, and Python then never
    # raises KeyboardInterrupt)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    with Live(_unreadable_status(status_panel, st, cfg.address), auto_refresh=False, console=stdout_console()) as live:
        try:
            while True:
                time.sleep(cfg.watch)
                live.update(_unreadable_status(status_panel, fetch(), cfg.address), refresh=True)
        except KeyboardInterrupt:
            pass
    return 0


def _unreadable_status(render: Any, st: dict, address: str) -> Any:
    """``render(st, address)``; a status this build cannot read (a field missing or of
    another type: not a coordinator of this version, or not a coordinator) is a
    ``ShadowError`` saying so, not a traceback."""
    try:
        return render(st, address)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ShadowError(
            f"{address} answered a status this build cannot read ({type(exc).__name__}: {str(exc)[:200]}); "
            "is it a shadow coordinator of the same version? (`shadow status json=true` prints what it sent)"
        ) from None


def _ask(address: str, kind: str, timeout: float, expect: str, **fields: Any) -> dict:
    """One request to the coordinator at ``address`` and its ``expect`` reply (an ``error``
    reply, or no answer within ``timeout`` s, raises ``ShadowConnectionError``)."""
    import zmq

    from shadow.transport.client import dealer, request
    from shadow.wire import messages as M

    sock = dealer(zmq.Context.instance(), address)
    try:
        return request(sock, address, M.encode(kind, **fields), timeout, (expect,))
    finally:
        sock.close(linger=0)


def cmd_jobs(cfg: JobsConfig) -> int:
    reply = _ask(cfg.address, "jobs", cfg.timeout, "jobs_reply")
    if cfg.json:
        _print_json({k: v for k, v in reply.items() if k not in ("t", "v")})
        return 0
    from shadow.cli._render import render_jobs

    render_jobs(reply, cfg.address)
    return 0


def cmd_drop(cfg: DropConfig) -> int:
    # a refusal (trainers still heard from, no such job, not an admin key) is an error naming its cause and fix
    reply = _ask(cfg.address, "drop", cfg.timeout, "drop_reply", job=cfg.job, force=cfg.force)
    if cfg.json:
        _print_json({k: v for k, v in reply.items() if k not in ("t", "v")})
    else:
        print(reply["message"])
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
        optim = c.handle.manifest.get("optim")
        if isinstance(optim, dict) and optim.get("bit_exact") is False:
            row["bit_exact"] = False  # attached with exact=False: a replay within a few ulp, not bit for bit
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

    def listed_of(job):
        got = src.candidates(job)
        if isinstance(src, MemorySource):  # then the cluster's tiers
            got += [c for tier in cluster_tiers(src, key) for c in tier.candidates(job)]
        return got

    listed = listed_of(cfg.job)
    if isinstance(src, MemorySource) and not cfg.job:  # a shared cluster's jobs, each from its own coordinator
        for name in src.info.get("jobs") or []:
            listed += listed_of(name)
        unique = {(c.job, c.iteration, c.tier, c.path): c for c in listed}  # a tier lists every job's
        listed = list(unique.values())
    rows = [_ls_row(c) for c in listed]
    _note_unchecked("ls", [c.handle for c in listed if c.tier != "memory" and c.handle is not None], key)
    if cfg.json:
        print(json.dumps(rows, indent=2))
    else:
        from shadow.cli._render import render_checkpoints

        render_checkpoints(rows, cfg.source)
    return 0


def verify_checkpoint(c, source, deep: bool = False) -> dict[str, Any]:
    """One checkpoint's ``shadow verify`` result. ``status``: ``ok`` (every copy of every
    shard intact), ``degraded`` (some copies lost or damaged -- a lost replica -- but every
    shard has an intact one: ``restorable``), ``corrupt`` (some shard has no intact copy, or
    the shards do not tile the layout, or ``deep`` decoding fails). ``source`` a node-local
    tier of a cluster (``check_copies``): each holder's copy read; else the checkpoint's one
    copy of each shard. ``ok`` is what it always was: no problem found at all."""
    from shadow.persist import checkpoints

    check = getattr(source, "check_copies", None)  # a node-local tier: each disk's copy
    lost: list[dict] = []
    unrestorable: list[int] = []
    if check is not None:
        got = check(c)
        problems = got.layout + got.problems
        lost, unrestorable, restorable = got.lost, got.unrestorable, got.restorable
    else:
        problems = checkpoints.verify(c)
        restorable = not problems
    if deep and restorable:
        try:
            checkpoints.load(c, check=True)
        except Exception as exc:  # every way a decode can fail is a finding, not a crash
            problems.append(f"decoding: {type(exc).__name__}: {exc}")
            restorable = False
    return {
        "job": c.job,
        "iteration": c.iteration,
        "ok": not problems,
        "status": "ok" if not problems else ("degraded" if restorable else "corrupt"),
        "restorable": restorable,
        "problems": problems,
        "lost_copies": lost,
        "unrestorable_shards": unrestorable,
        "shards": len(c.manifest["shards"]),
        "bytes": c.bytes,
        "path": c.path,
        "signature": _signature(c),
        "tier": c.tier,
    }


def print_verify(results: list[dict], cluster: bool) -> None:
    """``shadow verify``'s text: per checkpoint OK, DEGRADED (a lost replica, still
    restorable), CORRUPT or UNREADABLE, then each problem."""
    signed = {"verified": ", signature verified", "unchecked": ", signed (not checked: no key)"}
    for r in results:
        name = f"{r['job']} iteration {r['iteration']}" + (f" ({r['tier']} tier)" if cluster else "")
        if r["shards"] is None:
            print(f"{name}: UNREADABLE")
        else:
            size = f"{r['shards']} shards, {r['bytes'] / 2**20:.1f} MiB{signed.get(r['signature'], '')}"
            if r["status"] == "degraded":
                n = len(r["lost_copies"])
                lost = f"{n} cop{'y' if n == 1 else 'ies'} lost or damaged" if n else "copies lost or damaged"
                print(f"{name}: DEGRADED: lost replica, still restorable ({lost}; {size})")
            else:
                print(f"{name}: {'OK' if r['status'] == 'ok' else 'CORRUPT'} ({size})")
        for i in r.get("unrestorable_shards") or []:
            print(f"  shard {i}: no intact copy left: not restorable")
        for p in r["problems"]:
            print(f"  {p}")


def cmd_verify(cfg: VerifyConfig) -> int:
    """Exit 0 when every checkpoint verified is restorable: OK, or DEGRADED (copies lost or
    damaged, every shard still has an intact one; the text and the JSON's ``status`` say
    so); 1 when one is CORRUPT or UNREADABLE, or nothing was found."""
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
    results = [verify_checkpoint(c, by_tier.get(c.tier), cfg.deep) for c in found]
    _note_unchecked("verify", found, key)
    results += [
        {
            "job": b["job"],
            "iteration": b["iteration"],
            "ok": False,
            "status": "unreadable",
            "restorable": False,
            "problems": [f"{b['path']}: {b['error']}"],
            "lost_copies": [],
            "unrestorable_shards": [],
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
        print_verify(results, cluster)
    return 0 if all(r["restorable"] for r in results) else 1


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
    if cfg.job:
        print(
            f"admit it as a {cfg.role} of job {cfg.job} only: its public key must be in the subdirectory {cfg.job}/ "
            f"of the cluster's security.allow_{cfg.role}s directory (a copy in another job's subdirectory adds "
            "that job)"
        )
    else:
        print(f"admit it as a {cfg.role}: its public key must be in the cluster's security.allow_{cfg.role}s directory")
    if cfg.role == "worker":
        print(f"on the worker (or shadow cluster): security.client_key={secret}")
    elif cfg.role == "trainer":
        print(f"on each trainer rank: SHADOW_CURVE_CLIENT_KEY={secret} (and SHADOW_CURVE_SERVER_KEY=<server.key>)")
    else:
        print(f"on this {cfg.role}: security.client_key={secret} security.server_public=<server.key>")
    return 0


def cmd_plan(cfg: PlanConfig) -> int:
    from shadow.planner import plan

    result = plan(cfg)
    if cfg.json:
        _print_json(result)
        return 0
    from shadow.cli._render_plan import render_plan

    render_plan(result)
    return 0
