"""CURVE keys, the ZAP guard and its refusal counts, over real sockets on 127.0.0.1."""

from __future__ import annotations

import os
import select
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from shadow import security as S
from shadow.cli._compose import UsageError, parse
from shadow.config import ClusterConfig, SecurityConfig, StatusConfig
from tests.conftest import ROOT

PAYLOAD = b"shadow-plaintext-marker-0123456789"


def wait_for(pred, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    S.generate(d, "server")
    S.generate(d / "allow", "trainer")
    S.generate(d / "clients", "client")
    S.generate(d, "stranger")
    return d


class Secured:
    """A ROUTER behind a Guard, and DEALER clients that get closed with linger=0."""

    def __init__(self, keys: Path) -> None:
        self.ctx = zmq.Context()
        self.guard = S.Guard(keys / "server.key_secret", {"trainer": keys / "allow", "client": keys / "clients"})
        self.guard.start(self.ctx)
        self.server = self.ctx.socket(zmq.ROUTER)
        self.server.linger = 0
        self.guard.server(self.server)
        self.port = self.server.bind_to_random_port("tcp://127.0.0.1")
        self.sockets = [self.server]

    def client(self, keypair=None, server_public: bytes | None = None, port: int | None = None) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 0
        if keypair is not None:
            S.client(s, server_public or self.guard.public, keypair)
        s.connect(f"tcp://127.0.0.1:{port or self.port}")
        self.sockets.append(s)
        return s

    def close(self) -> None:
        for s in self.sockets:
            s.close(linger=0)
        self.guard.stop()
        self.ctx.term()


@pytest.fixture
def secured(keys):
    sec = Secured(keys)
    yield sec
    sec.close()


def test_a_keys_directory_keygen_creates_is_private_whatever_the_umask(tmp_path, caplog):
    """Row 17 (issue 38): under umask 022 ``shadow keygen`` left ``keys/`` 0755."""
    old = os.umask(0o022)
    try:
        S.generate(tmp_path / "deep" / "keys", "server")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "deep" / "keys").st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    S.generate(shared, "trainer")  # an existing directory others may write to: said, not changed
    assert "may be written by other accounts" in caplog.text and stat.S_IMODE(shared.stat().st_mode) == 0o777


