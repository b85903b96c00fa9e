"""This user's key set (shadow.security.keyset): made once, whole and private; refused whenever another
account could read or replace it; what every client of this user connects with by default;
and what a process squatting a port, or another local account, cannot get past."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import zmq
import zmq.auth

from shadow import security
from shadow.core.errors import ShadowConnectionError
from shadow.security import SecurityError, keyset
from shadow.transport.client import dealer, request
from shadow.wire import messages as M


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A user whose key set does not exist yet."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("SHADOW_INSECURE", raising=False)
    return keyset.directory()


def test_the_set_is_made_once_whole_and_private(fresh):
    assert not fresh.exists()
    made = keyset.ensure()
    assert made.dir == fresh and os.stat(fresh).st_mode & 0o777 == 0o700
    for name in keyset.PAIRS:
        assert os.stat(made.secret(name)).st_mode & 0o777 == 0o600
        assert made.public(name).is_file()
    assert sorted(os.listdir(fresh.parent)) == ["keys"]  # no scratch directory left behind
    server = made.client("trainer").server_public
    assert keyset.ensure().client("client").server_public == server  # found again, not made again
    pairs = {made.client(r).public for r in ("worker", "trainer", "client", "admin")}
    assert len(pairs) == 4 and server not in pairs  # one pair per role, none of them the server's


def test_processes_racing_to_make_it_all_take_the_same_set(fresh):
    code = "from shadow import keyset; print(keyset.ensure().client('trainer').server_public.decode())"
    env = dict(os.environ)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1
    assert keyset.ensure().client("admin").server_public.decode() == outs[0][0].strip()
    assert sorted(os.listdir(fresh.parent)) == ["keys"]


def _tamper(case: str, made: keyset.KeySet, tmp_path) -> None:
    if case == "directory others may read":
        os.chmod(made.dir, 0o750)
    elif case == "secret others may read":
        os.chmod(made.secret("trainer"), 0o640)
    elif case == "public key others may replace":
        os.chmod(made.public("server"), 0o666)
    elif case == "secret replaced by a link":
        elsewhere = tmp_path / "elsewhere"
        _, secret = zmq.auth.create_certificates(str(elsewhere.parent), "elsewhere")
        os.unlink(made.secret("client"))
        os.symlink(secret, made.secret("client"))
    elif case == "directory replaced by a link":
        os.rename(made.dir, made.dir.with_name("real"))
        os.symlink(made.dir.with_name("real"), made.dir)
    elif case == "a pair missing":
        os.unlink(made.secret("admin"))
    elif case == "owned by another account":
        os.chown(made.dir, 65534, 65534)


CASES = {
    "directory others may read": "others may use it (mode 750)",
    "secret others may read": "trainer.key_secret may be used by other accounts (mode 640)",
    "public key others may replace": "server.key may be used by other accounts (mode 666)",
    "secret replaced by a link": "client.key_secret is not a plain file",
    "directory replaced by a link": "it is not a directory",
    "a pair missing": "admin.key_secret is missing",
    "owned by another account": "belongs to uid 65534",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_set_another_account_could_read_or_replace_is_refused(fresh, tmp_path, case):
    if case == "owned by another account" and os.getuid() != 0:
        pytest.skip("only root can give a directory to another account")
    made = keyset.ensure()
    _tamper(case, made, tmp_path)
    with pytest.raises(SecurityError) as err:
        keyset.ensure()
    assert CASES[case] in str(err.value) and f"rm -r {fresh}" in str(err.value)
    with pytest.raises(SecurityError):  # and so is every client that would connect with it
        security.current_client()


def test_a_client_connects_with_its_roles_pair_unless_told_otherwise(fresh, tmp_path, monkeypatch):
    made = keyset.ensure()
    assert security.current_client() == made.client("trainer")  # a library client is a trainer
    security.set_role("client")
    assert security.current_client() == made.client("client")
    monkeypatch.setenv("SHADOW_INSECURE", "1")
    assert security.current_client() is None  # keyless only when asked for
    monkeypatch.setenv("SHADOW_INSECURE", "perhaps")
    with pytest.raises(SecurityError, match="SHADOW_INSECURE='perhaps' is not 1 or 0"):
        security.current_client()
    monkeypatch.delenv("SHADOW_INSECURE")
    public, secret = security.generate(tmp_path / "own", "mine")
    monkeypatch.setenv(security.ENV_SERVER_KEY, str(public))
    monkeypatch.setenv(security.ENV_CLIENT_KEY, str(secret))
    assert security.current_client().public == security.load_public(public)  # keys given win
    security.set_client(None)
    assert security.current_client() is None


def _answer_status(sock: zmq.Socket):
    """Answer every request on ``sock`` with a made-up status, on a thread; returns (the
    requests it read, stop), stop closing the socket: the thread closes it, and stop returns
    only once that thread has ended (its context is terminated after, never under its poll)."""
    heard: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                ident, raw = sock.recv_multipart()
                heard.append(raw)
                sock.send_multipart([ident, M.encode("status_reply", status={"workers": []})])
        sock.close(0)

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    def halt() -> None:
        stop.set()
        t.join(5)
        assert not t.is_alive(), "the answering thread did not stop"

    return heard, halt


def _squatter(curve: bool):
    """A ROUTER on a free loopback port answering every request with a made-up status, as a
    process that took a stopped coordinator's port would; ``curve``: with a server pair of
    its own (it cannot have the user's). Returns (address, requests it read, stop)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        public, secret = zmq.curve_keypair()
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    heard, halt = _answer_status(sock)
    return f"tcp://127.0.0.1:{port}", heard, lambda: (halt(), ctx.term())


@pytest.mark.slow
@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve with its own pair"])
def test_a_port_squatter_gets_no_word_in(fresh, curve):
    """Row 10 of issue 38: a squatter answered restore_info and fetch and got a trainer's
    weights. Every client of this user holds the server's public key, so a process without
    the server's secret completes no handshake: it reads nothing, and nothing it says is taken."""
    address, heard, stop = _squatter(curve)
    try:
        ctx = zmq.Context()
        sock = dealer(ctx, address)
        with pytest.raises(ShadowConnectionError, match="no shadow coordinator answered"):
            request(sock, address, M.encode("status"), 2.0, ("status_reply",))
        sock.close(0)
        ctx.term()
        res = subprocess.run(
            [sys.executable, "-m", "shadow", "restore", f"source={address}", "timeout=3", f"out={fresh.parent}/x.pt"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
        assert heard == []  # not one message got through to it
        assert not (fresh.parent / "x.pt").exists()
    finally:
        stop()


CHILD = r"""
import json, os, sys
os.setgroups([]); os.setgid(65534); os.setuid(65534)
os.environ["XDG_CONFIG_HOME"] = sys.argv[2]
import zmq
from shadow import keyset, security
from shadow.transport.client import dealer, request
from shadow.core.errors import ShadowError
from shadow.wire import messages as M
seen = {}
try:
    open(sys.argv[3], "rb").read()
    seen["read_secret"] = "read"
except OSError as exc:
    seen["read_secret"] = type(exc).__name__
mine = keyset.ensure()  # the other account's own set
ctx = zmq.Context()
for name, keys in (("own_set", mine.client("trainer")), ("no_keys", None)):
    sock = dealer(ctx, sys.argv[1], keys=keys) if keys else dealer(ctx, sys.argv[1], curve=False)
    try:
        request(sock, sys.argv[1], M.encode("status"), 2.0, ("status_reply",))
        seen[name] = "answered"
    except ShadowError as exc:
        seen[name] = str(exc)[:60]
    sock.close(0)
os.write(1, json.dumps(seen).encode())
"""


@pytest.mark.slow
@pytest.mark.skipif(os.getuid() != 0, reason="switching to another account takes root")
def test_another_local_account_can_neither_read_the_set_nor_connect(monkeypatch):
    """Row 12 of issue 38: another account (uid 65534) restored a default cluster's parameters.
    Now it cannot read this user's keys, and with keys of its own or none it is not answered.
    Both homes lie where any account may walk (0755 under /tmp): only the key set's own modes
    keep the other account out."""
    import shutil
    import tempfile

    homes = tempfile.mkdtemp(prefix="shadow-accounts-")
    try:
        os.chmod(homes, 0o755)
        mine, theirs = os.path.join(homes, "mine"), os.path.join(homes, "theirs")
        os.mkdir(mine, 0o755)
        os.mkdir(theirs, 0o755)
        os.chown(theirs, 65534, 65534)
        monkeypatch.setenv("XDG_CONFIG_HOME", mine)
        made = keyset.ensure()
        address, heard, stop = _served(made)
        try:
            res = _as_other_account(CHILD, address, theirs, str(made.secret("client")))
        finally:
            stop()
    finally:
        shutil.rmtree(homes, ignore_errors=True)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    assert seen["read_secret"] == "PermissionError"
    assert seen["own_set"].startswith("no shadow coordinator answered") and seen["no_keys"].startswith(
        "no shadow coordinator answered"
    )
    assert heard == []


def _served(made: keyset.KeySet):
    """A server of this user's set answering status, as a default coordinator does."""
    ctx = zmq.Context()
    guard = security.Guard(made.secret("server"), {r: made.public(r) for r in ("worker", "trainer", "client", "admin")})
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    guard.server(sock)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    heard, stop = _answer_status(sock)

    def halt() -> None:
        stop()
        guard.stop()
        ctx.term()

    # this user is answered
    mine = dealer(ctx, f"tcp://127.0.0.1:{port}", keys=made.client("client"))
    assert request(mine, "served", M.encode("status"), 30.0, ("status_reply",))["t"] == "status_reply"
    mine.close(0)
    heard.clear()
    return f"tcp://127.0.0.1:{port}", heard, halt


def _as_other_account(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a child that becomes uid 65534 before it reads anything of this user's:
    the interpreter is this one, forked (another account may not be able to start it from here)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        os.dup2(write, 1)
        try:
            sys.argv = ["child", *args]
            exec(compile(code, "child", "exec"), {"__name__": "__child__"})
            sys.stdout.flush()
        except BaseException as exc:
            os.write(write, json.dumps({"error": repr(exc)}).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess(["child"], os.waitstatus_to_exitcode(status), out, "")


def test_a_home_that_cannot_be_written_falls_back_to_a_private_temporary_directory(tmp_path, monkeypatch):
    import tempfile

    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "config").write_text("a file where a directory should be")  # nothing can be made under it
    monkeypatch.setenv("XDG_CONFIG_HOME", str(ro / "config"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    made = keyset.ensure()
    assert made.dir == tmp_path / "tmp" / f"shadow-keys-{os.getuid()}" / "keys"
    assert os.stat(made.dir.parent).st_mode & 0o777 == 0o700
    os.chmod(made.dir.parent, 0o777)  # as if another account had made it first, open to all
    with pytest.raises(SecurityError, match="no private place for this user's key set.*others may write to it"):
        keyset.ensure()


def test_a_default_cluster_is_keyed_and_answers_no_client_without_keys(shared_cluster):
    """`shadow cluster` with no keys given: CURVE with this user's key set; a client without
    keys gets no answer (test_security counts such handshakes at a guard)."""
    st = shared_cluster.status()  # this process's keys: this run's key set
    assert st["security"]["curve"] is True
    ctx = zmq.Context()
    sock = dealer(ctx, shared_cluster.address, curve=False)
    try:
        with pytest.raises(ShadowConnectionError, match="no shadow coordinator answered"):
            request(sock, shared_cluster.address, M.encode("status"), 2.0, ("status_reply",))
    finally:
        sock.close(0)
        ctx.term()
    assert shared_cluster.status()["security"]["curve"] is True  # and it answers this user still


def test_a_worker_given_the_sets_files_checks_them_as_the_set_is_checked(fresh, monkeypatch):
    """Issue 53, item 8: a cluster hands its workers this user's key set by path, and a
    worker restarted later used those files unchecked. It now refuses a set another
    account could read, a set that is gone, and a set replaced since the cluster started
    (whose new pair could never complete a handshake with the cluster: 555 silent
    ``handshake_crypto`` refusals before), each naming the fix."""
    import dataclasses
    import shutil

    from shadow.cli import _services
    from shadow.config import SecurityConfig

    made = keyset.ensure()
    given = dataclasses.replace(SecurityConfig(), **made.server_fields())
    assert _services.secure(given, "127.0.0.1", "worker 0") is given  # as the cluster hands it over
    started = security.load_secret(given.server_key)[0].decode()
    monkeypatch.setenv(_services.CLUSTER_KEY_ENV, started)
    assert _services.secure(given, "127.0.0.1", "worker 0") is given

    secret = made.secret("server")
    os.chmod(secret, 0o644)
    with pytest.raises(SecurityError, match="server.key_secret may be used by other accounts"):
        _services.secure(given, "127.0.0.1", "worker 0")
    os.chmod(secret, 0o600)

    shutil.rmtree(fresh)
    with pytest.raises(SecurityError, match="is gone .* restart the cluster"):
        _services.secure(given, "127.0.0.1", "worker 0")

    keyset.ensure()  # any client of this user's makes a new set at the same paths
    with pytest.raises(SecurityError, match="no longer holds the pair the cluster started with") as err:
        _services.secure(given, "127.0.0.1", "worker 0")
    assert started in str(err.value) and "restart the cluster" in str(err.value)


def test_a_client_that_makes_the_set_says_a_running_cluster_will_refuse_it(fresh, caplog):
    """Issue 53, item 8: a deleted key set was silently made again by the next client, which
    then could not reach a cluster still running with the old one. Made by a client, the new
    set is announced as a warning that names that consequence and the fix."""
    import logging

    security.reset_client()
    with caplog.at_level(logging.INFO, logger="shadow.security.keyset"):
        keys = security.current_client()
    assert keys is not None and fresh.exists()
    (rec,) = [r for r in caplog.records if "key set" in r.getMessage()]
    assert rec.levelno == logging.WARNING and "restart that cluster" in rec.getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shadow.security.keyset"):
        security.current_client()  # found, not made: nothing said
    assert not [r for r in caplog.records if "key set" in r.getMessage()]
