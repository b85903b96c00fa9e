"""A transformers ``Trainer`` run as its documentation writes one, on CPU ranks launched with
torchrun's environment, optionally protected by the shadow
(:func:`trainer_hooks.integrations.hf.protect`).

    python tests/helpers/hf_trainer.py --out DIR [--coordinator tcp://...] [--kill-at K] [--resume]

A tiny GPT-2 built from a config (tied embeddings, dropout), a map-style dataset shuffled by
the Trainer's sampler, gradient accumulation, ``max_grad_norm``, a linear schedule with
warm-up, the Trainer's default optimizer, bf16 autocast. Saves each rank's final model, optimizer,
scheduler, per-step losses, ``log_history`` (but its last entry, the run's summary) and RNG to
``DIR/rank{r}.pt``, with its final ``global_step`` and ``epoch`` and the epochs it began.
``--resume-tmp``: the shadow writes the checkpoint to resume from to a temporary directory
(``$TMPDIR``) instead of ``DIR/resume``. ``--kill-committed``: SIGKILL only once the cluster
has committed step K itself, after its log entry (a crash between that commit and the next
one). ``--hf-ckpt-at K``: the Trainer's own checkpoints every K steps, to ``DIR/trainer``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

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
    def __init__(self, step: int, run, committed: bool = False) -> None:
        self.step, self.run, self.committed = step, run, committed

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and not self.committed:
            kill_self(self.run.session if self.run is not None else None, self.step)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        # the step's commit waits for its log entry: once it is logged, wait for the commit itself
        if state.global_step == self.step and self.committed:
            session = self.run.session if self.run is not None else None
            if session is not None:
                deadline = time.monotonic() + 120
                while session.committed < self.step and time.monotonic() < deadline:
                    time.sleep(0.01)
            kill_self(session, self.step)
        return control


class Epochs(TrainerCallback):
    """The epochs ``train()`` began in this process."""

    def __init__(self) -> None:
        self.began: list[int] = []

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.began.append(int(state.epoch or 0))
        return control


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--job", default="hf")
    ap.add_argument("--kill-at", type=int, default=0, help="SIGKILL after this optimizer step")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--resume-tmp", action="store_true", help="resume from a checkpoint in a temporary directory")
    ap.add_argument("--kill-committed", action="store_true", help="SIGKILL once step K itself is committed")
    ap.add_argument("--hf-ckpt-at", type=int, default=0, help="the Trainer's own checkpoints every K steps")
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
        save_strategy="steps" if args.hf_ckpt_at else "no",
        save_steps=args.hf_ckpt_at or 500,
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
        trainer.add_callback(KillAt(args.kill_at, run, args.kill_committed))
    epochs = Epochs()
    trainer.add_callback(epochs)
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
            "epoch": trainer.state.epoch,
            "epochs": epochs.began,
            "log_history": history[:-1],
        },
        os.path.join(args.out, f"rank{rank}.pt"),
    )
    end_process_group()  # the Trainer leaves its process group up
    end_rank()


if __name__ == "__main__":
    sys.exit(main())
