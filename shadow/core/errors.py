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


class ShadowUsageError(ShadowError):
    """The training loop did something the shadow cannot checkpoint (the fix is in the
    loop, e.g. accumulate with ``no_sync``); raised at the next ``optimizer.step()``."""


class CheckpointError(ShadowError):
    """A checkpoint on storage is missing, torn or corrupt."""
