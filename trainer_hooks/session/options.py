"""Every option of :func:`trainer_hooks.attach` in one typed, validated record."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shadow.config.choices import Policy
from shadow.config.tuning import Tuning
from shadow.core.jobs import check_job_name
from trainer_hooks.session import observe

POLICIES = Policy.values()


@dataclass(frozen=True)
class AttachOptions:
    """What a session keeps from :func:`trainer_hooks.attach` (see its docstring for each
    field); validated at construction, so a wrong value fails before any connection."""

    scheduler: Any = None
    scaler: Any = None
    extra_state: Callable[[], Any] | None = None
    tokens: Callable[[], int] | None = None
    job: str = "default"
    policy: Policy | str = Policy.block  # a Policy or its name (a Policy once built)
    comm_hook: Callable | None = None
    comm_state: Any = None
    audit_every: int = 0
    audit_strict: bool = False
    exact: bool = True
    tuning: Tuning = field(default_factory=Tuning.load)

    def __post_init__(self) -> None:
        if not isinstance(self.tuning, Tuning):
            raise TypeError(
                f"tuning must be a shadow.config.tuning.Tuning (e.g. Tuning.load(block_timeout_s=30)), "
                f"got {type(self.tuning).__name__}"
            )
        check_job_name(self.job)  # it names a directory under every tier's root
        try:
            object.__setattr__(self, "policy", Policy.parse(self.policy, "policy"))
        except ValueError:
            raise ValueError(
                f"back-pressure policy {self.policy!r} is not supported; choose one of {POLICIES}"
            ) from None
        if self.extra_state is not None and not callable(self.extra_state):
            raise TypeError("extra_state must be a callable returning the state to save each iteration")
        if self.tokens is not None and not callable(self.tokens):
            raise TypeError("tokens must be a callable returning the number of tokens trained on so far")
        if self.comm_hook is not None and not callable(self.comm_hook):
            raise TypeError(
                "comm_hook must be a DDP communication hook, e.g. "
                "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook"
            )
        try:
            every = operator.index(self.audit_every)
        except TypeError:
            every = -1
        if every < 0 or isinstance(self.audit_every, bool):
            raise ValueError(f"audit_every={self.audit_every!r} must be an integer >= 0 (0 = no audit)")
        object.__setattr__(self, "audit_every", every)
        object.__setattr__(self, "audit_strict", bool(self.audit_strict))
        if not isinstance(self.exact, bool):
            raise TypeError(f"exact must be True or False, got {self.exact!r}")
        if self.scaler is not None and not hasattr(self.scaler, "unscale_"):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(self.scaler).__name__}")
        if self.scaler is not None and not _enabled(self.scaler):
            # GradScaler(enabled=False) (e.g. nanoGPT's, unless fp16) scales nothing and keeps no
            # state: the same as no scaler
            object.__setattr__(self, "scaler", None)
        observe.check_scheduler(self.scheduler)

    @property
    def observed(self) -> dict[str, Any]:
        """The scheduler and scaler the session watches, by name (those given)."""
        return {name: obj for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler)) if obj is not None}


def _enabled(scaler: Any) -> bool:
    """Whether ``scaler`` scales: ``GradScaler.is_enabled()`` (a scaler without it is taken
    as enabled)."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else bool(getattr(scaler, "_enabled", True))
