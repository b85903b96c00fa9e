"""Trainer side of the shadow checkpoint service: attach a DDP training run, restore it."""
from shadow.errors import (
    LayoutMismatchError,
    ShadowConnectionError,
    ShadowError,
    ShadowTimeoutError,
    ShadowUsageError,
)
from trainer_hooks._export import export, export_weights
from trainer_hooks._metrics import serve_metrics
from trainer_hooks._optim import UnsupportedOptimizerError
from trainer_hooks._restore import RestoreInfo, apply_snapshot, restore, state_dicts
from trainer_hooks._session import Session


def attach(ddp_model, optimizer, coordinator: str, **kwargs) -> Session:
    """Stream every iteration of ``ddp_model``/``optimizer`` to the shadow cluster at
    ``coordinator``. Call on every rank, before the first backward; returns the rank's
    :class:`Session`.

    Keyword arguments:

    * ``scheduler``: an LR scheduler (any ``torch.optim.lr_scheduler``); its state is
      checkpointed with every iteration and restored with the model.
    * ``scaler``: a ``torch.amp.GradScaler``; unscale factors and skipped steps are replayed.
    * ``extra_state``: a callable returning this rank's state to keep with each iteration
      (data-loader position, tokens seen); returned by :func:`restore` as ``extra_state``.
    * ``tokens``: a callable returning tokens trained so far (for ``every_tokens`` tiers).
    * ``job``: the job's name in the cluster (default ``"default"``).
    * ``iteration``: the iteration the model is at (default: 0, or what :func:`restore`
      put back); ``overwrite=True`` replaces a job of the same name at another iteration.
    * ``policy``: back-pressure, ``"block"`` (every iteration checkpointed; training waits
      for a slow shadow, the wait is in :meth:`Session.stats`) or ``"skip"`` (never waits;
      the shadow resyncs after falling behind).
    * ``comm_hook``/``comm_state``: a DDP communication hook to compose with the shadow's
      (e.g. ``fp16_compress_hook``).
    * ``audit_every``/``audit_strict``: every N steps compare a sample of parameters and
      moments with the shadow bit for bit; ``audit_strict`` raises on a mismatch.

    A failure of the shadow (a lost worker or coordinator, an error it reports, a stall
    past ``SHADOW_BLOCK_TIMEOUT_S``) never stops training: the rank trains on unprotected
    until the cluster resyncs, and counts it in ``session.stats()["shadow_errors"]``. Only
    what the training loop got wrong (:class:`ShadowUsageError`, e.g. a bucket reduced
    twice without ``no_sync``) or asked for (``audit_strict``) is raised, at the next
    ``optimizer.step()``, never from inside DDP.
    """
    return Session(ddp_model, optimizer, coordinator, **kwargs)


__all__ = [
    "LayoutMismatchError", "RestoreInfo", "Session", "ShadowConnectionError", "ShadowError", "ShadowTimeoutError",
    "ShadowUsageError", "UnsupportedOptimizerError", "apply_snapshot", "attach", "export", "export_weights", "restore", "serve_metrics", "state_dicts",
]
