"""Permissions of what the tiers write: checkpoint files 0600 and directories 0700 by
default, ``persist.mode`` otherwise, whatever the process's umask -- written by the real
worker-side persisters and the coordinator's :class:`Persistence`, in process -- and read
back by restore and verify as the same user."""

from __future__ import annotations

import os
import stat
import threading
import time

import numpy as np
import pytest

from shadow.config import PersistConfig
from shadow.config.tuning import Tuning
from shadow.coordinator.persistence import Persistence
from shadow.persist import checkpoints, shardfile, zshard
from shadow.persist.writer import ShardPersister
from shadow.restore import find_checkpoint
from shadow.storage import LocalStorage, storage_for, tiers_for
from shadow.storage.local import replacing
from shadow.wire.commit import UploadCopies
from tests.persist.test_persist_schedule import JOB, RANGES, TIER, _state


@pytest.fixture
def umask(request):
    """The process umask for the test (``request.param``, default 022), restored after."""
    old = os.umask(getattr(request, "param", 0o022))
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _modes_under(root: str) -> tuple[set[int], set[int]]:
    """``({directory modes}, {file modes})`` of ``root`` and everything under it."""
    dirs, files = {_mode(root)}, set()
    for d, subdirs, names in os.walk(root):
        dirs |= {_mode(os.path.join(d, s)) for s in subdirs}
        files |= {_mode(os.path.join(d, n)) for n in names}
    return dirs, files


def write_checkpoints(persist: dict, iterations, sign_key: bytes | None = None) -> Persistence:
    """Two real :class:`ShardPersister` s and the coordinator's :class:`Persistence` take a
    checkpoint of each of ``iterations`` (and copy it to the remote tier, if any), as a
    cluster would, without one."""
    cfg = PersistConfig.from_dict(persist)
    pers = Persistence(cfg, sign_key=sign_key)
    pers.reset(0)
    ps = [
        ShardPersister(cfg, "j", i, 2, _state(lo, hi), tuning=Tuning.load(persist_buffers=1))
        for i, (lo, hi) in enumerate(RANGES)
    ]
    try:
        for it in iterations:
            assert pers.local_due(it, None)
            for p in ps:
                p.snapshot(it, 1, 1, {0: b"rec"}, {"tokens": None})
            deadline = time.monotonic() + 30
            while any(t.in_flight for t in pers.tiers.values()):
                assert time.monotonic() < deadline, {n: t.last_error for n, t in pers.tiers.items()}
                for p in ps:
                    for rep in p.results():
                        for f in pers.on_report(JOB, rep, 2):
                            if not isinstance(f, UploadCopies):
                                continue
                            for shard, r in f.copies.items():
                                ps[shard].upload(f.iteration, 1, r.bytes, r.checksum)
                time.sleep(0.002)
            assert all(t.last_error == "" for t in pers.tiers.values()), [t.last_error for t in pers.tiers.values()]
    finally:
        for p in ps:
            assert p.close()
    return pers


CODECS = [("none", "none"), ("zstd", "none"), ("none", "zstd"), ("zstd", "zstd")]


@pytest.mark.parametrize(("mode", "umask"), [("", 0o022), ("0640", 0o022), ("0640", 0o077)], indirect=["umask"])
@pytest.mark.parametrize(("local_codec", "remote_codec"), CODECS)
def test_every_file_and_directory_a_checkpoint_creates_has_the_mode(tmp_path, umask, mode, local_codec, remote_codec):
    """Shards (plain and compressed), the remote copies, manifests, generation records and
    every directory: 0600/0700 by default, 0640/0750 with persist.mode=0640, under a
    permissive umask (not widened) and a restrictive one (not narrowed)."""
    local, remote = str(tmp_path / "local"), str(tmp_path / "shared" / "remote")
    persist = {
        "local": dict(TIER, every_n=1, dir=local, compress=local_codec),
        "remote": dict(TIER, every_n=1, url=remote, compress=remote_codec),
        "mode": mode,
    }
    pers = write_checkpoints(persist, [1, 2])
    pers.supersede("j", 1, 2)  # a generation record in each tier
    file_mode, dir_mode = (0o640, 0o750) if mode else (0o600, 0o700)
    for root in (local, remote):
        assert os.path.exists(os.path.join(root, "j", checkpoints.GENERATION.format(1)))
        assert sorted(os.listdir(os.path.join(root, "j"))) == [
            checkpoints.GENERATION.format(1),
            "iteration-0000000001",
            "iteration-0000000002",
        ]
        assert _modes_under(root) == ({dir_mode}, {file_mode}), root
    assert _mode(tmp_path / "shared") == dir_mode  # created above the remote root, too
    # readers, as the same user: restore and verify
    for tier, root in (("local", local), ("remote", remote)):
        info, snap = find_checkpoint(root, tier)
        assert snap.iteration == 2 and checkpoints.verify(info) == []


