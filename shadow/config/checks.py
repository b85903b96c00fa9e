"""The checks config values share: ports, endpoints, timeouts, sources, log settings and a
cluster's shape; each raises a ``ValueError`` that names the key and what to use."""

from __future__ import annotations

from typing import Any

from shadow.config.choices import LogFormat, LogLevel


def check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise ValueError(f"port={port} is not a TCP port; use 1-65535")


def check_endpoint(key: str, value: str) -> None:
    if not value.startswith(("tcp://", "ipc://")):
        raise ValueError(f"{key}={value!r} is not a ZeroMQ endpoint; use e.g. tcp://127.0.0.1:5555")


def check_log(cfg: Any) -> None:
    cfg.log_level = LogLevel.parse(cfg.log_level, "log_level")
    cfg.log_format = LogFormat.parse(cfg.log_format, "log_format")


def check_metrics_port(port: int) -> None:
    if port:
        check_port(port)


def check_shape(workers: int, replicas: int) -> None:
    """A cluster of ``workers`` slots, each shard held by ``replicas`` of them, or a
    ``ValueError`` saying what to change."""
    if workers < 1:
        raise ValueError(f"workers={workers}: a cluster needs at least 1 worker")
    if replicas < 1 or workers % replicas:
        raise ValueError(
            f"replicas={replicas} must be >= 1 and divide workers={workers}; e.g. workers={2 * workers} replicas=2"
        )


def check_timeout(timeout: float) -> None:
    if timeout <= 0:
        raise ValueError(f"timeout={timeout} must be positive (seconds)")


def check_source(value: str) -> None:
    if not value:
        raise ValueError(
            "source= is required: a coordinator address (tcp://host:port), a checkpoint directory or an fsspec URL"
        )
