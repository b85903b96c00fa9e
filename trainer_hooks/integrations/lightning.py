"""The shadow in a PyTorch Lightning ``Trainer`` (``pip install "shadow-checkpoint[lightning]"``).

One callback and the ``ckpt_path`` Lightning already takes::

    shadow = ShadowCallback("tcp://10.0.0.5:5555", job="my-run")
    trainer = L.Trainer(strategy="ddp", callbacks=[shadow], gradient_clip_val=0.5, ...)
    trainer.fit(model, datamodule, ckpt_path=shadow.resume_checkpoint())   # None: a fresh run

* The callback attaches in ``on_train_start``: DDP and the optimizer exist only inside
  ``fit()``, and Lightning restores a ``ckpt_path``'s optimizer after ``on_fit_start``. It
  takes ``trainer.strategy.model`` (DDP), the optimizer, the scheduler of
  ``configure_optimizers`` and the precision plugin's GradScaler.
* ``gradient_clip_val`` keeps working: Lightning clips inside ``optimizer.step(closure)``
  with torch's ``clip_grad_norm_``, which the shadow records once the closure returns
  (``gradient_clip_algorithm="value"`` is refused at the next step, as any other change to
  the gradients is).
* Each iteration's commit waits for the end of the batch (``on_train_batch_end``, where
  Lightning's own checkpoints are taken) and carries the loops' state as it stands then
  (epoch, batch and optimizer counters, the scheduler's progress), the batches the epoch has
  yielded and the precision plugin's name.
* :meth:`ShadowCallback.resume_checkpoint` writes the cluster's newest checkpoint of the job
  as a Lightning checkpoint file (the same as ``shadow restore format=lightning``), one per
  process. Lightning restores the module, optimizer, scheduler, scaler and loops from it. The
  callback does the rest once ``fit()`` has set the process group up and the rank is known
  (Lightning's own launcher starts the other ranks inside ``fit()``, with no ``$RANK``):
  Lightning does not resume a plain DataLoader mid-epoch, so the train loader skips the
  batches the epoch had consumed, and it puts back the rank's own RNGs (Lightning saves none)
  once the resumed epoch's first batch is fetched. A checkpoint of an epoch's last batch
  resumes with the next epoch, whole (as Lightning's own checkpoint of that batch does), its
  RNGs put back before the epoch's iterator is built. A temporary directory the checkpoint was
  written to is removed once Lightning has loaded it.

Limits: one optimizer and at most one scheduler; one train loader; manual optimization is
not supported; a scheduler stepped per epoch leaves the checkpoint of an epoch's last batch
one scheduler step behind until the next iteration commits (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from torch.nn.parallel import DistributedDataParallel

import trainer_hooks
from shadow.core.errors import ShadowError, ShadowUsageError
from shadow.export._writers import LIGHTNING_KEY
from trainer_hooks.integrations._resume import Resumed, known_rank, write_resume
from trainer_hooks.restorer.points import RESTORED, RestorePoint
from trainer_hooks.restorer.restore import RestoreInfo

logger = logging.getLogger(__name__)

HOLD = "lightning"  # the name the commits wait under until the end of the batch


class _Positioned:
    """The train DataLoader; after a resume, its first epoch skips the batches the
    checkpoint had consumed (Lightning's counters go on from there, but it does not resume a
    plain DataLoader) and puts the RNGs back once the first remaining batch is fetched: the
    draws of building the iterator (its base seed) belong to the epoch's start, before the
    checkpoint. ``rng_first``: the checkpoint ended the epoch before, so the resumed epoch is
    a new one, whole, and its iterator draws after the checkpoint: the RNGs go back first.
    Everything else is the loader's (``sampler``, ``len``)."""

    def __init__(self, loader: Any, skip: int = 0, info: RestoreInfo | None = None, rng_first: bool = False) -> None:
        self._loader, self._skip, self._info, self._rng_first = loader, skip, info, rng_first

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        if self._rng_first:
            self._rng_first = False
            self.apply_rng()
        it = iter(self._loader)
        skip, self._skip = self._skip, 0
        for _ in range(skip):
            if next(it, _END) is _END:
                break
        for batch in it:
            self.apply_rng()
            yield batch
        self.apply_rng()  # the checkpoint was the epoch's last batch

    def apply_rng(self) -> None:
        info, self._info = self._info, None
        if info is not None and info.rng is not None:
            info.apply_rng()


_END = object()


def _user(point: RestorePoint) -> Any:
    """The loop's own extra state in a checkpoint's extra state (None: none was kept)."""
    extra = point.extra_state
    return extra.get("user") if isinstance(extra, dict) else None