def test_existing_directories_keep_their_permissions(tmp_path, umask):
    root = tmp_path / "ckpt"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    st = LocalStorage(str(root))
    st.write_atomic(st.join("j", "generation-000001.json"), b"{}", parents=True)
    assert _mode(root) == 0o755 and _mode(root / "j") == 0o700
    assert _mode(root / "j" / "generation-000001.json") == 0o600


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o000], indirect=True)
def test_local_storage_creates_with_its_modes(tmp_path, umask):
    for file_mode, dir_mode in ((0o600, 0o700), (0o640, 0o750), (0o644, 0o755)):
        base = tmp_path / f"{file_mode:o}"
        st = storage_for(str(base), file_mode, dir_mode)
        assert isinstance(st, LocalStorage) and (st.file_mode, st.dir_mode) == (file_mode, dir_mode)
        d = st.join("j", "iteration-0000000001")
        st.makedirs(d)
        img = shardfile.ShardImage(shardfile.PAGE)
        img.layout([shardfile.Entry("param", "F32", 10)], {"format": shardfile.FORMAT})
        img.fill("param", np.arange(10, dtype=np.float32))
        st.write_image(os.path.join(d, "a.safetensors"), img)
        st.write_atomic(os.path.join(d, "manifest.json"), b"{}")
        src = tmp_path / f"src-{file_mode:o}"
        src.write_bytes(b"x" * 100)
        os.chmod(src, 0o644)
        st.put_file(str(src), os.path.join(d, "copy"))
        with st.open(os.path.join(d, "streamed"), "wb") as f:
            f.write(b"y")
        st.write_atomic(st.join("k", "deep", "record.json"), b"{}", parents=True)
        assert _modes_under(str(base)) == ({dir_mode}, {file_mode})
        assert (base / "j" / "iteration-0000000001" / "copy").read_bytes() == b"x" * 100
        assert not [n for n in os.listdir(d) if n.endswith(".tmp")]
    # the default: the owner only
    st = LocalStorage(str(tmp_path / "default"))
    st.write_atomic(st.join("j", "x"), b"1", parents=True)
    assert _modes_under(st.base) == ({0o700}, {0o600})


def test_the_writers_default_to_private_and_replacing_fixes_what_the_body_did(tmp_path, umask):
    from tests.persist.test_persist_units import _image

    img = _image(0, 100, 1, 0)
    path = tmp_path / "a" / "b" / "s.safetensors"
    img.write(str(path))
    assert (_mode(path), _mode(path.parent), _mode(path.parent.parent)) == (0o600, 0o700, 0o700)
    zpath = tmp_path / "z" / f"s{zshard.SUFFIX}"
    zshard.write(img.buf[: img.size], str(zpath), 1, file_mode=0o640, dir_mode=0o750)
    assert (_mode(zpath), _mode(zpath.parent)) == (0o640, 0o750)
    other = tmp_path / "c" / "f"
    with replacing(str(other)) as tmp:
        assert _mode(tmp) == 0o600  # never wider while being written
        os.chmod(tmp, 0o666)
        with open(tmp, "wb") as f:
            f.write(b"data")
    assert _mode(other) == 0o600 and other.read_bytes() == b"data"


