"""The shadow CLI: config validation, status, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shadow.cli._compose import UsageError, parse
from shadow.config import (
    ClusterConfig,
    ExportConfig,
    RestoreConfig,
    StatusConfig,
    VerifyConfig,
    WorkerConfig,
)
from shadow.testing import free_port
from tests.conftest import ROOT


def shadow(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shadow", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


@pytest.mark.parametrize(
    "cls,args,needle",
    [
        (ClusterConfig, ["workers=0"], "workers=0"),
        (ClusterConfig, ["port=abc"], "port"),
        (ClusterConfig, ["port=70000"], "port=70000"),
        (ClusterConfig, ["log_level=LOUD"], "log_level"),
        (StatusConfig, ["address=localhost:5555"], "address="),
        (StatusConfig, ["nope=1"], "nope"),
        (RestoreConfig, ["format=onnx"], "format='onnx'"),
        (RestoreConfig, ["out"], "key=value"),
        (ClusterConfig, ["workers=abc"], "workers='abc' is not allowed: workers takes an integer"),
        (ClusterConfig, ["+extra=1"], "unknown key 'extra'"),
        (ClusterConfig, ["persist.local.nope=1"], "unknown key 'persist.local.nope'"),
        (ClusterConfig, ["persist=3"], "persist is a section"),
        (
            ClusterConfig,
            ["persist.remote.compress=lz4"],
            "persist.remote.compress='lz4' is not one of ('none', 'zstd')",
        ),
        (ClusterConfig, ["persist.local.dir=/x", "persist.local.every_n=0"], "persist.local at '/x' has no schedule"),
        (ClusterConfig, ["metrics_port=65530", "workers=8"], "metrics_port=65530 leaves no port"),
        (ClusterConfig, ["log_format=xml"], "log_format='xml' is not one of"),
        (WorkerConfig, ["host="], "host= is empty"),
        (ExportConfig, ["dtype=int8"], "dtype='int8' is not one of ('float32', 'bfloat16', 'float16')"),
        (ExportConfig, ["format=dcp"], "shadow restore writes the whole training state"),
        (VerifyConfig, [], "source= is required"),
        (StatusConfig, ["timeout=0"], "timeout=0.0 must be positive"),
    ],
)
def test_config_errors_name_the_key(cls, args, needle):
    with pytest.raises(UsageError) as ei:
        parse(cls, args)
    assert needle in str(ei.value)


def test_config_overrides_are_typed():
    cfg = parse(ClusterConfig, ["workers=3", "port=6000", "threads_per_worker=2"])
    assert (cfg.workers, cfg.port, cfg.threads()) == (3, 6000, 2)


def test_every_command_has_help_with_an_example_and_its_keys():
    from shadow.cli.main import COMMANDS

    top = shadow("--help").stdout
    for name in COMMANDS:
        assert f"  {name} " in top
        res = shadow(name, "--help")
        assert res.returncode == 0, res.stderr
        assert f"shadow {name} " in res.stdout.split("examples:")[1]  # an example command line
        if name == "cluster":
            assert "persist.local.compress=none" in res.stdout and "metrics_port=0" in res.stdout


def test_cfg_job_prints_the_resolved_config(tmp_path):
    import yaml

    res = shadow("cluster", "workers=4", "persist.local.dir=/nvme/x", "--cfg", "job")
    assert res.returncode == 0, res.stderr
    cfg = yaml.safe_load(res.stdout)
    assert cfg["workers"] == 4 and cfg["persist"]["local"]["dir"] == "/nvme/x" and cfg["port"] == 5555
    res = shadow("status", "--json", "--cfg", "job")
    assert yaml.safe_load(res.stdout)["json"] is True
    res = shadow("cluster", "workers=0", "--cfg", "job")  # an invalid config is refused, not printed
    assert res.returncode == 2 and "workers=0" in res.stderr


def test_yaml_configs_compose_and_validate():
    """Every YAML in configs/ composes with its command's schema into a valid config."""
    import yaml

    from shadow.cli._compose import CONFIGS, compose, split

    found = 0
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        head = yaml.safe_load(path.read_text())
        schema = next((d for d in head.get("defaults", []) if isinstance(d, str) and d.startswith("shadow_")), None)
        if schema is None:
            continue  # not a CLI config (the example trainer's)
        command = schema[len("shadow_") :]
        cfg = compose(command, split(["--config-dir", str(ROOT / "configs"), "--config-name", path.stem]))
        assert isinstance(cfg, CONFIGS[command])
        found += 1
    assert found >= 3
    cfg = compose("cluster", split(["-cd", str(ROOT / "configs"), "-cn", "cluster", "persist=nvme", "workers=6"]))
    assert cfg.workers == 6 and cfg.persist.local.dir and cfg.persist.local.every_n > 0
    with pytest.raises(UsageError, match="needs a ClusterConfig"):
        compose("cluster", split(["-cd", str(ROOT / "configs"), "-cn", "worker"]))


