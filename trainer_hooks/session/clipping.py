"""torch's gradient-norm clipping, recorded wherever it is called from.

Frameworks clip through ``torch.nn.utils.clip_grad_norm_`` (accelerate's
``Accelerator.clip_grad_norm_``, the transformers ``Trainer``'s ``max_grad_norm``,
Lightning's ``gradient_clip_val``), often from a module that imported the function before
the shadow attached. They all end in ``torch.nn.utils.clip_grad._clip_grads_with_norm_``,
which ``clip_grad_norm_`` looks up in its module at every call; :func:`install` wraps it
there (and the public alias ``torch.nn.utils.clip_grads_with_norm_``) once. The wrapper
scales the gradients exactly as torch does, then tells every attached session whose
parameters it scaled the coefficient torch multiplied them by -- the same tensor
expression, never read on the host, so nothing waits for the device.

A session takes the coefficient when the call scaled every laid-out parameter that has a
gradient (``model.parameters()``, the optimizer's parameters, in any order). A call that
scaled only some of them, or a second clip in one iteration, cannot be replayed with one
factor: that iteration is refused (the next ``optimizer.step()`` raises
:class:`~shadow.core.errors.ShadowUsageError` saying so) rather than checkpointed wrong.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as _clip_grad

logger = logging.getLogger(__name__)

#: the attached sessions, told of every clip (a session registers at attach, leaves at detach)
SESSIONS: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_original: Any = None


def coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """The factor torch's ``_clip_grads_with_norm_`` multiplies the gradients by (its own
    expression, on the norm's device, not read here)."""
    return torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)


def _wrapped(original):
    @functools.wraps(original)
    def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        else:
            parameters = list(parameters)  # a generator would be used up by the original
        out = original(parameters, max_norm, total_norm, foreach)
        if SESSIONS and isinstance(total_norm, torch.Tensor):
            scaled = {id(p) for p in parameters if p.grad is not None}
            if scaled:
                with torch.no_grad():
                    coef = coefficient(max_norm, total_norm).to(torch.float32)
                for session in list(SESSIONS):
                    try:
                        session._clipped(scaled, coef)
                    except Exception:  # noqa: BLE001 - the shadow must never stop a clip
                        logger.exception("recording a clip coefficient failed")
        return out

    _clip_grads_with_norm_.__shadow_wrapped__ = original
    return _clip_grads_with_norm_


def install() -> None:
    """Wrap torch's ``_clip_grads_with_norm_`` (once per process; idempotent)."""
    global _original
    with _lock:
        current = _clip_grad._clip_grads_with_norm_
        if getattr(current, "__shadow_wrapped__", None) is not None:
            return
        _original = current
        wrapper = _wrapped(current)
        _clip_grad._clip_grads_with_norm_ = wrapper
        if getattr(torch.nn.utils, "clip_grads_with_norm_", None) is current:
            torch.nn.utils.clip_grads_with_norm_ = wrapper


def register(session: Any) -> None:
    install()
    SESSIONS.add(session)


def unregister(session: Any) -> None:
    SESSIONS.discard(session)
