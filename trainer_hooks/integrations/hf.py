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
  its epoch) with the model and optimizer, as it stands once the step is logged: its commit
  waits for the step's log entry (``on_log``) when the step logs, else for ``on_step_end``.
  ``log_history`` is kept whole up to ``log_entries`` entries (default 1000), then its newest
  ``log_entries``.
* :meth:`ShadowedTrainer.resume_checkpoint` asks the cluster for the newest checkpoint of the
  job and writes it as the Trainer's own checkpoint directory (the same as ``shadow restore
  format=hf_trainer``): weights, ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``
  (``log_history`` up to the checkpointed step's entry) and every rank's RNG.
  ``resume_from_checkpoint`` then does what the Trainer does with its own checkpoints: loads
  them, skips the batches the run consumed and sets each rank's RNGs after the first batches
  are fetched. Every process writes its own copy (in a directory of its own), so no directory
  has to be shared between hosts; a temporary one is removed once the Trainer has loaded it.

Limits: an evaluation's entry of the checkpointed step itself is not in ``log_history`` (the
commit does not wait for evaluations); with ``logging_steps`` > 1 the first entry after the
resume averages the loss over the steps since the resume (as after the Trainer's own
checkpoint); DeepSpeed and FSDP runs are not DDP and are refused.
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
from shadow.core.errors import ShadowError, ShadowUsageError
from shadow.export._writers import HF_KEY
from trainer_hooks.integrations._resume import Resumed, write_resume
from trainer_hooks.integrations.accelerate import inner_optimizer
from trainer_hooks.restorer.points import RESTORED

logger = logging.getLogger(__name__)

HOLD = "transformers"  # the name the commits wait under until the step is logged
LOG_ENTRIES = 1000  # the newest log_history entries each iteration keeps (default)


class ShadowedTrainer(TrainerCallback):
    """The callback :func:`protect` adds to a ``Trainer``. Its :attr:`session` is the
    rank's :class:`trainer_hooks.Session` once ``train()`` has begun. ``log_entries``: the
    newest ``log_history`` entries each iteration keeps (None: all)."""

    def __init__(
        self,
        trainer: Any,
        coordinator: str,
        *,
        job: str = "default",
        extra_state: Callable[[], Any] | None = None,
        log_entries: int | None = LOG_ENTRIES,
        **attach_kwargs: Any,
    ) -> None:
        bad = isinstance(log_entries, bool) or not isinstance(log_entries, int) or log_entries < 0
        if log_entries is not None and bad:
            raise ValueError(f"log_entries must be an integer >= 0 or None, got {log_entries!r}")
        self.trainer, self.coordinator, self.job = trainer, coordinator, job
        self.attach_kwargs = attach_kwargs
        self.log_entries = log_entries
        self.session: trainer_hooks.Session | None = None
        self._user_extra = extra_state
        self._state_json = ""  # the Trainer's state as the last logged (or completed) step left it
        self._dropped = 0  # log_history entries left out of _state_json (the oldest)
        self._dropped_before = 0  # ... of them, those the checkpoint resumed from had left out already
        self._holding = False  # the step's commit waits for its log entry
        self._shape = {"updates_per_epoch": 0, "steps_in_epoch": 0, "accumulation": 1}
        self._resumed: Resumed | None = None  # what resume_checkpoint wrote, for the attach

    # -- resume ----------------------------------------------------------------------------------------
    def resume_checkpoint(
        self, directory: str | None = None, *, timeout: float = 60.0, resize: bool = False
    ) -> str | None:
        """The newest checkpoint of the job, written as a Trainer checkpoint directory for
        ``resume_from_checkpoint`` (under ``directory``, default a new temporary directory of
        this rank's); None when the cluster knows no such job, in memory or in its tiers (a
        fresh run). A job it knows but cannot restore is an error, never a fresh start; a
        checkpoint taken with another number of ranks is refused on every rank unless
        ``resize=True`` (:func:`trainer_hooks.restore`). A temporary directory is removed once
        the Trainer has loaded the checkpoint (its first step, after the RNGs); one given as
        ``directory`` is kept."""
        written = write_resume(
            self.coordinator, self.job, timeout, directory, "hf_trainer", "checkpoint-{iteration}", resize
        )
        if written is None:
            return None
        self._resumed = written
        return written.path

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
        start = int(state.global_step)
        point = self._resumed.point(int(args.process_index)) if self._resumed is not None else None
        if point is not None and point.iteration == start:
            # the bootstrap of iteration `start` records its RNG and extra state as checkpointed: the
            # Trainer sets the RNGs only once it has fetched the resumed epoch's first batches
            RESTORED[optimizer] = point
            rec = point.extra_state.get(HF_KEY) if isinstance(point.extra_state, dict) else None
            self._dropped_before = int(rec.get("log_dropped", 0)) if isinstance(rec, dict) else 0
            if self._dropped_before:
                logger.warning(
                    "job %s resumed at step %d: log_history lacks its %d oldest entries (each iteration keeps the "
                    "newest %s: protect(..., log_entries=))",
                    self.job,
                    start,
                    self._dropped_before,
                    self.log_entries,
                )
        self._state_json = self._record(state)
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
        self.session.recorder.holds.add(HOLD)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._release()  # the step before logged nothing after all
        if self._resumed is not None:
            self._resumed.remove()  # the Trainer has loaded the checkpoint, its RNGs included
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self._state_json = self._record(state)  # the step's commit carries the state after it
        self._holding = True
        if not control.should_log:
            self._release()
        return control  # else it waits for the step's log entry (on_log)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._holding:
            self._state_json = self._record(state)
            self._release()
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        self._release()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._release()
        if self._resumed is not None:
            self._resumed.remove()
        if self.session is not None:
            try:
                self.session.close()
            except ShadowError as exc:  # never into the Trainer: the last iteration may be unprotected
                logger.error("closing the shadow session failed: %s", exc)
        return control

    def _release(self) -> None:
        """The pending commit may leave, with the state as recorded last."""
        if not self._holding:
            return
        self._holding = False
        if self.session is not None and not self.session.closed:
            self.session._release(HOLD, self._extra())

    def _record(self, state: Any) -> str:
        """``state`` as JSON, its ``log_history`` cut to the newest :attr:`log_entries`."""
        history = state.log_history
        keep = history if self.log_entries is None else history[max(0, len(history) - self.log_entries) :]
        self._dropped = self._dropped_before + len(history) - len(keep)
        state.log_history = []  # not copied whole by asdict: it grows with the run
        try:
            out = dataclasses.asdict(state)
        finally:
            state.log_history = history
        out["log_history"] = keep
        return json.dumps(out)

    def _extra(self) -> dict:
        out: dict = {HF_KEY: {"state": self._state_json, "log_dropped": self._dropped, **self._shape}}
        if self._user_extra is not None:
            out["user"] = self._user_extra()
        return out


def protect(
    trainer: Any, coordinator: str, *, job: str = "default", log_entries: int | None = LOG_ENTRIES, **attach_kwargs: Any
) -> ShadowedTrainer:
    """Attach ``trainer``'s training to the shadow cluster at ``coordinator`` when its
    ``train()`` begins (every rank calls this). ``log_entries``: the newest ``log_history``
    entries each iteration keeps (None: all). ``attach_kwargs``: the rest of
    :func:`trainer_hooks.attach`'s options (``policy``, ``audit_every``, ``exact``, ...)."""
    cb = ShadowedTrainer(trainer, coordinator, job=job, log_entries=log_entries, **attach_kwargs)
    trainer.add_callback(cb)
    return cb
