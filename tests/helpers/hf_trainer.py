"""A transformers ``Trainer`` run as its documentation writes one, on CPU ranks launched with
torchrun's environment, optionally protected by the shadow
(:func:`trainer_hooks.integrations.hf.protect`).

    python tests/helpers/hf_trainer.py --out DIR [--coordinator tcp://...] [--kill-at K] [--resume]

A tiny GPT-2 built from a config (tied embeddings, dropout), a map-style dataset shuffled by
the Trainer's sampler, gradient accumulation, ``max_grad_norm``, a linear schedule with
warm-up, the Trainer's default optimizer, bf16 autocast. Saves each rank's final model, optimizer,
scheduler, per-step losses, ``log_history`` (but its last entry, the run's summary) and RNG to
``DIR/rank{r}.pt``. ``--resume-tmp``: the shadow writes the checkpoint to resume from to a
temporary directory (``$TMPDIR``) instead of ``DIR/resume``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from end import end_process_group, end_rank
from kill import kill_self
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 96, length: int = 16) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class KillAt(TrainerCallback):
    def __init__(self, step: int, run) -> None:
        self.step, self.run = step, run

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            kill_self(self.run.session if self.run is not None else None, self.step)
        return control


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--job", default="hf")
    ap.add_argument("--kill-at", type=int, default=0, help="SIGKILL after this optimizer step")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--resume-tmp", action="store_true", help="resume from a checkpoint in a temporary directory")
    args = ap.parse_args()

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=3,
        learning_rate=3e-3,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=True,  # bf16 autocast on the CPU
        seed=11,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens())
    resume = None
    run = None
    if args.coordinator:
        from trainer_hooks.integrations.hf import protect

        run = protect(trainer, args.coordinator, job=args.job)
        if args.resume:
            resume = run.resume_checkpoint(None if args.resume_tmp else os.path.join(args.out, "resume"))
            assert resume is not None, "nothing to resume from"
    if args.kill_at:
        trainer.add_callback(KillAt(args.kill_at, run))
    trainer.train(resume_from_checkpoint=resume)
    rank = trainer.args.process_index
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    history = trainer.state.log_history
    assert history and "train_runtime" in history[-1], history[-1:]  # the summary train() logs last
    os.makedirs(args.out, exist_ok=True)
    torch.save(
        {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(),
            "losses": losses,
            "rng": torch.get_rng_state(),
            "global_step": trainer.state.global_step,
            "log_history": history[:-1],
        },
        os.path.join(args.out, f"rank{rank}.pt"),
    )
    end_process_group()  # the Trainer leaves its process group up
    end_rank()


if __name__ == "__main__":
    sys.exit(main())
