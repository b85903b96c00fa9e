"""A PyTorch Lightning ``fit()`` as its documentation writes one, on CPU ranks launched with
torchrun's environment (``strategy="ddp"``), or by Lightning's own launcher
(``--own-launcher``: ``Trainer(devices=2)`` run as ``python lightning_trainer.py``, which
starts rank 1 from inside ``fit()``), optionally protected by the shadow
(:class:`trainer_hooks.integrations.lightning.ShadowCallback`).

    python tests/helpers/lightning_trainer.py --out DIR [--coordinator tcp://...] [--kill-at K] [--resume]

A module with dropout, AdamW (torch's default on CPU) and a per-step OneCycleLR from
``configure_optimizers``, ``gradient_clip_val``, ``accumulate_grad_batches=2``, bf16 autocast
(``precision="bf16-mixed"``), a shuffled
DataLoader (Lightning puts a DistributedSampler in), three epochs of 6 optimizer steps.
Saves each rank's final module, optimizer, scheduler, per-batch losses, RNG, epoch and the
callback's extra state after the resume to ``DIR/rank{r}.pt``.

``--kill-committed``: SIGKILL only once the cluster has committed step K itself (a crash
between that commit and the next one). ``--rank-seed``: each rank seeds torch's RNG with its
own seed in ``setup`` (the ranks' dropout masks and RNG states differ). ``--lightning-ckpt-at
K``: Lightning's own ``ModelCheckpoint`` saves at step K too, to ``DIR/lightning``.
``--resume-tmp``: the shadow writes the checkpoint to resume from to a temporary directory
(``$TMPDIR``) instead of ``DIR/resume``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--own-launcher" not in sys.argv:
    # torchrun's environment, as Lightning recognises it (a launcher of its own would start more ranks)
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("GROUP_RANK", "0")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from end import end_process_group, end_rank  # noqa: E402
from kill import kill_self  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

EPOCHS = 3


class Tiny(pl.LightningModule):
    def __init__(self, rank_seed: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 5))
        self.losses: dict[str, float] = {}
        self.rank_seed = rank_seed

    def setup(self, stage: str) -> None:
        if self.rank_seed:
            torch.manual_seed(1000 + self.global_rank)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses[f"{self.current_epoch}:{batch_idx}"] = loss.item()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=EPOCHS * 6 + 2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class KillAt(pl.Callback):
    def __init__(self, step: int, shadow, committed: bool = False) -> None:
        self.step, self.shadow, self.committed = step, shadow, committed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            session = self.shadow.session if self.shadow is not None else None
            if self.committed and session is not None:
                deadline = time.monotonic() + 120
                while session.committed < self.step and time.monotonic() < deadline:
                    time.sleep(0.01)
            kill_self(session, self.step)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--job", default="lightning")
    ap.add_argument("--kill-at", type=int, default=0, help="SIGKILL after this optimizer step")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill-committed", action="store_true", help="SIGKILL once step K itself is committed")
    ap.add_argument("--own-launcher", action="store_true", help="Lightning starts rank 1 (devices=2), no torchrun")
    ap.add_argument("--rank-seed", action="store_true", help="a torch seed of each rank's own")
    ap.add_argument("--lightning-ckpt-at", type=int, default=0, help="Lightning's own checkpoint of this step")
    ap.add_argument("--resume-tmp", action="store_true", help="resume from a checkpoint in a temporary directory")
    args = ap.parse_args()

    pl.seed_everything(5, workers=True)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 12, generator=g), torch.randint(0, 5, (96,), generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    module = Tiny(rank_seed=args.rank_seed)
    callbacks: list = []
    ckpt_path = None
    shadow = None
    trainer: pl.Trainer | None = None
    if args.coordinator:
        from trainer_hooks.integrations.lightning import ShadowCallback

        def extra() -> dict:  # each rank's own
            assert trainer is not None
            return {"rank": trainer.global_rank}

        shadow = ShadowCallback(args.coordinator, job=args.job, extra_state=extra)
        callbacks.append(shadow)
        if args.resume:
            ckpt_path = shadow.resume_checkpoint(None if args.resume_tmp else os.path.join(args.out, "resume"))
            assert ckpt_path is not None, "nothing to resume from"
    if args.kill_at:
        callbacks.append(KillAt(args.kill_at, shadow, args.kill_committed))
    if args.lightning_ckpt_at:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.join(args.out, "lightning"), every_n_train_steps=args.lightning_ckpt_at, save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2 if args.own_launcher else int(os.environ.get("WORLD_SIZE", "1")),
        max_epochs=EPOCHS,
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
        precision="bf16-mixed",  # bf16 autocast on the CPU
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.lightning_ckpt_at),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    os.makedirs(args.out, exist_ok=True)
    torch.save(
        {
            "model": module.state_dict(),
            "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "losses": module.losses,
            "rng": torch.get_rng_state(),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "extra": shadow.extra_state if shadow is not None else None,
        },
        os.path.join(args.out, f"rank{trainer.global_rank}.pt"),
    )
    end_process_group()  # Lightning's teardown leaves its process group up
    launcher = getattr(trainer.strategy, "launcher", None)
    failed = [p.wait() for p in getattr(launcher, "procs", [])]  # Lightning's launcher: the ranks it started
    if any(failed):
        print(f"ranks started by Lightning's launcher exited with {failed}", file=sys.stderr, flush=True)
        os._exit(4)
    end_rank()


if __name__ == "__main__":
    sys.exit(main())