def test_cli_usage_and_exit_codes():
    assert shadow("--help").returncode == 0
    res = shadow("cluster", "workers=0")
    assert res.returncode == 2 and "workers=0" in res.stderr
    res = shadow("frobnicate")
    assert res.returncode == 2 and "unknown command" in res.stderr
    assert "example" in shadow("status", "--help").stdout.lower() or "e.g." in shadow("status", "--help").stdout


def test_status_and_restore_against_nothing_fail_clearly():
    addr = f"tcp://127.0.0.1:{free_port()}"
    res = shadow("status", f"address={addr}", "timeout=1")
    assert res.returncode == 1 and "no shadow coordinator answered" in res.stderr
    res = shadow("restore", f"source={addr}", "timeout=1", "out=/tmp/never.pt")
    assert res.returncode == 1 and "no shadow coordinator answered" in res.stderr


@pytest.mark.slow
def test_status_reports_workers(cluster):
    res = shadow("status", f"address={cluster.address}", "json=true")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert len(st["workers"]) == 2 and all(w["health"] == "ok" for w in st["workers"]) and st["job"] is None
    res = shadow("status", f"address={cluster.address}")
    assert res.returncode == 0 and "no job attached" in res.stdout
    res = shadow("restore", f"source={cluster.address}", "out=/tmp/never.pt")
    assert res.returncode == 1 and "no checkpoint yet" in res.stderr


def test_example_trainer_config_composes_from_yaml():
    """examples/train_gpt.py reads configs/train_gpt.yaml through the same composition."""
    import yaml

    script = str(ROOT / "examples" / "train_gpt.py")
    res = subprocess.run(
        [sys.executable, script, "--config-name", "train_gpt", "model.n_layer=6", "--cfg", "job"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    cfg = yaml.safe_load(res.stdout)
    assert (
        cfg["model"]["n_layer"] == 6 and cfg["coordinator"] == "tcp://127.0.0.1:5555" and cfg["shadow"]["job"] == "gpt"
    )
    res = subprocess.run(
        [sys.executable, script, "shadow.policy=drop"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode != 0 and "shadow.policy='drop' is not one of" in res.stderr


def _squatter(replies: list[bytes]):
    """A ROUTER on a free loopback port that answers each request with the next of
    ``replies`` (what a process squatting a coordinator's port could send)."""
    import threading

    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        it = iter(replies)
        while not stop.is_set():
            if sock.poll(50):
                ident, _ = sock.recv_multipart()
                raw = next(it, None)
                if raw is not None:
                    sock.send_multipart([ident, raw])
        sock.close(linger=0)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"tcp://127.0.0.1:{port}", stop


def test_a_hostile_status_reply_is_a_clear_error_not_a_traceback_or_a_blowup():
    """Row 16 (issue 38): a 64 MiB ``status_reply`` from a port squatter cost ``shadow
    status`` 4.7 GB and 53 s, then a KeyError traceback. Its containers are capped while it
    decodes, and a status this build cannot read is said to be one. By default the squatter
    gets no word in at all: the client holds this user's key set and the squatter cannot
    complete a handshake as the server; a keyless client (``security.insecure=true``) still
    decodes what it is sent within bounds."""
    import msgpack

    from shadow.wire import messages as M

    bomb = msgpack.packb({"t": "status_reply", "v": M.VERSION, "status": {"w": [[{}] * 60 for _ in range(60_000)]}})
    assert len(bomb) < M.limits("status_reply").bytes
    odd = M.encode("status_reply", status={"workers": "none", "job": 3})
    address, stop = _squatter([bomb, odd])
    try:
        res = shadow("status", f"address={address}", "timeout=1")
        assert res.returncode == 1 and "no shadow coordinator answered" in res.stderr, res.stderr
        res = shadow("status", f"address={address}", "timeout=20", "security.insecure=true")
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert "max_containers" in res.stderr or "too_large" in res.stderr, res.stderr
        res = shadow("status", f"address={address}", "timeout=20", "security.insecure=true")
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert "answered a status this build cannot read" in res.stderr, res.stderr
    finally:
        stop.set()
