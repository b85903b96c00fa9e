"""How a session is hooked into the training loop: the models it can hook (DDP or FSDP2),
and, for one attachment, what is installed and removed together: the optimizer's step
pre- and post-hooks, the model's forward pre-hook, the observed scheduler and GradScaler
(:mod:`trainer_hooks.session.observe`), the DDP hook slot's route to the attachment's
bucket handler (:mod:`trainer_hooks.session.hook`) and torch's clip
(:mod:`trainer_hooks.session.clipping`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from trainer_hooks.capture import fsdp as _fsdp
from trainer_hooks.session import clipping, observe
from trainer_hooks.session.attachment import Attachment
from trainer_hooks.session.hook import HookSlot
from trainer_hooks.session.options import AttachOptions


def check(model: Any, options: Any) -> None:
    """``model`` is one a session can hook into (DDP-wrapped, or FSDP2) and ``options`` are
    an :class:`AttachOptions` that fit it (a DDP comm hook only for a DDP model)."""
    if not isinstance(model, DistributedDataParallel) and not _fsdp.is_sharded_model(model):
        import torch.distributed as dist

        if not isinstance(model, torch.nn.Module) or not dist.is_initialized() or dist.get_world_size() < 2:
            raise TypeError(
                "attach() takes the DistributedDataParallel-wrapped model (the shadow streams DDP's "
                "reduced gradient buckets), a model of DTensors (FSDP2's fully_shard applied to its root, "
                "tensor parallel's parallelize_module, or both) or a pipeline stage's module; got "
                f"{type(model).__name__}"
            )
    if isinstance(model, DistributedDataParallel) and _fsdp.is_sharded(list(model.parameters())):
        raise TypeError(
            "attach() got DistributedDataParallel over DTensor parameters; shard the data-parallel "
            "dimension with FSDP2 instead (fully_shard(model, mesh=mesh['dp']) over the tensor-parallel model), "
            "as torchtitan does"
        )
    if not isinstance(options, AttachOptions):
        raise TypeError(f"options must be an AttachOptions, got {type(options).__name__}")
    if options.comm_hook is not None and not isinstance(model, DistributedDataParallel):
        raise TypeError(
            "comm_hook= is a DDP communication hook; an FSDP2 model reduces with its own collectives "
            "(set its mixed precision with fully_shard(mp_policy=...)): leave comm_hook unset"
        )


def slot_of(model: torch.nn.Module) -> HookSlot | None:
    """A DDP model's hook slot (one per model, kept across sessions); None for FSDP2, whose
    gradients are staged at the step instead."""
    return HookSlot.of(model) if isinstance(model, DistributedDataParallel) else None


@dataclass
class Wiring:
    """What one attachment is hooked into; :meth:`remove` takes all of it out (a second call does nothing)."""

    handles: list[Any]  # torch's hook handles (optimizer, model)
    watched: list[tuple[Any, type]] = field(default_factory=list)  # (observed object, its own class)
    slot: HookSlot | None = None  # DDP: the model's hook slot, routed to ``route``
    route: Callable | None = None
    clip_owner: Any = None  # told of torch's clips (its ``_clipped``)

    def remove(self) -> None:
        """Unhook: the hooks go, the observed objects get their own class back, the slot goes
        back to reducing only, and clips are no longer reported."""
        handles, watched, slot, route, owner = self.handles, self.watched, self.slot, self.route, self.clip_owner
        self.handles, self.watched, self.slot, self.route, self.clip_owner = [], [], None, None, None
        for h in handles:
            h.remove()
        for obj, cls in watched:
            observe.unwatch(obj, cls)
        if slot is not None and route is not None:
            slot.unbind(route)
        if owner is not None:
            clipping.unregister(owner)


def install(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    options: AttachOptions,
    slot: HookSlot | None,
    att: Attachment,
    *,
    pre_step: Callable,
    post_step: Callable,
    before_forward: Callable[[], None],
    clip_owner: Any,
) -> Wiring:
    """Hook the loop to ``att``: ``pre_step`` and ``post_step`` as the optimizer's step
    hooks, ``before_forward`` first among the model's forward pre-hooks, the observed
    scheduler and scaler reporting to ``att``, DDP's ``slot`` routed to its bucket handler,
    and ``clip_owner`` told of torch's clips."""
    handles = [
        optimizer.register_step_pre_hook(pre_step),
        optimizer.register_step_post_hook(post_step),
        # the commit of iteration k leaves once the scheduler has stepped; if it steps at
        # another cadence, at the latest when the next forward (or step, or close) begins.
        # The forward also fences the bucket copies: the next backward rewrites the buckets
        # first among the forward's hooks: FSDP2's own unshards the parameters
        model.register_forward_pre_hook(lambda *_: before_forward(), prepend=True),
    ]
    wiring = Wiring(handles, [(obj, observe.watch(obj, att)) for obj in options.observed.values()])
    if slot is not None:
        slot.bind(att.on_bucket, options.comm_hook, options.comm_state)
        wiring.slot, wiring.route = slot, att.on_bucket
    clipping.register(clip_owner)
    wiring.clip_owner = clip_owner
    return wiring
