"""Errors the shadow service and its trainer hooks raise to callers."""
from __future__ import annotations


class ShadowError(RuntimeError):
    """Base class for errors from the shadow checkpoint service."""


class ShadowConnectionError(ShadowError, ConnectionError):
    """No coordinator answered, or it refused the request."""


class ShadowTimeoutError(ShadowError, TimeoutError):
    """The shadow did not keep up within the configured limit."""


class LayoutMismatchError(ShadowError, ValueError):
    """The model/optimizer does not match the checkpoint; nothing was changed."""
