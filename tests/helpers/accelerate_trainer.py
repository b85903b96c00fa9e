"""A training script written the way accelerate's documentation writes one, on CPU ranks
(launched with torchrun's environment), optionally attached to the shadow through
:class:`trainer_hooks.integrations.accelerate.ShadowedRun`.

    python tests/helpers/accelerate_trainer.py --out DIR [--coordinator tcp://...] [--kill-at K] [--resume]

A shuffled DataLoader (accelerate keeps its generator in step across processes), gradient
accumulation with ``accelerator.accumulate``, ``accelerator.backward``,
``accelerator.clip_grad_norm_`` on sync steps, a prepared OneCycleLR (stepped by accelerate's
wrapper once per process), bf16 autocast, dropout, and Python/numpy draws per batch. Saves
each rank's final model, optimizer, scheduler, losses, RNG and the batches it trained in each
epoch to ``DIR/rank{r}.pt``.

``--kill-committed``: SIGKILL only once the cluster has committed step K itself (a crash
between that commit and the next one). ``--resume-auto``: ``ShadowedRun(resume="auto")``
with ``--resume``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from end import end_process_group, end_rank
from kill import kill_self
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--job", default="accelerate")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=0, help="SIGKILL after this optimizer step")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill-committed", action="store_true", help="SIGKILL once step K itself is committed")
    ap.add_argument("--resume-auto", action="store_true", help='with --resume: resume="auto"')
    args = ap.parse_args()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision="bf16")  # bf16 autocast
    set_seed(1234)  # the same model on every rank; accelerate keeps the loader's shuffle in step
    random.seed(100 + accelerator.process_index)
    np.random.seed(200 + accelerator.process_index)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 12, generator=g), torch.randint(0, 5, (96,), generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    steps_per_epoch = len(loader) // 2 // accelerator.num_processes + 1
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=3e-3, total_steps=args.epochs * steps_per_epoch * accelerator.num_processes
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    run = None
    first_epoch = 0
    if args.coordinator:
        from trainer_hooks.integrations.accelerate import ShadowedRun

        run = ShadowedRun(
            accelerator,
            model,
            optimizer,
            loader,
            args.coordinator,
            scheduler=scheduler,
            job=args.job,
            resume=("auto" if args.resume_auto else True) if args.resume else False,
        )
        first_epoch = run.epoch
    start = first_epoch * len(loader) + (run.batches_done if run is not None else 0)  # micro-batches done
    losses, draws, steps = [], [], 0
    epochs: dict[int, int] = {}  # the batches this process trained in each epoch it went through
    for epoch in range(first_epoch, args.epochs):
        batches = run.batches(epoch) if run is not None else loader
        epochs[epoch] = 0
        for x, y in batches:
            epochs[epoch] += 1
            with accelerator.accumulate(model):
                draws.append(random.random() + float(np.random.rand()))  # the loop's own RNG use
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if accelerator.sync_gradients:
                steps += 1
                if steps == args.kill_at:
                    session = run.session if run is not None else None
                    if args.kill_committed and session is not None:
                        deadline = time.monotonic() + 120
                        while session.committed < steps and time.monotonic() < deadline:
                            time.sleep(0.01)
                    kill_self(session, steps)
    if run is not None:
        run.close()
    os.makedirs(args.out, exist_ok=True)
    inner = optimizer.optimizer
    torch.save(
        {
            "model": accelerator.unwrap_model(model).state_dict(),
            "optimizer": inner.state_dict(),
            "scheduler": scheduler.scheduler.state_dict(),
            "losses": losses,
            "draws": draws,
            "start": start,
            "epochs": epochs,
            "rng": torch.get_rng_state(),
        },
        os.path.join(args.out, f"rank{accelerator.process_index}.pt"),
    )
    accelerator.wait_for_everyone()
    accelerator.end_training()
    end_process_group()  # a no-op where end_training destroyed it
    end_rank()


if __name__ == "__main__":
    sys.exit(main())
