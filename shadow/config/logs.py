"""Log output for the shadow's processes: one line per event, as text or as JSON.

Library modules only log (``logging.getLogger(__name__)``); the CLI calls :func:`setup`
once per process. JSON lines carry ``time``, ``level``, ``logger``, ``pid``, ``role``,
``message`` and, for an exception, ``exc`` (the traceback as one string), so a log
shipper needs no multi-line parsing.
"""

from __future__ import annotations

import datetime
import json
import logging

from shadow.config.choices import LogFormat, LogLevel

TEXT = "%(asctime)s %(levelname)s %(name)s pid=%(process)d %(message)s"


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "role": self.role,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class OneLineFormatter(logging.Formatter):
    """Text with tracebacks folded onto the event's line (`` | `` between lines)."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")


def setup(level: str | LogLevel, fmt: str | LogFormat = LogFormat.text, role: str = "shadow") -> None:
    """Send every shadow log record to stderr in ``fmt`` (text or json), at ``level``."""
    level, fmt = LogLevel.parse(level, "log_level"), LogFormat.parse(fmt, "log_format")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(role) if fmt is LogFormat.json else OneLineFormatter(TEXT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.value))
