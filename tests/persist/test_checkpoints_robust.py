"""The catalog and the CLI facing odd job names, damaged manifests and shard headers,
missing directories, and pipes: a clear error or a skipped entry, never a crash."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from types import SimpleNamespace

import fsspec
import pytest
import torch

from shadow.persist import checkpoints, retention
from shadow.restore import find_checkpoint
from tests.conftest import ROOT
from tests.persist.test_persist_units import LAYOUT, _write_checkpoint


def shadow(*args: str) -> subprocess.CompletedProcess:
    """The CLI with stdout and stderr to pipes (not a terminal)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run(
        [sys.executable, "-m", "shadow", *args], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env
    )


# ---- job names ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["exp*", "gpt[small]", "../escape", ".", "..", "", "a/b", "a b", None, 3])
def test_invalid_job_names_are_refused_with_the_rule_and_a_fix(name):
    from shadow.core.jobs import InvalidJobNameError, check_job_name

    with pytest.raises(InvalidJobNameError) as err:
        check_job_name(name)
    text = str(err.value)
    assert repr(name) in text and "A-Za-z0-9" in text and "e.g." in text
    assert isinstance(err.value, ValueError)


def test_valid_job_names_pass():
    from shadow.core.jobs import JOB_NAME_MAX, check_job_name, job_name_problem

    for name in ("gpt", "exp-1.2_b", "A", "..x", "x..", "j" * JOB_NAME_MAX):
        assert check_job_name(name) == name and job_name_problem(name) is None


def test_a_job_name_over_the_length_limit_is_refused_with_a_name_that_fits():
    """Issue 53, item 8: job names had no length limit (300 characters were accepted, as a
    directory under every tier's root and a label of every metric)."""
    from shadow.core.jobs import JOB_NAME_MAX, InvalidJobNameError, check_job_name, job_name_problem

    name = "x" * 300
    with pytest.raises(InvalidJobNameError) as err:
        check_job_name(name)
    text = str(err.value)
    assert f"at most {JOB_NAME_MAX} characters" in text and "(300 characters)" in text and len(text) < 600
    fix = text.split("use e.g. job=")[1].strip("'")
    assert len(fix) == JOB_NAME_MAX and job_name_problem(fix) is None


def test_catalog_functions_refuse_a_job_name_that_would_glob_or_escape(tmp_path):
    from shadow.core.jobs import InvalidJobNameError

    root = str(tmp_path)
    for it in (1, 2):
        _write_checkpoint(root, "exp1", it, LAYOUT)
    with pytest.raises(InvalidJobNameError, match="exp"):
        retention.retain(root, "exp*", 1)
    with pytest.raises(InvalidJobNameError, match="escape"):
        checkpoints.list_checkpoints(root, job="../escape")
    with pytest.raises(InvalidJobNameError):
        checkpoints.list_torn(root, job="gpt[small]")
    assert [c.iteration for c in checkpoints.list_checkpoints(root, job="exp1")] == [1, 2]  # nothing deleted


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_glob_characters_in_the_root_are_taken_literally(tmp_path, kind):
    """fsspec's glob reads ``*``, ``?`` and ``[`` in the root as patterns unless escaped."""
    name = "ck[pt]*?"
    root = str(tmp_path / name) if kind == "local" else f"memory://{name}-{os.getpid()}"
    sibling = str(tmp_path / "ckp") if kind == "local" else f"memory://ckp-{os.getpid()}"  # [pt] would match it
    for it in (1, 2, 3):
        _write_checkpoint(root, "j", it, LAYOUT)
    _write_checkpoint(sibling, "j", 9, LAYOUT)
    fs, p = fsspec.core.url_to_fs(checkpoints.checkpoint_dir(root, "j", 5))
    fs.makedirs(p, exist_ok=True)  # a torn write
    assert [c.iteration for c in checkpoints.list_checkpoints(root, job="j")] == [1, 2, 3]
    assert [c.iteration for c in checkpoints.list_checkpoints(root)] == [1, 2, 3]
    assert len(checkpoints.list_torn(root, "j")) == 1
    assert find_checkpoint(root, kind, "j")[0].iteration == 3
    retention.retain(root, "j", 1)
    assert [c.iteration for c in checkpoints.list_checkpoints(root, job="j")] == [3]
    assert [c.iteration for c in checkpoints.list_checkpoints(sibling)] == [9]


