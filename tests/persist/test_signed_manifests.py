"""Signed manifests (``persist.sign``): the coordinator signs each manifest with the key
in ``security.manifest_key``; verify, ls and restore given the key refuse one that is
unsigned or altered by anyone without the key (a restore of the newest falls back to the
older good one), and read it unchecked without a key."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from shadow.config import ListConfig, PersistConfig, RestoreConfig, SecurityConfig, VerifyConfig
from shadow.coordinator.persistence import Persistence
from shadow.core.errors import CheckpointError
from shadow.persist import checkpoints, shardfile, signing
from shadow.restore import find_checkpoint, resolve
from shadow.wire.frames import Field, checksum
from tests.persist.test_file_modes import write_checkpoints
from tests.persist.test_persist_schedule import TIER
from tests.persist.test_persist_units import LAYOUT, _write_checkpoint

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch):
    monkeypatch.delenv(signing.ENV, raising=False)


@pytest.fixture
def key_file(tmp_path) -> str:
    path = tmp_path / "manifest.key"
    path.write_bytes(KEY)
    path.chmod(0o600)
    return str(path)


def _manifest_path(root: str, iteration: int, job: str = "j") -> str:
    return os.path.join(checkpoints.checkpoint_dir(root, job, iteration), checkpoints.MANIFEST)


def _signed_checkpoints(root: str, iterations=(1, 2), key: bytes = KEY) -> None:
    """Checkpoints as a coordinator with persist.sign writes them (fabricated shards)."""
    for it in iterations:
        _write_checkpoint(root, "j", it, LAYOUT)
        path = _manifest_path(root, it)
        with open(path) as f:
            manifest = json.load(f)
        checkpoints.write_manifest(root, "j", it, manifest, sign_key=key)


def _attack(root: str, iteration: int, edit) -> None:
    """Rewrite a manifest as someone without the key would: edit it, keep its signature."""
    path = _manifest_path(root, iteration)
    with open(path) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


def _flip(s: str, at: int = -1) -> str:
    c = s[at]
    return s[:at] + ("0" if c != "0" else "1") + (s[at + 1 :] if at != -1 else "")


EDITS = {
    "checksum": lambda m: m["shards"][1].update(checksum=_flip(m["shards"][1]["checksum"])),
    "file": lambda m: m["shards"][1].update(file=m["shards"][1]["file"].replace(".safetensors", ".shard.zst")),
    "file-byte": lambda m: m["shards"][0].update(file=_flip(m["shards"][0]["file"], 6)),
    "bytes": lambda m: m["shards"][0].update(bytes=m["shards"][0]["bytes"] - 1),
    "iteration": lambda m: m.update(iteration=m["iteration"] + 1),
    "layout_hash": lambda m: m.update(layout_hash=_flip(m["layout_hash"])),
    "generation": lambda m: m.update(generation=1),
    "unsigned": lambda m: m.pop(signing.FIELD),
    "signature": lambda m: m.update(signature=_flip(m[signing.FIELD])),
}


# ---- the key and the signature --------------------------------------------------------------


def test_load_key_says_what_is_wrong_and_how_to_make_one(tmp_path, key_file, caplog):
    assert signing.load_key(key_file) == KEY
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * 31)
    for path, what in ((tmp_path / "missing", "does not exist"), (short, "holds 31 bytes"), (tmp_path, "regular")):
        with pytest.raises(ValueError, match=what) as err:
            signing.load_key(str(path))
        assert "head -c 32 /dev/urandom > manifest.key && chmod 600 manifest.key" in str(err.value)
    with pytest.raises(ValueError, match="no manifest key file given"):
        signing.load_key("")
    loose = tmp_path / "loose.key"
    loose.write_bytes(KEY)
    loose.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="shadow.persist.signing"):
        assert signing.load_key(str(loose)) == KEY
    assert "readable by others" in caplog.text and "chmod 600" in caplog.text


def test_a_signature_covers_every_field_and_survives_the_file(tmp_path):
    _signed_checkpoints(str(tmp_path), [1])
    with open(_manifest_path(str(tmp_path), 1)) as f:
        manifest = json.load(f)
    assert manifest[signing.FIELD].startswith("hmac-sha256:")
    signing.check(manifest, KEY)  # as read back from its file
    with pytest.raises(signing.SignatureError, match="may have been tampered with"):
        signing.check(manifest, OTHER)
    for name, edit in EDITS.items():
        m = json.loads(json.dumps(manifest))
        edit(m)
        with pytest.raises(signing.SignatureError, match="tampered"):
            signing.check(m, KEY)
        assert name
    with pytest.raises(ValueError, match="at least 32 bytes"):
        signing.sign(manifest, b"short")


def test_resolve_names_the_same_variable():
    import importlib

    assert importlib.import_module("shadow.restore.resolve").KEY_ENV == signing.ENV


def test_persistence_with_sign_needs_the_key():
    cfg = PersistConfig(sign=True)
    with pytest.raises(ValueError, match="security.manifest_key"):
        Persistence(cfg)
    assert Persistence(cfg, sign_key=KEY).sign_key == KEY
    assert Persistence(PersistConfig(), sign_key=KEY).sign_key is None  # signing is persist.sign's decision


# ---- the coordinator signs; readers check ----------------------------------------------------------


def test_the_coordinator_signs_and_a_signed_checkpoint_verifies_and_restores(tmp_path, key_file, capsys, monkeypatch):
    from shadow.cli._commands import cmd_ls, cmd_verify

    local = str(tmp_path / "local")
    write_checkpoints({"local": dict(TIER, every_n=1, dir=local), "sign": True}, [1, 2], sign_key=KEY)
    for it in (1, 2):
        with open(_manifest_path(local, it)) as f:
            signing.check(json.load(f), KEY)
    info, snap = find_checkpoint(local, "local", sign_key=KEY)
    assert snap.iteration == 2 and info.verified and info.signed and checkpoints.verify(info) == []
    assert find_checkpoint(local, "local")[1].iteration == 2  # no key: read, unchecked
    monkeypatch.setenv(signing.ENV, key_file)
    assert cmd_verify(VerifyConfig(source=local)) == 0
    out = capsys.readouterr().out
    assert "j iteration 2: OK" in out and "signature verified" in out
    assert cmd_ls(ListConfig(source=local, json=True)) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["iteration"], r["state"], r["signature"]) for r in rows} == {
        (1, "complete", "verified"),
        (2, "complete", "verified"),
    }
    monkeypatch.delenv(signing.ENV)
    assert cmd_verify(VerifyConfig(source=local)) == 0
    captured = capsys.readouterr()
    assert "signed (not checked: no key)" in captured.out and "signatures were not checked" in captured.err


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_altered_manifest_is_refused_by_verify_and_skipped_by_restore(
    tmp_path, key_file, edit, caplog, capsys, monkeypatch
):
    from shadow.cli._commands import cmd_ls, cmd_verify

    root = str(tmp_path / "ckpt")
    _signed_checkpoints(root)
    _attack(root, 2, EDITS[edit])
    with caplog.at_level(logging.WARNING):
        info, snap = find_checkpoint(root, "local", sign_key=KEY)
    assert snap.iteration == 1 and info.verified  # the older good one, never the altered one
    assert "iteration-0000000002" in caplog.text and "tampered" in caplog.text
    with pytest.raises(CheckpointError, match=r"iteration 2 .*tampered") as err:
        find_checkpoint(root, "local", iteration=2, sign_key=KEY)
    assert "iteration-0000000002" in str(err.value)
    assert resolve(root, sign_key=KEY).iteration == 1
    # verify (no security section: the key file from SHADOW_MANIFEST_KEY): a finding, named, saying why
    monkeypatch.setenv(signing.ENV, key_file)
    assert cmd_verify(VerifyConfig(source=root, json=True)) == 1
    results = {r["iteration"]: r for r in json.loads(capsys.readouterr().out)}
    assert results[1]["ok"] and results[1]["signature"] == "verified"
    bad = [r for r in results.values() if not r["ok"]]
    assert len(bad) == 1 and "tampered" in bad[0]["problems"][0] and "iteration-0000000002" in bad[0]["path"]
    # ls marks it (its config's security.manifest_key)
    monkeypatch.delenv(signing.ENV)
    cfg = ListConfig(source=root, json=True, security=SecurityConfig(manifest_key=key_file))
    assert cmd_ls(cfg) == 0
    rows = json.loads(capsys.readouterr().out)
    marked = [r for r in rows if r["state"] == "unreadable"]
    assert len(marked) == 1 and "tampered" in marked[0]["error"]


def _forge_generation(root: str, generation: int, base: int, job: str = "j") -> str:
    """A generation record as someone who can write the tier but has no key would plant it."""
    path = os.path.join(root, job, checkpoints.GENERATION.format(generation))
    record = {"format": "shadow-generation/1", "job": job, "generation": generation, "base": base, "created": 0.0}
    with open(path, "w") as f:
        json.dump(record, f)
    return path


def test_a_forged_generation_record_cannot_roll_a_signed_tier_back(tmp_path, key_file, capsys, monkeypatch):
    """Row 14 (issue 38): an unsigned ``generation-000099.json {base 2}`` made a restore
    holding the key return 2, ``ls`` show 4, 6 and 8 superseded and ``verify`` exit 0.
    Generation records are signed like manifests; with the key a forged one is ignored,
    and verify reports it."""
    from shadow.cli._commands import cmd_verify

    root = str(tmp_path / "ckpt")
    _signed_checkpoints(root, (2, 4, 6))
    real = str(tmp_path / "real")
    _signed_checkpoints(real, (2, 4))
    checkpoints.write_generation(real, "j", 1, 2, sign_key=KEY)  # as the coordinator writes one: honoured
    assert [c.superseded for c in checkpoints.list_checkpoints(real, "local", "j", sign_key=KEY)] == [True, False]
    forged = _forge_generation(root, 99, 2)
    skipped: list = []
    listed = checkpoints.list_checkpoints(root, "local", "j", skipped, KEY)
    assert [c.iteration for c in listed if not c.superseded] == [2, 4, 6]
    assert [p for p, _ in skipped] == [forged] and "not signed" in skipped[0][1]
    assert find_checkpoint(root, "local", sign_key=KEY)[1].iteration == 6
    monkeypatch.setenv(signing.ENV, key_file)
    assert cmd_verify(VerifyConfig(source=root, json=True)) == 1
    results = json.loads(capsys.readouterr().out)
    bad = [r for r in results if not r["ok"]]
    assert len(bad) == 1 and bad[0]["job"] == "j" and "generation-000099.json" in bad[0]["path"]
    # without the key the record is taken as written (what signing is for); every checkpoint
    # then being superseded is said as such, not as damage
    assert find_checkpoint(root, "local")[1].iteration == 2
    _forge_generation(root, 100, -1)
    with pytest.raises(CheckpointError, match="every one found .* is superseded by a generation record"):
        find_checkpoint(root, "local")
    # the coordinator, with the key, counts no forged generation either
    pers = Persistence(PersistConfig.from_dict({"local": dict(TIER, every_n=1, dir=root), "sign": True}), sign_key=KEY)
    assert pers.generations["j"] == 0


def test_a_restore_through_the_cluster_checks_generation_records_with_its_own_key(tmp_path):
    """Issue 53, item 6: a forged, unsigned generation record in a signed tier was ignored by
    a direct reader with the key, but a restore through the coordinator (its catalog) took
    the rolled-back iteration: the coordinator listed the tier without the key and flagged
    the newer checkpoints superseded. It lists with the cluster's key now, and sends the
    records themselves, which the client checks with its own key as a direct reader does."""
    from shadow.coordinator import queries
    from shadow.coordinator.cluster import ClusterState
    from shadow.coordinator.outbox import RecordingOutbox
    from shadow.restore.node_local import ClusterTierSource
    from shadow.restore.resolve import pick

    root = str(tmp_path / "ckpt")
    _signed_checkpoints(root, (2, 4, 6))
    _forge_generation(root, 99, 2)
    config = PersistConfig.from_dict({"local": dict(TIER, every_n=1, dir=root), "sign": True})

    def catalog(sign_key: bytes | None) -> dict:
        out = RecordingOutbox()
        q = queries.Queries(ClusterState(expected=1), out, Persistence(config, sign_key=sign_key))
        q.on_catalog([b"c"], {"t": "catalog", "tier": "local", "job": "j"})
        return out.last("catalog_reply", b"c")

    reply = catalog(KEY)
    assert [e[2] for e in reply["checkpoints"]] == [False, False, False]  # the coordinator ignores it too
    assert [p for p, _ in reply["generations"]] == ["j/generation-000099.json"]

    def newest(reply: dict, sign_key: bytes | None) -> int:
        src = ClusterTierSource("local", root, "tcp://127.0.0.1:1", [], 1.0, sign_key=sign_key)
        src._catalog = lambda job: reply  # type: ignore[method-assign]  # the coordinator's answer
        return pick(src, "j")[1].iteration

    assert newest(reply, KEY) == 6
    # a coordinator whose catalog flags them superseded (an older one, or one run without the
    # key): the client, with the key, still reads the records itself and ignores the forged one
    flagged = {**reply, "checkpoints": [[e[0], e[1], True] if e[0].endswith("6") else e for e in reply["checkpoints"]]}
    assert newest(flagged, KEY) == 6
    assert newest(flagged, None) == 2  # without a key the record is taken as written, as a direct reader takes it
    real = str(tmp_path / "real")  # a signed record, as the coordinator writes one: honoured through the cluster
    _signed_checkpoints(real, (2, 4))
    checkpoints.write_generation(real, "j", 1, 2, sign_key=KEY)
    honest = {
        **reply,
        "generations": [
            ["j/generation-000001.json", open(os.path.join(real, "j", "generation-000001.json"), "rb").read()]
        ],
    }
    assert newest(honest, KEY) == 2


def test_checksums_catch_corruption_not_tampering_signatures_catch_both(tmp_path, key_file, monkeypatch):
    """An attacker replaces a shard and writes its checksum into the manifest: without a
    key the restore takes the forged data (documented); with the key it is refused."""
    root = str(tmp_path / "ckpt")
    _signed_checkpoints(root)
    shard = os.path.join(checkpoints.checkpoint_dir(root, "j", 2), checkpoints.shard_name(1, 2))
    data = bytearray(open(shard, "rb").read())
    _, base, specs = shardfile.tensor_specs(data)
    lo = next(lo for name, _, lo, _ in specs if name == "param")
    data[base + lo : base + lo + 8] = np.float32([1e30, 1e30]).tobytes()  # two parameters, forged
    forged = bytes(data)
    with open(shard, "wb") as f:
        f.write(forged)
    _attack(root, 2, lambda m: m["shards"][1].update(checksum=f"{checksum(forged):016x}"))
    unchecked = find_checkpoint(root, "local")[1]
    assert unchecked.iteration == 2  # the checksum matches the forged file: corruption checks cannot tell
    assert (unchecked.arrays[Field.PARAM] == np.float32(1e30)).sum() == 2
    assert find_checkpoint(root, "local", sign_key=KEY)[1].iteration == 1
    monkeypatch.setenv(signing.ENV, key_file)  # what restore() and the CLI fall back to
    good = resolve(root)
    assert good.iteration == 1 and np.isfinite(good.arrays[Field.PARAM]).all()


def test_no_key_reads_signed_and_unsigned_a_wrong_key_refuses(tmp_path, key_file, monkeypatch):
    from shadow.cli._commands import cmd_verify

    root = str(tmp_path / "ckpt")
    _signed_checkpoints(root, [1])
    _write_checkpoint(root, "j", 2, LAYOUT)  # unsigned (written before persist.sign was on)
    assert find_checkpoint(root, "local")[1].iteration == 2
    assert find_checkpoint(root, "local", sign_key=KEY)[1].iteration == 1  # the unsigned one is refused
    with pytest.raises(CheckpointError, match="is not signed"):
        find_checkpoint(root, "local", iteration=2, sign_key=KEY)
    with pytest.raises(CheckpointError, match=r"no complete checkpoint .*2 unreadable.*tampered"):
        find_checkpoint(root, "local", sign_key=OTHER)
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(OTHER)
    wrong.chmod(0o600)
    monkeypatch.setenv(signing.ENV, str(wrong))
    assert cmd_verify(VerifyConfig(source=root)) == 1


def test_restore_command_takes_the_key_from_its_config(tmp_path, key_file, capsys, monkeypatch):
    import shadow.export
    from shadow.cli._commands import cmd_restore

    wrote = []
    monkeypatch.setattr(shadow.export, "export", lambda snap, out, fmt: (wrote.append(snap), open(out, "wb").close()))
    root = str(tmp_path / "ckpt")
    _signed_checkpoints(root)
    _attack(root, 2, EDITS["checksum"])
    out = tmp_path / "out.pt"
    cfg = RestoreConfig(source=root, out=str(out), security=SecurityConfig(manifest_key=key_file))
    assert cmd_restore(cfg) == 0
    assert "iteration 1" in capsys.readouterr().out and [s.iteration for s in wrote] == [1]
    missing = RestoreConfig(source=root, out=str(out), security=SecurityConfig(manifest_key=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="does not exist"):
        cmd_restore(missing)


def test_the_commands_take_the_key_from_config_or_environment(tmp_path, key_file, monkeypatch):
    """``shadow ls security.manifest_key=...`` and ``SHADOW_MANIFEST_KEY=... shadow verify``."""
    from tests.persist.test_checkpoints_robust import shadow

    root = str(tmp_path / "ckpt")
    _signed_checkpoints(root)
    _attack(root, 2, EDITS["file"])
    res = shadow("ls", f"source={root}", f"security.manifest_key={key_file}", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["iteration"]: r for r in json.loads(res.stdout)}
    assert rows[1]["signature"] == "verified" and rows[2]["state"] == "unreadable" and "tampered" in rows[2]["error"]
    monkeypatch.setenv(signing.ENV, key_file)
    res = shadow("verify", f"source={root}")
    monkeypatch.delenv(signing.ENV)
    assert res.returncode == 1 and "tampered" in res.stdout and "j iteration 1: OK" in res.stdout, res.stdout
    res = shadow("ls", f"source={root}", f"security.manifest_key={tmp_path / 'missing.key'}")
    assert res.returncode != 0 and "does not exist" in res.stderr and "head -c 32" in res.stderr


@pytest.mark.slow
def test_a_live_cluster_signs_and_restores_check_it(world1, tmp_path, key_file):
    """``shadow cluster persist.sign=true security.manifest_key=...``: every manifest the
    coordinator commits is signed; ``shadow verify manifest_key=`` says so, and a restore with
    the key reads it back equal to the trainer."""
    import subprocess
    import sys

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_hooks
    from shadow.testing import LocalCluster
    from tests.conftest import ROOT
    from tests.helpers.loop import train_step
    from tests.helpers.tiny_trainer import build

    local = tmp_path / "local"
    args = (f"persist.local.dir={local}", "persist.local.every_n=2", "persist.sign=true")
    cluster = LocalCluster(tmp_path, args=(*args, f"security.manifest_key={key_file}"))
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="signed")
        for it in range(1, 5):
            train_step(ddp, opt, sched, it)
        assert session.close() == 4
        cluster.wait_status(
            lambda st: (st["persist"]["local"]["last_complete"] or {}).get("iteration") == 4, what="iteration 4 on disk"
        )
    finally:
        cluster.stop()
    res = subprocess.run(
        [sys.executable, "-m", "shadow", "verify", f"source={local}", f"manifest_key={key_file}", "json=true"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert {r["signature"] for r in json.loads(res.stdout)} == {"verified"}
    fresh, fopt, fsched = build(seed=3)
    info = trainer_hooks.restore(
        fresh, fopt, source=str(local), scheduler=fsched, sign_key=signing.load_key(str(key_file))
    )
    assert info.iteration == 4
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