def test_keygen_cli_writes_a_private_pair_and_refuses_to_overwrite(tmp_path):
    def keygen(*args):
        return subprocess.run(
            [sys.executable, "-m", "shadow", "keygen", f"dir={tmp_path / 'k'}", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            check=False,
        )

    res = keygen("role=server")
    assert res.returncode == 0, res.stderr
    public, secret = tmp_path / "k" / "server.key", tmp_path / "k" / "server.key_secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert f"security.server_key={secret}" in res.stdout and f"security.server_public={public}" in res.stdout
    before = S.load_secret(secret)
    assert S.load_public(public) == before[0]
    res = keygen("role=server")
    assert res.returncode == 1 and f"{public} already exists" in res.stderr and "overwrite=true" in res.stderr
    assert keygen("role=server", "overwrite=true").returncode == 0
    assert S.load_secret(secret) != before
    res = keygen("role=trainer", "name=trainer0")
    assert res.returncode == 0 and "security.allow_trainers" in res.stdout and "SHADOW_CURVE_CLIENT_KEY" in res.stdout
    assert (tmp_path / "k" / "trainer0.key_secret").exists()
    res = subprocess.run(
        [sys.executable, "-m", "shadow", "keygen", "role=worker"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0 and (tmp_path / "keys" / "workers" / "worker.key_secret").exists(), res.stderr
    assert "security.allow_workers" in res.stdout and "security.client_key=" in res.stdout
    res = keygen("role=root")
    assert res.returncode == 2 and "role='root' is not one of" in res.stderr
    assert [p.name for p in (tmp_path / "k").iterdir() if p.name.startswith(".")] == []
    help_ = subprocess.run(
        [sys.executable, "-m", "shadow", "keygen", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert help_.returncode == 0 and "role=server" in help_.stdout and "overwrite=false" in help_.stdout


def test_allowed_keys_get_through_with_their_role(secured, keys):
    for name, role in (("allow/trainer", "trainer"), ("clients/client", "client")):
        c = secured.client(S.load_secret(keys / f"{name}.key_secret"))
        c.send(PAYLOAD)
        assert secured.server.poll(2000), "the allowed client's message did not arrive"
        frames = secured.server.recv_multipart(copy=False)
        assert frames[-1].bytes == PAYLOAD and S.role_of(frames[-1]) == role
        secured.server.send_multipart([frames[0].bytes, b"pong"])
        assert c.poll(2000) and c.recv() == b"pong"
    assert secured.guard.accepted == 2 and secured.guard.refused == {}


def test_the_server_pair_is_no_ones_key(secured, keys):
    """Workers connect with keys of their own: the cluster's pair is not admitted as a client."""
    c = secured.client(S.load_secret(keys / "server.key_secret"))
    c.send(PAYLOAD)
    assert not secured.server.poll(300)
    assert wait_for(lambda: secured.guard.refused.get("unknown_key", 0) >= 1), secured.guard.refused


def test_a_socket_admits_only_its_roles(secured, keys):
    pull = secured.ctx.socket(zmq.PULL)
    pull.linger = 0
    secured.sockets.append(pull)
    secured.guard.server(pull, ("trainer",))  # a worker's data socket
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    for name in ("clients/client", "allow/trainer"):
        push = secured.ctx.socket(zmq.PUSH)
        push.linger = 0
        secured.sockets.append(push)
        S.client(push, secured.guard.public, S.load_secret(keys / f"{name}.key_secret"))
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(PAYLOAD, zmq.NOBLOCK)
    assert pull.poll(2000) and pull.recv() == PAYLOAD  # the trainer's
    assert not pull.poll(300)  # never the client's
    assert wait_for(lambda: secured.guard.refused.get("role_client", 0) >= 1), secured.guard.refused
    with pytest.raises(ValueError, match="must be some of"):
        secured.guard.server(secured.ctx.socket(zmq.PULL), ("root",))


def test_a_key_has_one_role(keys, tmp_path):
    with pytest.raises(S.SecurityError, match="allowed as both trainer and client"):
        S.load_roles({"trainer": keys / "allow", "client": keys / "allow"})
    with pytest.raises(S.SecurityError, match="unknown role 'root'"):
        S.load_roles({"root": keys / "allow"})


def test_unknown_key_is_refused_and_counted(secured, keys):
    c = secured.client(S.load_secret(keys / "stranger.key_secret"))
    c.send(PAYLOAD)
    assert not secured.server.poll(300)
    assert wait_for(lambda: secured.guard.refused.get("unknown_key", 0) >= 1), secured.guard.refused
    assert secured.guard.accepted == 0


def test_plain_client_is_counted_as_a_failed_handshake(secured):
    c = secured.client()
    c.send(PAYLOAD)
    assert not secured.server.poll(300)
    assert wait_for(lambda: secured.guard.refused.get("handshake_mechanism", 0) >= 1), secured.guard.refused
    assert secured.guard.accepted == 0


def test_wrong_server_key_is_counted_as_a_failed_handshake(secured, keys):
    c = secured.client(
        S.load_secret(keys / "allow" / "trainer.key_secret"), server_public=S.load_public(keys / "stranger.key")
    )
    c.send(PAYLOAD)
    assert not secured.server.poll(300)
    assert wait_for(lambda: secured.guard.refused.get("handshake_crypto", 0) >= 1), secured.guard.refused
    assert secured.guard.accepted == 0


def test_a_stopped_guard_fails_closed(secured, keys):
    secured.guard.stop()
    c = secured.client(S.load_secret(keys / "stranger.key_secret"))
    c.send(PAYLOAD)
    assert not secured.server.poll(300), "with no ZAP handler the server admitted an unknown key"


class Tap:
    """A TCP relay to ``port`` that records every byte passing through it."""

    def __init__(self, port: int) -> None:
        self.target, self.seen, self.stop = port, bytearray(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pairs: dict[socket.socket, socket.socket] = {}
        while not self.stop.is_set():
            try:
                a, _ = self.listener.accept()
                b = socket.create_connection(("127.0.0.1", self.target), timeout=1)
                pairs.update({a: b, b: a})
            except TimeoutError:
                pass
            ready = select.select(list(pairs), [], [], 0.05)[0] if pairs else []
            for s in ready:
                data = s.recv(65536)
                if not data:
                    pairs.pop(pairs.pop(s)).close()
                    s.close()
                    continue
                self.seen += data
                pairs[s].sendall(data)
        for s in pairs:
            s.close()
        self.listener.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)


def test_traffic_is_encrypted_on_the_wire(secured, keys):
    def captured(server: zmq.Socket, port: int, keypair) -> bytes:
        tap = Tap(port)
        try:
            secured.client(keypair, port=tap.port).send(PAYLOAD * 4)
            assert server.poll(2000), "nothing came through the relay"
            assert server.recv_multipart()[1] == PAYLOAD * 4
        finally:
            tap.close()
        assert len(tap.seen) > len(PAYLOAD) * 4
        return bytes(tap.seen)

    plain = secured.ctx.socket(zmq.ROUTER)
    plain.linger = 0
    secured.sockets.append(plain)
    # the control: without CURVE the same tap sees the plaintext
    assert PAYLOAD in captured(plain, plain.bind_to_random_port("tcp://127.0.0.1"), None)
    keypair = S.load_secret(keys / "allow" / "trainer.key_secret")
    assert PAYLOAD not in captured(secured.server, secured.port, keypair)


def test_security_config_validation():
    with pytest.raises(ValueError, match="security.allow_workers, allow_trainers, allow_clients and allow_admins"):
        SecurityConfig(server_key="keys/server.key_secret")
    with pytest.raises(ValueError, match="security.server_public"):
        SecurityConfig(client_key="keys/me.key_secret")
    with pytest.raises(ValueError, match="security.allow_clients needs security.server_key"):
        SecurityConfig(allow_clients="keys/clients")
    with pytest.raises(UsageError, match="security.allow_workers"):
        parse(ClusterConfig, ["security.server_key=k.key_secret"])
    with pytest.raises(UsageError, match="unknown key 'security.allow'"):
        parse(ClusterConfig, ["security.allow=keys/clients"])
    with pytest.raises(UsageError, match="shadow cluster with security.server_key needs security.client_key"):
        parse(ClusterConfig, ["security.server_key=k.key_secret", "security.allow_workers=w"])
    both = ["security.server_key=k.key_secret", "security.allow_workers=w", "security.client_key=w/w.key_secret"]
    assert parse(ClusterConfig, both).security.allow() == {"worker": "w"}
    cfg = parse(StatusConfig, ["security.server_public=s.key", "security.client_key=c.key_secret"])
    assert cfg.security.enabled and not StatusConfig().security.enabled
    with pytest.raises(UsageError, match="security.data='aes' is not one of .*mac.*curve"):
        parse(ClusterConfig, ["security.data=aes"])
    assert parse(ClusterConfig, [*both, "security.data=curve"]).security.data_mode() == "curve"
    assert parse(ClusterConfig, both).security.data_mode() == "mac" and SecurityConfig().data_mode() == "plain"


def test_key_file_errors_say_what_to_do(keys, tmp_path):
    with pytest.raises(S.SecurityError, match="this is the public half; pass the .key_secret file"):
        S.load_secret(keys / "server.key")
    with pytest.raises(S.SecurityError, match=r"`shadow keygen dir=.* name=nope`"):
        S.load_secret(tmp_path / "nope.key_secret")
    (tmp_path / "garbled.key").write_text('public-key = "not a key"\n')
    with pytest.raises(S.SecurityError, match="garbled.key"):
        S.load_public(tmp_path / "garbled.key")
    (tmp_path / "empty").mkdir()
    with pytest.raises(S.SecurityError, match="no \\*.key files"):
        S.load_allow_list(tmp_path / "empty")
    assert S.load_allow_list(keys / "allow") == {S.load_public(keys / "allow" / "trainer.key")}


def test_client_keys_from_env(keys, monkeypatch):
    monkeypatch.delenv(S.ENV_SERVER_KEY, raising=False)
    monkeypatch.delenv(S.ENV_CLIENT_KEY, raising=False)
    assert S.client_from_env() is None
    monkeypatch.setenv(S.ENV_SERVER_KEY, str(keys / "server.key"))
    with pytest.raises(S.SecurityError, match=S.ENV_CLIENT_KEY):
        S.client_from_env()
    monkeypatch.setenv(S.ENV_CLIENT_KEY, str(keys / "allow" / "trainer.key_secret"))
    got = S.client_from_env()
    assert got.server_public == S.load_public(keys / "server.key")
    assert (got.public, got.secret) == S.load_secret(keys / "allow" / "trainer.key_secret")
