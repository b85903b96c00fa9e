"""The wire: data-plane frames and control-plane messages shared by trainer and service."""

from shadow.wire.frames import (
    HEADER_SIZE,
    RUN_SIZE,
    Field,
    FrameError,
    Header,
    Kind,
    checksum,
    unpack_header,
)
from shadow.wire.messages import MessageError, decode, encode

__all__ = [
    "HEADER_SIZE",
    "RUN_SIZE",
    "Field",
    "FrameError",
    "Header",
    "Kind",
    "MessageError",
    "checksum",
    "decode",
    "encode",
    "unpack_header",
]