def test_attach_and_coordinator_refuse_a_bad_job_name():
    """The trainer refuses before connecting; the coordinator refuses an attach message."""
    import trainer_hooks
    from shadow.coordinator.outbox import RecordingOutbox
    from shadow.coordinator.server import Coordinator
    from shadow.core.jobs import InvalidJobNameError

    with pytest.raises(InvalidJobNameError, match=r"'\.\./escape'"):
        trainer_hooks.attach(object(), None, "tcp://127.0.0.1:1", job="../escape")
    out = RecordingOutbox()
    coord = Coordinator("tcp://127.0.0.1:1", workers=1, outbox=out)
    coord.attach.on_attach([b"id"], {"job": "exp*", "rank": 0, "world": 1})
    assert coord.state.pending == {} and out.kinds() == ["error"] and "'exp*'" in out.last("error")["message"]


# ---- manifests ------------------------------------------------------------------------


def _manifest_path(root: str, job: str, it: int) -> str:
    return os.path.join(checkpoints.checkpoint_dir(root, job, it), checkpoints.MANIFEST)


def _damage(path: str, how: str) -> None:
    m = json.load(open(path))
    if how == "list":
        m = []
    elif how == "no-iteration":
        del m["iteration"]
    elif how == "iteration-str":
        m["iteration"] = "7"
    elif how == "shards-dict":
        m["shards"] = {"0": 1}
    elif how == "shard-bytes-str":
        m["shards"][0]["bytes"] = "12"
    elif how == "file-escapes":
        m["shards"][0]["file"] = "../../other/shard.safetensors"
    elif how == "job-mismatch":
        m["job"] = "other"
    elif how == "job-invalid":
        m["job"] = "../x"
    json.dump(m, open(path, "w"))


DAMAGE = [
    "list",
    "no-iteration",
    "iteration-str",
    "shards-dict",
    "shard-bytes-str",
    "file-escapes",
    "job-mismatch",
    "job-invalid",
]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_malformed_manifest_is_skipped_and_reported(tmp_path, how, caplog):
    root = str(tmp_path)
    _write_checkpoint(root, "good", 4, LAYOUT)
    _write_checkpoint(root, "bad", 5, LAYOUT)
    _damage(_manifest_path(root, "bad", 5), how)
    skipped: list = []
    with caplog.at_level("WARNING", logger="shadow.persist"):
        found = checkpoints.list_checkpoints(root, skipped=skipped)
    assert [(c.job, c.iteration) for c in found] == [("good", 4)]
    assert len(skipped) == 1 and skipped[0][0].endswith(os.path.join("bad", "iteration-0000000005", "manifest.json"))
    assert "iteration-0000000005" in caplog.text
    assert find_checkpoint(root, "local")[1].iteration == 4  # restore without job= is not blocked by the other job


def test_ls_and_verify_show_an_unreadable_manifest(tmp_path):
    root = str(tmp_path)
    _write_checkpoint(root, "good", 4, LAYOUT)
    _write_checkpoint(root, "bad", 5, LAYOUT)
    _damage(_manifest_path(root, "bad", 5), "list")
    res = shadow("ls", f"source={root}", "json=true")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert {(r["job"], r["state"]) for r in rows} == {("good", "complete"), ("bad", "unreadable")}
    assert any("manifest" in (r.get("error") or "") for r in rows)
    res = shadow("ls", f"source={root}")
    assert res.returncode == 0 and "unreadable" in res.stdout
    res = shadow("verify", f"source={root}", "json=true")
    assert res.returncode == 1, res.stderr  # a damaged manifest is a finding
    results = json.loads(res.stdout)
    assert [r["ok"] for r in results if r["job"] == "good"] == [True]
    bad = [r for r in results if r["job"] == "bad"]
    assert len(bad) == 1 and not bad[0]["ok"] and "manifest" in bad[0]["problems"][0]
    res = shadow("verify", f"source={root}")
    assert res.returncode == 1 and "UNREADABLE" in res.stdout and "good iteration 4: OK" in res.stdout


