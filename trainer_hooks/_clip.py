"""Gradient clipping the shadow can replay: torch's clip, with the coefficient recorded
in the iteration's commit record."""
from __future__ import annotations

import torch


class ClipMixin:
    """Session method :meth:`clip_grad_norm_`."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None, parameters=None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` with the clip coefficient recorded so the
        shadow applies the same scaling.

        ``parameters`` defaults to ``model.parameters()`` -- the order matters, since the
        total norm is summed in it; pass what you would pass to torch's function.
        """
        params = list(self.model.parameters() if parameters is None else parameters)
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        self._clip = float(coef.to(torch.float32).item())
        return total
