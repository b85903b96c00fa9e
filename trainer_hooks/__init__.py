"""Trainer side of the shadow checkpoint service: attach a DDP training run, restore it."""
from shadow.errors import (
    LayoutMismatchError,
    ShadowConnectionError,
    ShadowError,
    ShadowTimeoutError,
)
from trainer_hooks._export import export, export_weights
from trainer_hooks._metrics import serve_metrics
from trainer_hooks._optim import UnsupportedOptimizerError
from trainer_hooks._restore import RestoreInfo, apply_snapshot, restore, state_dicts
from trainer_hooks._session import Session


def attach(ddp_model, optimizer, coordinator: str, **kwargs) -> Session:
    """Stream every iteration of ``ddp_model``/``optimizer`` to the shadow cluster at
    ``coordinator``. Call on every rank, before the first backward. See :class:`Session`
    for the keyword arguments (``scheduler``, ``extra_state``, ``job``, ``iteration``,
    ``overwrite``, ``policy``)."""
    return Session(ddp_model, optimizer, coordinator, **kwargs)


__all__ = [
    "LayoutMismatchError", "RestoreInfo", "Session", "ShadowConnectionError", "ShadowError", "ShadowTimeoutError",
    "UnsupportedOptimizerError", "apply_snapshot", "attach", "export", "export_weights", "restore", "serve_metrics", "state_dicts",
]
