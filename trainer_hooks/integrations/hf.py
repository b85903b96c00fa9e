"""The shadow in a transformers ``Trainer`` (``pip install "shadow-checkpoint[hf]"``).

Two lines around the Trainer's own ``train()``; nothing else of the script changes::

    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    run = protect(trainer, "tcp://10.0.0.5:5555", job="my-run")           # the shadow attaches in train()
    trainer.train(resume_from_checkpoint=run.resume_checkpoint())        # None: a fresh run

* :func:`protect` adds a ``TrainerCallback`` that attaches when ``train()`` has built DDP, the
  optimizer and the scheduler (``on_train_begin``): the DDP model (``trainer.model_wrapped``,
  which callbacks are not given), the torch optimizer inside accelerate's wrapper, the
  Trainer's scheduler and accelerate's GradScaler. The Trainer clips through
  ``accelerator.clip_grad_norm_``, which ends in torch's ``clip_grad_norm_``: recorded and
  replayed (``max_grad_norm`` keeps working); with ``max_grad_norm=0`` its norm-only call is a
  clip by 1.0, replayed as such.
* Each iteration records the Trainer's state (``TrainerState``, and what places the step in
  its epoch) with the model and optimizer.
* :meth:`ShadowedTrainer.resume_checkpoint` asks the cluster for the newest checkpoint of the
  job and writes it as the Trainer's own checkpoint directory (the same as ``shadow restore
  format=hf_trainer``): weights, ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``
  and every rank's RNG. ``resume_from_checkpoint`` then does what the Trainer does with its
  own checkpoints: loads them, skips the batches the run consumed and sets each rank's RNGs
  after the first batches are fetched. Every rank writes its own copy (in a directory of its
  own), so no directory has to be shared between hosts.

Limits: the log entry of the checkpointed step itself is not in ``trainer_state.json``'s
``log_history`` (it is logged after the step is recorded); DeepSpeed and FSDP runs are not
DDP and are refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

import trainer_hooks
from shadow.errors import ShadowError, ShadowUsageError
from shadow.export._writers import HF_KEY
from trainer_hooks._restored import RESTORED, RestorePoint
from trainer_hooks.integrations._resume import write_resume
from trainer_hooks.integrations.accelerate import inner_optimizer

logger = logging.getLogger(__name__)


class ShadowedTrainer(TrainerCallback):
    """The callback :func:`protect` adds to a ``Trainer``. Its :attr:`session` is the
    rank's :class:`trainer_hooks.Session` once ``train()`` has begun."""

    def __init__(
        self,
        trainer: Any,
        coordinator: str,
        *,
        job: str = "default",
        extra_state: Callable[[], Any] | None = None,
        **attach_kwargs: Any,
    ) -> None:
        self.trainer, self.coordinator, self.job = trainer, coordinator, job
        self.attach_kwargs = attach_kwargs
        self.session: trainer_hooks.Session | None = None
        self._user_extra = extra_state
        self._state_json = ""  # the Trainer's state as the last completed step left it
        self._shape = {"updates_per_epoch": 0, "steps_in_epoch": 0, "accumulation": 1}
        self._resumed: RestorePoint | None = None  # what resume_checkpoint wrote, for the attach

    # -- resume ----------------------------------------------------------------------------------------
    def resume_checkpoint(
        self, directory: str | None = None, *, timeout: float = 60.0, resize: bool = False
    ) -> str | None:
        """The newest checkpoint of the job, written as a Trainer checkpoint directory for
        ``resume_from_checkpoint`` (under ``directory``, default a new temporary directory of
        this rank's); None when the cluster knows no such job, in memory or in its tiers (a
        fresh run). A job it knows but cannot restore is an error, never a fresh start; a
        checkpoint taken with another number of ranks is refused on every rank unless
        ``resize=True`` (:func:`trainer_hooks.restore`)."""
        written = write_resume(
            self.coordinator, self.job, timeout, directory, "hf_trainer", "checkpoint-{iteration}", resize
        )
        if written is None:
            return None
        out, self._resumed = written
        return out

    # -- the Trainer's events --------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        t = self.trainer
        model = t.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            raise ShadowUsageError(
                f"the Trainer's model is a {type(model).__name__}, not DistributedDataParallel: the shadow takes the "
                "gradients DDP reduces; launch the Trainer on 2 or more processes (torchrun, accelerate launch) "
                "without DeepSpeed or FSDP"
            )
        optimizer = inner_optimizer(t.optimizer)
        loader = kwargs.get("train_dataloader")
        steps = len(loader) if loader is not None and hasattr(loader, "__len__") else 0
        accum = max(1, int(args.gradient_accumulation_steps))
        self._shape = {
            "updates_per_epoch": max(steps // accum + int(steps % accum > 0), 1) if steps else 0,
            "steps_in_epoch": steps,
            "accumulation": accum,
        }
        self._state_json = json.dumps(dataclasses.asdict(state))
        start = int(state.global_step)
        if self._resumed is not None and self._resumed.iteration == start:
            # the bootstrap of iteration `start` records its RNG and extra state as checkpointed: the
            # Trainer sets the RNGs only once it has fetched the resumed epoch's first batches
            RESTORED[optimizer] = self._resumed
        self.session = trainer_hooks.attach(
            model,
            optimizer,
            self.coordinator,
            scheduler=t.lr_scheduler,
            scaler=t.accelerator.scaler,
            job=self.job,
            iteration=start,
            extra_state=self._extra,
            **self.attach_kwargs,
        )
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self._state_json = json.dumps(dataclasses.asdict(state))  # what the next step's record carries
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.session is not None:
            try:
                self.session.close()
            except ShadowError as exc:  # never into the Trainer: the last iteration may be unprotected
                logger.error("closing the shadow session failed: %s", exc)
        return control

    def _extra(self) -> dict:
        out: dict = {HF_KEY: {"state": self._state_json, **self._shape}}
        if self._user_extra is not None:
            out["user"] = self._user_extra()
        return out


def protect(trainer: Any, coordinator: str, *, job: str = "default", **attach_kwargs: Any) -> ShadowedTrainer:
    """Attach ``trainer``'s training to the shadow cluster at ``coordinator`` when its
    ``train()`` begins (every rank calls this). ``attach_kwargs``: the rest of
    :func:`trainer_hooks.attach`'s options (``policy``, ``audit_every``, ``exact``, ...)."""
    cb = ShadowedTrainer(trainer, coordinator, job=job, **attach_kwargs)
    trainer.add_callback(cb)
    return cb
