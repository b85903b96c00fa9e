"""How a test rank ends once its state is saved: without the interpreter's teardown.

That teardown is not what these runs check, and torch's part of it has failed in CI in runs
without the shadow: a hang while rank 1 freed the DDP module and with it the gloo process group
(rank 0 had exited), and aborts ("terminate called without an active exception") of a
transformers Trainer rank whose process group was never destroyed and of an FSDP rank
spawned by torch.multiprocessing whose group was destroyed.

A rank spawned by ``torch.multiprocessing`` may end this way too: its exit code 0 is what
``mp.spawn`` waits for, and a failure still raises before it, with its traceback."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import NoReturn


def end_process_group() -> None:
    """Every rank done with every collective, then the default process group destroyed (when
    one is up)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def end_rank(grace: float = 60.0) -> NoReturn:
    """End this rank once its state is saved: every thread the run started must end within
    ``grace`` seconds (a thread left running by the shadow would keep a user's script alive, and
    fails the run here), then the process exits without the interpreter's teardown."""
    deadline = time.monotonic() + grace
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in others if t.is_alive()]
    sys.stdout.flush()
    sys.stderr.flush()
    if alive:
        print(f"threads still running {grace:.0f} s after the run ended: {alive}", file=sys.stderr, flush=True)
        os._exit(3)
    os._exit(0)