def test_a_set_group_id_root_passes_its_group_down(tmp_path, umask):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.chmod(root, 0o2750)
    st = LocalStorage(str(root), 0o640, 0o750)
    st.write_atomic(st.join("j", "iteration-0000000001", "manifest.json"), b"{}", parents=True)
    for d in (root / "j", root / "j" / "iteration-0000000001"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o2750 and os.stat(d).st_gid == os.stat(root).st_gid
    assert _mode(root / "j" / "iteration-0000000001" / "manifest.json") == 0o640


def test_a_file_in_the_way_is_the_error_os_makedirs_gives(tmp_path):
    from shadow.storage import modes

    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        modes.makedirs(str(tmp_path / "f" / "j" / "iteration-0000000001"))
    with pytest.raises(FileExistsError):
        modes.makedirs(str(tmp_path / "f"))
    modes.makedirs(str(tmp_path))  # an existing directory: nothing to do
    modes.makedirs("")


def test_a_planted_link_as_the_temporary_file_is_not_followed(tmp_path, umask):
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    d = tmp_path / "ckpt"
    d.mkdir()
    os.symlink(target, d / f"manifest.json.{os.getpid()}-{threading.get_ident():x}.tmp")  # this writer's name
    with pytest.raises(OSError):
        LocalStorage(str(d)).write_atomic(str(d / "manifest.json"), b"{}")
    assert target.read_bytes() == b"keep"


def test_tiers_for_plumbs_the_modes(tmp_path):
    cfg = PersistConfig.from_dict(
        {
            "local": dict(TIER, every_n=1, dir=str(tmp_path / "l")),
            "remote": dict(TIER, every_n=1, url=f"file://{tmp_path}/r"),
            "mode": "0660",
        }
    )
    local, remote = tiers_for(cfg)
    assert (local.storage.file_mode, local.storage.dir_mode) == (0o660, 0o770)
    assert (remote.storage.file_mode, remote.storage.dir_mode) == (0o660, 0o770)
    default = tiers_for(PersistConfig.from_dict({"local": dict(TIER, every_n=1, dir=str(tmp_path / "l"))}))[0]
    assert (default.storage.file_mode, default.storage.dir_mode) == (0o600, 0o700)


def test_verify_and_restore_read_private_checkpoints_as_the_same_user(tmp_path, umask, capsys):
    from shadow.cli._commands import cmd_verify
    from shadow.config import VerifyConfig

    local = str(tmp_path / "local")
    write_checkpoints({"local": dict(TIER, every_n=1, dir=local)}, [1])
    assert _modes_under(local) == ({0o700}, {0o600})
    assert cmd_verify(VerifyConfig(source=local)) == 0
    assert "j iteration 1: OK" in capsys.readouterr().out
    assert find_checkpoint(local, "local")[1].iteration == 1


@pytest.mark.parametrize("mode", ["0666", "0644", "0700", "0604", "0610", "0400", "1777", "rw"])
def test_a_mode_that_lets_others_in_or_executes_is_refused(mode):
    """Row 17 (issue 38): ``persist.mode=0666`` was accepted although the docs forbid
    other accounts' bits."""
    with pytest.raises(ValueError, match="not a checkpoint file mode"):
        PersistConfig.from_dict({"mode": mode})
    for ok in ("0600", "0640", "0660", "600"):
        assert PersistConfig.from_dict({"mode": ok}).file_mode in (0o600, 0o640, 0o660)


def test_a_checkpoint_directory_name_is_matched_whole():
    """Row 17 (issue 38): the name's pattern accepted a trailing newline."""
    assert checkpoints.dir_key("iteration-0000000005") == (0, 5)
    assert checkpoints.dir_key("iteration-0000000005-gen2/") == (2, 5)
    for bad in ("iteration-0000000005\n", "iteration-5x", "xiteration-5", "iteration-0000000005-gen2\n"):
        assert checkpoints.dir_key(bad) is None, bad
