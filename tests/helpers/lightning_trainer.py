"""A PyTorch Lightning ``fit()`` as its documentation writes one, on CPU ranks launched with
torchrun's environment (``strategy="ddp"``), optionally protected by the shadow
(:class:`trainer_hooks.integrations.lightning.ShadowCallback`).

    python tests/helpers/lightning_trainer.py --out DIR [--coordinator tcp://...] [--kill-at K] [--resume]

A module with dropout, AdamW (torch's default on CPU) and a per-step OneCycleLR from
``configure_optimizers``, ``gradient_clip_val``, ``accumulate_grad_batches=2``, bf16 autocast
(``precision="bf16-mixed"``), a shuffled
DataLoader (Lightning puts a DistributedSampler in), three epochs. Saves each rank's final
module, optimizer, scheduler, per-batch losses and RNG to ``DIR/rank{r}.pt``.
"""

from __future__ import annotations

import argparse
import os
import sys

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
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 5))
        self.losses: dict[str, float] = {}

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
    def __init__(self, step: int, shadow) -> None:
        self.step, self.shadow = step, shadow

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            kill_self(self.shadow.session if self.shadow is not None else None, self.step)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--job", default="lightning")
    ap.add_argument("--kill-at", type=int, default=0, help="SIGKILL after this optimizer step")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    pl.seed_everything(5, workers=True)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 12, generator=g), torch.randint(0, 5, (96,), generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    module = Tiny()
    callbacks: list = []
    ckpt_path = None
    shadow = None
    if args.coordinator:
        from trainer_hooks.integrations.lightning import ShadowCallback

        shadow = ShadowCallback(args.coordinator, job=args.job)
        callbacks.append(shadow)
        if args.resume:
            ckpt_path = shadow.resume_checkpoint(os.path.join(args.out, "resume"))
            assert ckpt_path is not None, "nothing to resume from"
    if args.kill_at:
        callbacks.append(KillAt(args.kill_at, shadow))
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        max_epochs=EPOCHS,
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
        precision="bf16-mixed",  # bf16 autocast on the CPU
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
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
        },
        os.path.join(args.out, f"rank{trainer.global_rank}.pt"),
    )
    end_process_group()  # Lightning's teardown leaves its process group up
    end_rank()


if __name__ == "__main__":
    sys.exit(main())
