"""The one check that torch is importable, and the error that names the fix: a service
host may be installed without it (``pip install shadow-checkpoint`` has no torch)."""

from __future__ import annotations

from types import ModuleType

from shadow.core.errors import ShadowError

INSTALL_TRAINER = "pip install 'shadow-checkpoint[trainer]'"


class TorchMissingError(ShadowError, ImportError):
    """torch cannot be imported on this host (a service-only install); the message names
    the extra that brings it."""


def require_torch(what: str) -> ModuleType:
    """``torch``, imported; raises :class:`TorchMissingError` naming ``what`` needed it and
    how to install it, instead of an ``ImportError`` from deep inside a writer."""
    try:
        import torch
    except ImportError as exc:
        raise TorchMissingError(
            f"{what} needs PyTorch, which this host does not have ({exc}); install the trainer extra: {INSTALL_TRAINER}"
        ) from None
    return torch