# ---- shard headers ------------------------------------------------------------------------


def _rewrite_header(path: str, edit) -> None:
    """Replace the JSON header of a plain shard file, keeping its length (the manifest's
    size still matches); ``edit(header) -> header``."""
    data = bytearray(open(path, "rb").read())
    (hlen,) = struct.unpack_from("<Q", data)
    header = json.loads(bytes(data[8 : 8 + hlen]))
    raw = json.dumps(edit(header), separators=(",", ":")).encode()
    assert len(raw) <= hlen
    data[8 : 8 + hlen] = raw + b" " * (hlen - len(raw))
    open(path, "wb").write(bytes(data))


EDITS = {
    "no-data-offsets": lambda h: {
        k: ({"dtype": v["dtype"], "shape": v["shape"]} if k == "param" else v) for k, v in h.items()
    },
    "spec-not-dict": lambda h: dict(h, param=[1, 2]),
    "bad-dtype": lambda h: dict(h, param=dict(h["param"], dtype="Q7")),
    "offsets-str": lambda h: dict(h, param=dict(h["param"], data_offsets=["0", "64"])),
    "header-list": lambda h: [h],
    "metadata-list": lambda h: dict(h, __metadata__=[1]),
    "no-start": lambda h: dict(h, __metadata__={k: v for k, v in h["__metadata__"].items() if k != "start"}),
    "start-word": lambda h: dict(h, __metadata__=dict(h["__metadata__"], start="zero")),
    "no-param-index": lambda h: {k: v for k, v in h.items() if k != "param_index"},
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_damaged_shard_header_falls_back_to_the_previous_checkpoint(tmp_path, edit):
    root = str(tmp_path)
    for it in (3, 6):
        _write_checkpoint(root, "j", it, LAYOUT)
    shard = os.path.join(checkpoints.checkpoint_dir(root, "j", 6), checkpoints.shard_name(0, 2))
    _rewrite_header(shard, EDITS[edit])
    info, snap = find_checkpoint(root, "local", check=False)  # no checksum: the header itself must be judged
    assert snap.iteration == 3
    with pytest.raises(checkpoints.CheckpointError, match="shard-00000-of-00002"):
        find_checkpoint(root, "local", iteration=6, check=False)


def test_a_bit_flip_in_a_shard_header_falls_back_on_every_tier(tmp_path):
    """A flipped bit in the JSON header, read through the local reader, fsspec and the
    compressed decoder: always a CheckpointError naming the file."""
    from shadow.persist import shardfile

    root = str(tmp_path)
    for it in (3, 6):
        _write_checkpoint(root, "j", it, LAYOUT)
    shard = os.path.join(checkpoints.checkpoint_dir(root, "j", 6), checkpoints.shard_name(0, 2))
    data = open(shard, "rb").read()
    pos = data.index(b'"data_offsets"') + 1  # "data_offsets" -> "dbta_offsets": a KeyError before
    flipped = data[:pos] + bytes([data[pos] ^ 0x03]) + data[pos + 1 :]
    open(shard, "wb").write(flipped)
    assert find_checkpoint(root, "local")[1].iteration == 3  # what `shadow restore` does
    remote = f"memory://flip-{os.getpid()}"
    for it in (3, 6):
        _write_checkpoint(remote, "j", it, LAYOUT)
    fs, p = fsspec.core.url_to_fs(checkpoints.checkpoint_dir(remote, "j", 6))
    fs.pipe_file(p + "/" + checkpoints.shard_name(0, 2), flipped)
    assert find_checkpoint(remote, "remote", check=False)[1].iteration == 3
    with pytest.raises(ValueError, match="data_offsets"):
        shardfile.parse(flipped)


# ---- the CLI: missing directories, out= ------------------------------------------------------


def test_ls_and_verify_on_a_missing_directory_say_so(tmp_path):
    missing = str(tmp_path / "nowhere")
    for cmd in ("ls", "verify"):
        res = shadow(cmd, f"source={missing}")
        assert res.returncode == 1 and "no such directory" in res.stderr and missing in res.stderr, (cmd, res)


def test_out_under_a_missing_parent_is_a_clear_error(tmp_path):
    _write_checkpoint(str(tmp_path / "ckpt"), "j", 1, LAYOUT)
    out = tmp_path / "missing" / "x.pt"
    for cmd in ("restore", "export"):
        res = shadow(cmd, f"source={tmp_path / 'ckpt'}", f"out={out}")
        assert res.returncode == 1, (cmd, res.stderr)
        assert str(out.parent) in res.stderr and "create" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_a_failed_export_leaves_no_temp_file(tmp_path, monkeypatch, fmt):
    from shadow import export as _export
    from shadow.export import state

    monkeypatch.setattr(state, "state_dicts", lambda snap: {"model": {"w": torch.ones(3)}})
    monkeypatch.setattr(state, "aliases", lambda snap: {})
    snap = SimpleNamespace(job="j", iteration=1, blobs={0: b""}, extras={})
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep").write_text("x")  # the target is a non-empty directory: the final rename fails
    with pytest.raises(OSError):
        _export.export(snap, str(out), fmt)
    with pytest.raises(OSError):
        _export.export_weights(snap, str(out), fmt)
    assert sorted(os.listdir(tmp_path)) == ["taken"] and os.listdir(out) == ["keep"]
    with pytest.raises(FileNotFoundError, match="create"):
        _export.export_weights(snap, str(tmp_path / "no" / "w.st"), fmt)


def test_an_empty_or_unwritable_out_is_a_clear_error(tmp_path, monkeypatch):
    """Row 17 (issue 38): ``out=`` empty and ``out=/proc/x.pt`` ended in raw tracebacks."""
    from shadow import export as _export
    from shadow.export import state

    _write_checkpoint(str(tmp_path / "ckpt"), "j", 1, LAYOUT)
    for cmd in ("restore", "export"):
        res = shadow(cmd, f"source={tmp_path / 'ckpt'}", "out=")
        assert res.returncode == 1 and "out= is empty" in res.stderr and "Traceback" not in res.stderr, res.stderr
    monkeypatch.setattr(state, "state_dicts", lambda snap: {"model": {"w": torch.ones(3)}})
    monkeypatch.setattr(state, "aliases", lambda snap: {})
    snap = SimpleNamespace(job="j", iteration=1, blobs={0: b""}, extras={})
    for fmt in ("torch", "safetensors"):
        with pytest.raises(OSError):  # what the CLI reports as "shadow restore: <why>", exit 1
            _export.export(snap, "/proc/x.pt", fmt)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_an_export_follows_no_link_left_at_its_temporary_or_final_name(tmp_path, monkeypatch, fmt):
    """Another account plants ``out.tmp`` (the old temporary name) and ``out`` itself as
    links to a file of the exporting user's: the export writes neither through them."""
    from shadow import export as _export
    from shadow.export import state

    monkeypatch.setattr(state, "state_dicts", lambda snap: {"model": {"w": torch.ones(3)}})
    monkeypatch.setattr(state, "aliases", lambda snap: {})
    snap = SimpleNamespace(job="j", iteration=1, blobs={0: b""}, extras={})
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's own file")
    shared = tmp_path / "shared"
    shared.mkdir()
    out = shared / "ckpt.pt"
    (shared / "ckpt.pt.tmp").symlink_to(victim)
    _export.export(snap, str(out), fmt)
    assert victim.read_bytes() == b"the user's own file" and not out.is_symlink()
    out.unlink()
    out.symlink_to(victim)  # a link at the final name is replaced, not written through
    _export.export_weights(snap, str(out), fmt)
    assert victim.read_bytes() == b"the user's own file" and not out.is_symlink() and out.stat().st_size > 0
    assert sorted(os.listdir(shared)) == ["ckpt.pt", "ckpt.pt.tmp"]  # no temporary file left


def test_a_directory_export_goes_into_a_private_directory_first(tmp_path, monkeypatch):
    """format=dcp fills a fresh directory no one else can enter, then renames it to out=;
    a link, a file or a non-empty directory at out= is refused, saying so."""
    from shadow import export as _export
    from shadow.export import state

    sd = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {}, "param_groups": []}}
    monkeypatch.setattr(state, "state_dicts", lambda snap: sd)
    monkeypatch.setattr(state, "aliases", lambda snap: {})
    snap = SimpleNamespace(job="j", iteration=1, layout=SimpleNamespace(params=[SimpleNamespace(name="w")]))
    seen = []
    import torch.distributed.checkpoint as dcp

    save = dcp.save

    def spy(state_dict, checkpoint_id, **kw):
        seen.append(os.stat(checkpoint_id).st_mode & 0o777)
        return save(state_dict, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(dcp, "save", spy)
    out = tmp_path / "dcp"
    _export.export(snap, str(out), "dcp")
    assert seen == [0o700] and (out / "shadow.json").is_file() and (out / ".metadata").is_file()
    mask = os.umask(0o022)
    os.umask(mask)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~mask  # then as any directory the user makes
    victim = tmp_path / "victim"
    victim.mkdir()
    link = tmp_path / "link"
    link.symlink_to(victim)
    for taken in (out, link):
        with pytest.raises(FileExistsError, match="not an empty directory"):
            _export.export(snap, str(taken), "dcp")
    assert os.listdir(victim) == [] and sorted(os.listdir(tmp_path)) == ["dcp", "link", "victim"]


# ---- tables on a pipe -------------------------------------------------------------------------


def test_plan_on_a_pipe_is_not_cut_to_80_columns():
    res = shadow("plan")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for header in (
        "strategy",
        "interval",
        "restorable after",
        "useful (simulated)",
        "lost GPU-h/day",
        "dominant cost",
        "trainer egress / GPU",
        "measured CPU",
    ):
        assert header in out, header
    assert "…" not in out
    measured = [line for line in out.splitlines() if "CPU-s/it/B" in line][0]
    assert "(" in measured and ")" in measured.split("(", 1)[1]  # the path of the figures, whole


def test_status_table_on_a_pipe_keeps_every_header():
    """``shadow status`` renders through the same console as ``ls`` and ``plan``."""
    code = (
        "import sys, time; from shadow.cli._render import render_status; "
        "w = dict(id=0, shard=0, start=0, stop=1024, applied=5, seen=5, health='ok', stale='', bytes_per_s=1e6, "
        "replay_s_per_iteration=0.01, frames_in=10, rejected={}, pid=1, "
        "data='tcp://very-long-host-name.cluster.example.internal:45555'); "
        "render_status(dict(workers=[w], expected_workers=1, job=None), 'tcp://127.0.0.1:5555')"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "COLUMNS"},
    )
    assert res.returncode == 0, res.stderr
    for header in (
        "replay ms/it",
        "frames in",
        "rejected",
        "data address",
        "tcp://very-long-host-name.cluster.example.internal:45555",
    ):
        assert header in res.stdout, header
    assert "…" not in res.stdout
