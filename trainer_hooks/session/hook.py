"""One DDP communication hook per model, registered once (DDP takes one hook, for good).

The hook is a plain function; its state is the model's :class:`HookSlot`, which holds the
user's own hook (if any) and a weak reference to the current attachment's bucket handler. It reduces
the bucket exactly as DDP would (the user's hook, or DDP's built-in all-reduce: sum, divided
by the world size) and hands the result to the attachment. With no session attached it is
only that reduction, so a closed or dropped session leaves nothing behind: DDP does not
keep its staging ring alive."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

_SLOTS: weakref.WeakKeyDictionary[DistributedDataParallel, HookSlot] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class HookSlot:
    """The state of one DDP model's registered hook."""

    def __init__(self, model: DistributedDataParallel) -> None:
        self.pg = model.process_group
        self.world = dist.get_world_size(self.pg)
        self.comm_hook: Callable | None = None
        self.comm_state: Any = None
        self._route: weakref.WeakMethod | None = None

    @classmethod
    def of(cls, model: DistributedDataParallel) -> HookSlot:
        """The slot of ``model``, registering the hook on first use. DDP refuses a second
        hook: a model that already has one of the user's fails here, before any connection
        (pass the user's hook to ``attach(comm_hook=...)`` instead)."""
        with _lock:
            slot = _SLOTS.get(model)
            if slot is None:
                slot = cls(model)
                model.register_comm_hook(slot, shadow_hook)
                _SLOTS[model] = slot
            return slot

    def bind(self, route: Callable, comm_hook: Callable | None, comm_state: Any) -> None:
        """From now on ``route(fut, bucket)`` (a bound method, held weakly) takes every
        bucket's reduction future and returns the one DDP waits for."""
        self.comm_hook, self.comm_state = comm_hook, comm_state
        self._route = weakref.WeakMethod(route)

    def unbind(self, route: Callable) -> None:
        """``route``'s attachment is done: reduce only (the user's hook, if any, stays in use)."""
        if self.route == route:
            self._route = None

    @property
    def route(self) -> Callable | None:
        return self._route() if self._route is not None else None

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self.comm_hook is not None:
            # the user's hook (e.g. bf16 compression) reduces; the shadow takes what it
            # leaves in the bucket, which is what the optimizer will see
            return self.comm_hook(self.comm_state, bucket)
        buf = bucket.buffer()
        buf.mul_(1.0 / self.world)  # DDP's built-in allreduce divides the same way
        return dist.all_reduce(buf, group=self.pg, async_op=True).get_future().then(lambda f: f.value()[0])


def shadow_hook(slot, bucket):  # unannotated: DDP inspects hook annotations
    fut = slot.reduce(bucket)
    route = slot.route
    return fut if route is None else route(fut, bucket)