class ShadowCallback(pl.Callback):
    """Protect a Lightning ``fit()`` with the shadow cluster at ``coordinator`` (add it to the
    ``Trainer``'s callbacks on every rank). ``extra_state``: the loop's own state to keep
    with each iteration (after a resume, :attr:`extra_state`); ``attach_kwargs``: the rest of
    :func:`trainer_hooks.attach`'s options."""

    def __init__(
        self,
        coordinator: str,
        *,
        job: str = "default",
        extra_state: Callable[[], Any] | None = None,
        **attach_kwargs: Any,
    ) -> None:
        self.coordinator, self.job, self.attach_kwargs = coordinator, job, attach_kwargs
        self.session: trainer_hooks.Session | None = None
        #: after a resume, what extra_state returned then on this rank: from resume_checkpoint on
        #: where the rank is known then ($RANK), else from the callback's setup in fit()
        self.extra_state: Any = None
        self._user_extra = extra_state
        self._trainer: pl.Trainer | None = None
        self._consumed = 0  # batches of the epoch in progress trained on (Lightning's next batch_idx)
        self._resumed: Resumed | None = None  # the checkpoint resume_checkpoint wrote
        self._point: RestorePoint | None = None  # this rank's part of it, once the rank is known

    # -- resume ----------------------------------------------------------------------------------------
    def resume_checkpoint(
        self, directory: str | None = None, *, timeout: float = 60.0, resize: bool = False
    ) -> str | None:
        """The newest checkpoint of the job as a Lightning checkpoint file for
        ``trainer.fit(..., ckpt_path=...)`` (under ``directory``, default a new temporary
        directory of this process's, removed once Lightning has loaded it); None when the
        cluster knows no such job (a fresh run). A job it knows but cannot restore is an
        error, never a fresh start.

        The file is the same for every rank. Each rank's own RNG and extra state are chosen
        inside ``fit()``, once the process group is up: Lightning's own launcher
        (``Trainer(devices=n)`` run as ``python train.py``) calls this before it has started
        the other ranks, and none of them has ``$RANK``."""
        written = write_resume(
            self.coordinator, self.job, timeout, directory, "lightning", "iteration-{iteration}.ckpt", resize
        )
        if written is None:
            return None
        self._resumed, self._point = written, None
        rank = known_rank()
        if rank is not None:
            self.extra_state = _user(written.point(rank))
        else:
            logger.info(
                "the rank of this process is not known yet (no $RANK, no process group): its extra state and RNG "
                "are chosen in fit(), once Lightning has set the process group up"
            )
        return written.path

    def _rank_point(self, trainer: pl.Trainer) -> RestorePoint | None:
        """This rank's part of the checkpoint resume_checkpoint wrote (None: nothing was)."""
        if self._resumed is not None and self._point is None:
            self._point = self._resumed.point(int(trainer.global_rank))
            self.extra_state = _user(self._point)
        return self._point

    def _remove_written(self) -> None:
        if self._resumed is not None:
            self._resumed.remove()

    # -- Lightning's events ----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._rank_point(trainer)  # the process group is up: the rank is known

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise ShadowUsageError(
                f"Lightning's model is a {type(model).__name__}, not DistributedDataParallel: the shadow takes the "
                'gradients DDP reduces; use strategy="ddp" on 2 or more processes'
            )
        if not pl_module.automatic_optimization:
            raise ShadowUsageError("the shadow supports Lightning's automatic optimization only")
        if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) > 1:
            raise ShadowUsageError(
                f"the shadow replays one optimizer and at most one scheduler; configure_optimizers returned "
                f"{len(trainer.optimizers)} optimizers and {len(trainer.lr_scheduler_configs)} schedulers"
            )
        loaders = trainer.fit_loop._combined_loader
        if loaders is None or len(loaders.flattened) != 1:
            raise ShadowUsageError("the shadow follows one train DataLoader")
        optimizer = trainer.optimizers[0]
        scheduler = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        skip, info, rng_first = 0, None, False
        start = int(trainer.global_step)
        point = self._rank_point(trainer)
        self._remove_written()  # Lightning has loaded the checkpoint (before this hook)
        if point is not None and point.iteration == start:
            rec = point.extra_state[LIGHTNING_KEY]
            if int(trainer.current_epoch) > int(rec["epoch"]):
                # the checkpoint was the epoch's last batch: Lightning goes on with the next epoch, whole (as
                # from its own checkpoint of that batch), and that epoch's iterator draws after the checkpoint
                rng_first = True
            else:
                skip = int(rec["batches"])
            RESTORED[optimizer] = point  # the bootstrap records the checkpoint's own RNG and extra state
            info = RestoreInfo(point.iteration, point.extra_state, point.job, point.source, point.tier, 0, point.rng)
        self._trainer, self._consumed = trainer, skip
        loaders.flattened = [_Positioned(loaders.flattened[0], skip, info, rng_first)]
        if info is not None and trainer.fit_loop._data_fetcher is not None:
            # Lightning built the resumed epoch's iterator before this hook (setup_data): build it again,
            # over the loader that skips what the checkpoint consumed
            iter(trainer.fit_loop._data_fetcher)
        self.session = trainer_hooks.attach(
            model,
            optimizer,
            self.coordinator,
            scheduler=scheduler,
            scaler=scaler,
            job=self.job,
            iteration=start,
            extra_state=self._extra,
            **self.attach_kwargs,
        )
        self.session.recorder.holds.add(HOLD)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._consumed = 0  # (not called for an epoch resumed in its middle)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._consumed = batch_idx + 1
        if self.session is not None and not self.session.closed:
            self.session._release(HOLD, self._extra())  # the commit leaves with the batch's state

    def on_train_end(self, trainer, pl_module) -> None:
        if self.session is not None:
            try:
                self.session.close()
            except ShadowError as exc:  # never into the Trainer: the last iteration may be unprotected
                logger.error("closing the shadow session failed: %s", exc)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_written()  # a fit() that ended before on_train_start (e.g. nothing left to train)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_written()

    def _extra(self) -> dict:
        trainer = self._trainer
        assert trainer is not None
        rec = {
            "loops": trainer._checkpoint_connector._get_loops_state_dict(),
            "epoch": int(trainer.current_epoch),
            "batches": self._consumed,
            "version": pl.__version__,
            "precision": type(trainer.precision_plugin).__qualname__,
        }
        out: dict = {LIGHTNING_KEY: rec}
        if self._user_extra is not None:
            out["user"] = self._user_extra()
        return out
