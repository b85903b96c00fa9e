"""Train the example GPT with DDP (gloo) under torchrun, attached to a shadow cluster.

    torchrun --nproc_per_node=2 --max-restarts=3 examples/train_gpt.py coordinator=tcp://127.0.0.1:5555 steps=200
    # the same command after a crash, and torchrun's own restarts: resume=auto (the default)
    # restores what the shadow holds of the job, and starts fresh when it holds nothing
    # from the YAML config (configs/train_gpt.yaml), with overrides; print it with --cfg job:
    torchrun --nproc_per_node=2 examples/train_gpt.py --config-name train_gpt model.n_layer=6

The config is a typed dataclass (:class:`TrainConfig`) registered in Hydra's ConfigStore
as ``train_gpt_schema``; ``--help`` lists its keys.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from gpt import (  # examples/ is on sys.path when run as a script
    GPT,
    CharData,
    GPTConfig,
    corpus,
)
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class ModelConfig:
    n_layer: int = 4  #: transformer blocks
    n_embd: int = 256  #: embedding width
    block: int = 64  #: context length (characters)

    def __post_init__(self) -> None:
        for key in ("n_layer", "n_embd", "block"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")


@dataclass
class OptimConfig:
    lr: float = 3e-3  #: peak learning rate (OneCycleLR)
    weight_decay: float = 0.1  #: AdamW weight decay of the matrices (biases and norms: 0)
    clip: float = 1.0  #: gradient-norm clip (0 = off)

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.weight_decay < 0 or self.clip < 0:
            raise ValueError(
                f"optim: lr={self.lr} must be > 0, weight_decay={self.weight_decay} and clip={self.clip} >= 0"
            )


@dataclass
class ShadowConfig:
    policy: str = "block"  #: back-pressure: block (every iteration checkpointed) or skip (never wait)
    job: str = "gpt"  #: job name in the shadow cluster
    audit_every: int = 0  #: compare parameters with the shadow every N steps (0 = off)

    def __post_init__(self) -> None:
        if self.policy not in ("block", "skip"):
            raise ValueError(f"shadow.policy={self.policy!r} is not one of ('block', 'skip')")


@dataclass
class TrainConfig:
    """The example trainer: a character-level GPT with AdamW and OneCycleLR."""

    coordinator: str = ""  #: shadow coordinator address; empty = train without the shadow
    steps: int = 200  #: last iteration to train
    #: restore from the shadow first: auto (when it holds a checkpoint of the job, else a
    #: fresh start: the same command line for the first launch and every restart), true, false
    resume: str = "auto"
    out: str = ""  #: directory for losses.jsonl and final.pt (rank 0)
    batch: int = 8  #: sequences per rank and step
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1:
            raise ValueError(f"steps={self.steps} and batch={self.batch} must be >= 1")
        self.resume = str(self.resume).lower()
        if self.resume not in ("auto", "true", "false"):
            raise ValueError(f"resume={self.resume!r}: use auto, true or false")
        if self.resume == "true" and not self.coordinator:
            raise ValueError("resume=true needs coordinator=tcp://HOST:PORT (where to restore from)")


def load_config(argv: list[str]) -> TrainConfig | None:
    """The config for this command line; None after ``--help`` / ``--cfg job`` (printed)."""
    from hydra.core.config_store import ConfigStore

    from shadow.cli import UsageError, compose_typed, split

    ConfigStore.instance().store(name="train_gpt_schema", node=TrainConfig)
    try:
        args = split(argv)
        if args.config_name is not None and args.config_dir is None:
            args.config_dir = os.path.join(ROOT, "configs")
        if args.help:
            print(__doc__)
            return None
        cfg = compose_typed(TrainConfig, "train_gpt_schema", args, "examples/train_gpt.py")
    except UsageError as exc:
        raise SystemExit(f"train_gpt.py: {exc}") from None
    if args.show:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)).rstrip("\n"))
        return None
    return cfg


def main() -> int:
    args = load_config(sys.argv[1:])
    if args is None:
        return 0
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.out:
        os.makedirs(os.path.join(args.out, "pids"), exist_ok=True)
        with open(os.path.join(args.out, "pids", f"rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
    data = CharData(corpus())
    cfg = GPTConfig(
        vocab_size=len(data.chars), block_size=args.model.block, n_layer=args.model.n_layer, n_embd=args.model.n_embd
    )
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    ddp = DDP(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.optim.lr,
        betas=(0.9, 0.95),
        fused=True,
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.optim.lr, total_steps=args.steps, pct_start=0.1)

    import trainer_hooks

    start = 0
    if args.coordinator and args.resume != "false":
        restore_from = trainer_hooks.resume if args.resume == "auto" else trainer_hooks.restore
        info = restore_from(ddp, opt, source=args.coordinator, scheduler=sched, job=args.shadow.job)
        if info is not None:
            start = info.iteration
        if rank == 0:
            print(
                f"[rank 0] restored iteration {start} from {info.source} ({info.tier})"
                if info is not None
                else f"[rank 0] the shadow holds no checkpoint of job {args.shadow.job}: a fresh start",
                flush=True,
            )
    state = {"iteration": start}
    session = None
    if args.coordinator:
        session = trainer_hooks.attach(
            ddp,
            opt,
            coordinator=args.coordinator,
            scheduler=sched,
            extra_state=lambda: dict(state),
            job=args.shadow.job,
            policy=args.shadow.policy,
            audit_every=args.shadow.audit_every,
        )
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"[rank 0] GPT with {n / 1e6:.2f}M parameters, steps {start + 1}..{args.steps}", flush=True)
    log = open(os.path.join(args.out, "losses.jsonl"), "a") if args.out and rank == 0 else None
    t0 = time.perf_counter()
    for it in range(start + 1, args.steps + 1):
        state["iteration"] = it
        x, y = data.batch(it, rank, args.batch, args.model.block, args.seed)
        loss = ddp(x, y)
        loss.backward()
        if args.optim.clip and session is not None:
            session.clip_grad_norm_(args.optim.clip)
        elif args.optim.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.optim.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if log is not None:
            log.write(json.dumps({"iteration": it, "loss": loss.item(), "loss_hex": loss.item().hex()}) + "\n")
            log.flush()
            if it % 10 == 0:
                print(
                    f"[rank 0] iteration {it} loss {loss.item():.4f} "
                    f"({(time.perf_counter() - t0) / (it - start):.3f} s/it)",
                    flush=True,
                )
    if session is not None:
        session.close()
        if rank == 0:
            print(f"[rank 0] shadow: {session.stats()}", flush=True)
    if args.out and rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
