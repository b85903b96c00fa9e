"""The shadow around a Hugging Face ``Accelerator``'s prepared model, optimizer, scheduler and
training loader (``pip install "shadow-checkpoint[accelerate]"``).

accelerate's own loop stays as its documentation writes it (``accumulate``, ``backward``,
``clip_grad_norm_``, the prepared scheduler); the loader is iterated through
:meth:`ShadowedRun.batches`, which counts where the epoch is and, after a restore, goes on
from there::

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    run = ShadowedRun(accelerator, model, optimizer, loader, "tcp://10.0.0.5:5555",
                      scheduler=scheduler, job="my-run", resume=resuming)
    for epoch in range(run.epoch, num_epochs):
        for batch in run.batches(epoch):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    run.close()

What it takes off the user's hands:

* the unwrapping: the shadow attaches to the DDP model accelerate built, the torch optimizer
  inside ``AcceleratedOptimizer`` and the scheduler inside ``AcceleratedScheduler`` (which
  steps it once per process per optimizer step: the shadow is told so up front), with
  ``accelerator.scaler``;
* ``accelerator.clip_grad_norm_`` ends in torch's ``clip_grad_norm_``, which the shadow
  records; ``accumulate()`` reduces on the last micro-batch only, which the shadow follows;
* the loader's position: each checkpoint records the epoch, the batches the epoch has
  yielded and the state the loader's shuffling generator had when the epoch began (accelerate
  keeps one generator in step across processes). A resume sets the generator back, skips
  what was consumed (``accelerator.skip_first_batches``) and applies every RNG once the
  first batch is in hand, as it was at the checkpoint: building the loader's iterator draws
  from torch's global RNG, and so does the resumed loop's first fetch.

Limits: batches fetched in the main process must not draw from the global RNGs (random
augmentations belong in the dataset's workers or a seeded generator of their own); with
``num_workers > 0`` the workers' seeds are drawn anew by the resumed iterator; a
``DataLoaderDispatcher`` (``dispatch_batches=True``) and iterable datasets are resumed at
the epoch's position by skipping, which is only as exact as their own iteration order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from torch.nn.parallel import DistributedDataParallel

import trainer_hooks
from shadow.core.errors import ShadowUsageError
from trainer_hooks.restorer.restore import RestoreInfo

logger = logging.getLogger(__name__)

KEY = "accelerate"  # the extra state's entry the run keeps its position in


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (itself otherwise)."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _generator(loader: Any) -> torch.Generator | None:
    """The generator the loader shuffles with (accelerate's synchronised one), if any."""
    gen = getattr(loader, "synchronized_generator", None)
    if gen is None:
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None) or getattr(loader, "sampler", None)
        gen = getattr(sampler, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


_WORLD_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")  # torchrun, MPI launchers


def _launched_world() -> int | None:
    """How many processes this one was started among: the initialised process group's
    size, else what a launcher's environment says (torchrun's ``WORLD_SIZE``, MPI's); 0
    when a launcher's ``RANK``/``LOCAL_RANK`` is there without a size; None when this
    process was started on its own."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    for var in _WORLD_VARS:
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return 0 if "RANK" in os.environ or "LOCAL_RANK" in os.environ else None


def _not_ddp(accelerator: Any, model: Any) -> str:
    """Why a model accelerate prepared that is not DDP cannot be shadowed, and what to do:
    on a host without a GPU, accelerate joins the processes a launcher started only when
    told to use the CPU (``Accelerator(cpu=True)``); without it each of them trains alone,
    its model not wrapped, although torchrun (or ``accelerate launch``) already started
    them and even initialised the process group."""
    head = (
        f"the model accelerate prepared is a {type(model).__name__}, not DistributedDataParallel: the shadow "
        "takes the gradients DDP reduces"
    )
    world = _launched_world()
    processes = int(getattr(accelerator, "num_processes", 1) or 1)
    kind = str(getattr(accelerator, "distributed_type", "unknown")).rsplit(".", 1)[-1]
    if processes > 1:
        return (
            f"{head}; accelerate runs these {processes} processes as {kind}, which ShadowedRun does not take: "
            "prepare the model with accelerate's plain data parallelism (no FSDP, DeepSpeed or Megatron-LM plugin)"
        )
    if world is None:
        return f"{head}, so run accelerate with 2 or more processes (accelerate launch --num_processes 2, or torchrun)"
    if world == 1:
        return (
            f"{head}, and the launcher started this process alone (world size 1): start 2 or more "
            "(torchrun --nproc-per-node 2, or accelerate launch --num_processes 2)"
        )
    among = f"among {world} processes" if world > 1 else "by a launcher"
    device = getattr(accelerator, "device", None)
    if getattr(device, "type", "cpu") == "cpu" and not torch.cuda.is_available():
        return (
            f"{head}. This process was started {among} (torchrun or accelerate launch), but accelerate runs it "
            f"as a single process (distributed_type {kind}): on a host without a GPU, accelerate joins them only "
            "when told to use the CPU: Accelerator(cpu=True) (or ACCELERATE_USE_CPU=1 in the environment, or "
            "accelerate launch --cpu)"
        )
    return (
        f"{head}. This process was started {among}, but accelerate runs it as a single process "
        f"(distributed_type {kind}, device {device}): check the launch against accelerate's configuration "
        "(`accelerate env`)"
    )


class ShadowedRun:
    """An accelerate training run attached to the shadow cluster at ``coordinator``.

    Args:
        accelerator: the ``Accelerator`` (a multi-process run: ``accelerate launch`` or
            ``torchrun``, so that the model is DDP; on a host without a GPU, made with
            ``cpu=True``, without which accelerate runs each process alone).
        model, optimizer, dataloader: as ``accelerator.prepare`` returned them.
        coordinator: the cluster's address, ``tcp://host:port``.
        scheduler: the prepared scheduler, if any.
        job: the job's name in the cluster.
        resume: put model, optimizer, scheduler, scaler, RNGs and the loader's position back
            at the cluster's newest checkpoint of ``job`` first (:attr:`epoch` is then the
            epoch to go on with, and :meth:`batches` skips what it had consumed).
            ``"auto"``: when the cluster holds a checkpoint of ``job``, else start fresh
            (one command line for the first launch and every relaunch); ``True``: always.
        resize: with ``resume``: restore a checkpoint taken with another number of ranks
            anyway (:func:`trainer_hooks.restore`); otherwise it is refused on every rank.
        extra_state: the loop's own state to keep with each iteration (as
            :func:`trainer_hooks.attach`'s); after a resume, :attr:`extra_state` holds it.
        **attach_kwargs: the rest of :func:`trainer_hooks.attach`'s options (``policy``,
            ``audit_every``, ``exact``, ``tuning``, ...).
    """

    def __init__(
        self,
        accelerator: Any,
        model: Any,
        optimizer: Any,
        dataloader: Any,
        coordinator: str,
        *,
        scheduler: Any = None,
        job: str = "default",
        resume: bool | str = False,
        resize: bool = False,
        extra_state: Callable[[], Any] | None = None,
        **attach_kwargs: Any,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise ShadowUsageError(_not_ddp(accelerator, model))
        self.accelerator, self.model, self.loader = accelerator, model, dataloader
        self.optimizer = inner_optimizer(optimizer)
        self.scheduler = scheduler.scheduler if isinstance(scheduler, AcceleratedScheduler) else scheduler
        self.generator = _generator(dataloader)
        self.epoch = 0  #: the epoch in progress (after a resume: the one to go on with)
        self.batches_done = 0  #: batches the epoch in progress has yielded (skipped ones included)
        self.extra_state: Any = None  #: after a resume: what ``extra_state`` returned at that iteration
        self._user_extra = extra_state
        self._epoch_start: torch.Tensor | None = None  # the generator's state as the epoch began
        self._resume: tuple[dict, RestoreInfo] | None = None
        if resume not in (False, True, "auto"):
            raise ValueError(f"resume={resume!r}: use 'auto' (restore when the cluster holds the job), True or False")
        restore_from = trainer_hooks.resume if resume == "auto" else trainer_hooks.restore
        info = (
            restore_from(
                model,
                self.optimizer,
                coordinator,
                scheduler=self.scheduler,
                scaler=accelerator.scaler,
                job=job,
                defer_rng=True,
                resize=resize,
            )
            if resume
            else None
        )
        if info is not None:
            pos = info.extra_state.get(KEY) if isinstance(info.extra_state, dict) else None
            if not isinstance(pos, dict):
                raise ShadowUsageError(
                    f"iteration {info.iteration} of job {job!r} was not checkpointed by a ShadowedRun (its extra "
                    "state holds no loader position); restore it with trainer_hooks.restore"
                )
            self.epoch, self.batches_done, self._epoch_start = pos["epoch"], pos["batches"], pos["generator"]
            self.extra_state = info.extra_state.get("user")
            self._resume = (pos, info)
            logger.info(
                "resuming job %s at iteration %d: epoch %d after %d batches",
                job,
                info.iteration,
                pos["epoch"],
                pos["batches"],
            )
        self.session = trainer_hooks.attach(
            model,
            self.optimizer,
            coordinator,
            scheduler=self.scheduler,
            scaler=accelerator.scaler,
            job=job,
            extra_state=self._extra,
            **attach_kwargs,
        )
        if self.scheduler is not None:
            # accelerate steps the scheduler it wraps once per process per optimizer step (unless
            # batches are split, or it is not tied to the optimizer): the commit waits for all of them
            wrapper = scheduler if isinstance(scheduler, AcceleratedScheduler) else None
            steps = 1
            if wrapper is not None and not wrapper.step_with_optimizer:
                steps = accelerator.gradient_accumulation_steps
            elif wrapper is not None and not wrapper.split_batches:
                steps = accelerator.num_processes
            self.session.recorder.cadence = steps

    def _extra(self) -> dict:
        pos = {"epoch": self.epoch, "batches": self.batches_done, "generator": self._epoch_start}
        out: dict = {KEY: pos}
        if self._user_extra is not None:
            out["user"] = self._user_extra()
        return out

    def batches(self, epoch: int) -> Iterator[Any]:
        """The batches of ``epoch`` (iterate this instead of the loader): after a resume, the
        resumed epoch's from where its checkpoint left it."""
        resume, self._resume = self._resume, None
        if resume is not None and resume[0]["epoch"] != epoch:
            self._resume = resume
            raise ShadowUsageError(
                f"the run resumed in epoch {resume[0]['epoch']}; iterate run.batches({resume[0]['epoch']}) first "
                "(for epoch in range(run.epoch, num_epochs))"
            )
        self.epoch, self.batches_done = epoch, 0
        loader = self.loader
        if resume is not None:
            pos, info = resume
            if self.generator is not None and pos["generator"] is not None:
                self.generator.set_state(pos["generator"])  # the state the epoch's shuffle began from
            if pos["batches"]:
                loader = self.accelerator.skip_first_batches(self.loader, pos["batches"])
            self.batches_done = pos["batches"]
        if self.generator is not None:
            self._epoch_start = self.generator.get_state()
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)  # accelerate's own count would restart at 0 in a resumed process
        pending = resume[1] if resume is not None else None
        for batch in loader:
            if pending is not None:  # the iterator is built and the batch fetched: the RNGs as checkpointed
                pending.apply_rng()
                pending = None
            self.batches_done += 1
            yield batch
        if pending is not None:  # the checkpoint was the epoch's last batch
            pending.apply_rng()

    def close(self) -> int:
        """Wait for the cluster to hold the last iteration, detach; the newest committed iteration."""
        return self.session.close()
