"""The trainer side of an attached run, by part (see ``docs/architecture.md``):

* ``session``    -- :class:`Session`: the public handle (options, error latch, hooks);
* ``options``    -- :class:`AttachOptions`: every option of ``attach``, validated;
* ``wiring``, ``tally`` -- how a session hooks into the loop; its totals across attachments;
* ``attachment`` -- :class:`Attachment`: one epoch's running pipeline (ring, sender,
  bucket handler, the step's commits); it drives the recorder; ``parts`` builds its ring
  and sender, ``stager`` stages each step's buckets, ``throttle`` waits for the cut,
  ``extras`` sends the model state outside the optimizer;
* ``handshake``, ``target`` -- :class:`Handshake` (the coordinator's attach answer) and
  :class:`Target` (the model and optimizer as laid out): frozen, one per epoch;
* ``hook``       -- the one DDP comm hook per model, and the slot it reads;
* ``recorder``   -- :class:`StepRecorder`: per-step bookkeeping -> commit records (it
  returns them; it calls nothing back);
* ``recovery``   -- :class:`RecoveryController`: degraded mode, votes, joins (the sender's events);
* ``staging``, ``sender`` -- the staging ring and the sender thread;
* ``items``      -- what the session puts on the sender's queue, and :class:`SenderEvents`.

Names are imported on first use, so that a module of this package (``sender``) can be
imported on its own without the rest.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Session": "session",
    "AttachOptions": "options",
    "Attachment": "attachment",
    "Handshake": "handshake",
    "Target": "target",
    "StepRecorder": "recorder",
    "RecoveryController": "recovery",
    "ErrorLatch": "recovery",
    "SenderEvents": "items",
    "HookSlot": "hook",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
