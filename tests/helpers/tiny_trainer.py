"""A tiny DDP training run used by the integration tests (run under a 2-rank launcher).

Modes:
  train   train iterations 1..steps (optionally attached to a shadow cluster; optionally
          SIGKILL itself at iteration kill_at) and dump final state to out_dir/rank{r}.pt
  resume  restore from the shadow, re-attach, finish to `steps`, dump like train

Fault-matrix flags (tools/fault_matrix.py): --info-out records progress as JSON (restored
iteration, last completed iteration, when a shadow worker was killed); --kill-in-attach MS
SIGKILLs the process MS milliseconds after attach() is called, --kill-in-bootstrap MS that
long after the bootstrap begins (the coordinator has opened the new epoch; 0 = at once,
before any state is queued); either way the process never trains.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Tiny(nn.Module):
    def __init__(self, unused_branch: bool = False) -> None:
        super().__init__()
        self.unused_branch = unused_branch
        self.side = nn.Linear(24, 37) if unused_branch else None
        self.emb = nn.Embedding(37, 24)
        self.ln = nn.LayerNorm(24)
        self.fc1 = nn.Linear(24, 33)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(33, 37)
        self.frozen = nn.Parameter(torch.ones(5), requires_grad=False)

    def trunk(self, x):
        return self.ln(self.emb(x)).mean(1)

    def forward(self, x, use_side: bool = False):
        h = self.trunk(x)
        out = self.fc2(self.drop(torch.relu(self.fc1(h))))
        if self.side is not None and use_side:
            out = out + self.side(h)
        return out


TABLE_ELEMS = 50_000  # the big buffer: tests shrink SHADOW_EXTRA_CHUNK_BYTES so it spans several chunks


class TinyExtras(Tiny):
    """Tiny plus model state outside the optimizer: a frozen layer in no param group, a
    BatchNorm's running statistics (updated by every forward) and a large constant buffer."""

    def __init__(self, unused_branch: bool = False) -> None:
        super().__init__(unused_branch)
        self.base = nn.Linear(24, 24).requires_grad_(False)
        self.bn = nn.BatchNorm1d(24, affine=False)
        self.register_buffer("table", torch.randn(TABLE_ELEMS))

    def trunk(self, x):
        h = super().trunk(x)
        return self.bn(h + self.base(h)) + self.table[:24]

    def poke(self) -> None:
        """Change the frozen layer and the big buffer in place (as weight surgery would)."""
        with torch.no_grad():
            self.base.weight.add_(1.0)
            self.table.mul_(2.0)


def batch(seed: int, it: int, rank: int):
    g = torch.Generator().manual_seed(seed * 100003 + it * 17 + rank)
    x = torch.randint(0, 37, (8, 6), generator=g)
    y = torch.randint(0, 37, (8,), generator=g)
    return x, y


SCHEDULERS = ("lambda", "onecycle", "sequential", "chained")


def build(
    seed: int = 0,
    impl: str = "fused",
    amsgrad: bool = False,
    optim: str = "adamw",
    sched: str = "lambda",
    unused: bool = False,
    steps: int = 12,
    extras: bool = False,
):
    """The model, optimizer (two param groups, a frozen param) and scheduler under test;
    ``extras``: :class:`TinyExtras`, whose extra state is in no param group."""
    torch.manual_seed(seed)
    model = TinyExtras(unused) if extras else Tiny(unused)
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True}, "default": {}}.get(impl, {"foreach": False})
    first = [p for n, p in model.named_parameters() if n.startswith(("fc", "emb", "side"))]
    groups = [
        {"params": first, "weight_decay": 0.05},
        {"params": [model.ln.weight, model.ln.bias, model.frozen], "weight_decay": 0.0, "lr": 3e-3},
    ]
    if optim in ("adam", "adamw"):
        groups[1]["betas"] = (0.8, 0.99)  # per-group betas
    if optim == "adamw":
        opt = torch.optim.AdamW(groups, lr=1e-2, amsgrad=amsgrad, **kw)
    elif optim == "adam":
        opt = torch.optim.Adam(groups, lr=1e-2, amsgrad=amsgrad, **kw)
    elif optim == "sgd":
        groups[1]["nesterov"] = True
        groups[1]["dampening"] = 0.0
        opt = torch.optim.SGD(groups, lr=5e-2, momentum=0.9, dampening=0.1, **kw)
    elif optim == "adamax":  # torch has no fused Adamax: --impl foreach, single or default
        groups[1]["betas"] = (0.8, 0.99)
        opt = torch.optim.Adamax(groups, lr=1e-2, maximize=False, **kw)
    else:
        raise ValueError(optim)
    if sched == "lambda":
        s = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + 0.1 * k))
    elif sched == "onecycle":
        s = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2e-2, 6e-3], total_steps=steps + 1, pct_start=0.3)
    elif sched == "sequential":
        s = torch.optim.lr_scheduler.SequentialLR(
            opt,
            [
                torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4),
                torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps),
            ],
            milestones=[4],
        )
    elif sched == "chained":
        s = torch.optim.lr_scheduler.ChainedScheduler(
            [
                torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.93),
                torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
            ],
            optimizer=opt,
        )
    else:
        raise ValueError(sched)
    return model, opt, s


class Info:
    """Progress as JSON at ``path`` (``{rank}`` in it is replaced; without it only rank 0
    writes), rewritten atomically on every update so a SIGKILL leaves the last one."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path.replace("{rank}", str(rank)) if "{rank}" in path or rank == 0 else ""
        self.data: dict = {"rank": rank}

    def update(self, **fields) -> None:
        if not self.path:
            return
        self.data.update(fields)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="train")
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument(
        "--kill-at-once",
        action="store_true",
        help="SIGKILL at --kill-at without first waiting for the shadow to commit the iteration before",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", default="fused", help="fused | foreach | single | default (torch's choice)")
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--amsgrad", action="store_true")
    ap.add_argument("--job", default="default")
    ap.add_argument("--dump-dir", default="", help="save every rank's state after every iteration")
    ap.add_argument("--optim", default="adamw")
    ap.add_argument("--sched", default="lambda")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step (no_sync for all but the last)")
    ap.add_argument("--unused", action="store_true", help="a branch used only on odd iterations")
    ap.add_argument("--compress", default="", help="DDP compression hook: bf16 | fp16")
    ap.add_argument("--kill-worker-at", type=int, default=0, help="rank 0 SIGKILLs shadow worker 1 then")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--extras", action="store_true", help="TinyExtras: frozen layer, BatchNorm, big buffer")
    ap.add_argument(
        "--poke-at",
        type=int,
        default=0,
        help="with --extras: change the frozen layer and the big buffer in place before this iteration's forward",
    )
    ap.add_argument("--policy", default="block", help="back-pressure policy: block | skip")
    ap.add_argument("--clip-via", default="session", help="with --clip, attached: session | torch (clip_grad_norm_)")
    ap.add_argument("--closure", action="store_true", help="optimizer.step(closure): forward, backward, clip inside")
    ap.add_argument("--disabled-scaler", action="store_true", help="a GradScaler(enabled=False) used as AMP loops do")
    ap.add_argument("--sched-steps", type=int, default=1, help="scheduler steps per optimizer step")
    ap.add_argument("--sched-wrap", action="store_true", help="with --sched-steps: attach with a wrapper stepping them")
    ap.add_argument("--amp", default="", help="GradScaler + bf16 autocast: 'step' | 'unscale' (unscale_ first)")
    ap.add_argument(
        "--info-out",
        default="",
        help="JSON progress file: restored / completed iteration, worker kill time ({rank} in the path: one per rank)",
    )
    ap.add_argument(
        "--kill-in-attach",
        type=float,
        default=-1.0,
        metavar="MS",
        help="SIGKILL this process MS milliseconds after attach() starts (it never trains)",
    )
    ap.add_argument(
        "--kill-in-bootstrap",
        type=float,
        default=-1.0,
        metavar="MS",
        help="SIGKILL this process MS milliseconds after attach's bootstrap begins (never trains)",
    )
    ap.add_argument(
        "--prefetch",
        action="store_true",
        help="nanoGPT's loop: each batch is drawn from torch's RNG, the next one fetched before the step; "
        "resume restores with defer_rng and applies the RNG after the script's own first fetch",
    )
    ap.add_argument(
        "--restore-before-pg",
        action="store_true",
        help="resume: restore into the bare model before init_process_group (the rank from $RANK)",
    )
    ap.add_argument("--resize", action="store_true", help="resume: restore onto another world size (resize=True)")
    ap.add_argument(
        "--until-resynced",
        type=int,
        default=0,
        metavar="N",
        help="after --steps, train on (at most N more iterations) until the session has resynced, is protected "
        "and has committed the iteration before the last one taken",
    )
    ap.add_argument(
        "--tamper-after-restore",
        action="store_true",
        help="resume: change the first parameter on every rank between the restore and the attach",
    )
    ap.add_argument(
        "--kill-in-round",
        default="",
        help="under torchrun --max-restarts: ROUND:IT:RANKS,... SIGKILL these ranks ('all' or r+r) at "
        "iteration IT of restart round ROUND (TORCHELASTIC_RESTART_COUNT)",
    )
    args = ap.parse_args()
    if args.kill_in_round:  # this round's kill, if any, becomes --kill-at on the ranks it names
        round_now = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        for spec in args.kill_in_round.split(","):
            r, at, who = spec.split(":")
            if int(r) == round_now and (who == "all" or str(os.environ["RANK"]) in who.split("+")):
                args.kill_at = int(at)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    info_out = Info(args.info_out, rank) if args.info_out else None
    random.seed(1000 + rank)
    np.random.seed(2000 + rank)
    model, opt, sched = build(
        args.seed, args.impl, args.amsgrad, args.optim, args.sched, args.unused, args.steps, args.extras
    )
    early = None
    if args.mode == "resume" and args.restore_before_pg:  # Lightning builds DDP only inside fit()
        import trainer_hooks

        early = trainer_hooks.restore(
            model, opt, source=args.coordinator, scheduler=sched, job=args.job, defer_rng=args.prefetch
        )
    dist.init_process_group("gloo")
    assert (rank, world) == (dist.get_rank(), dist.get_world_size())
    ddp = DDP(model, find_unused_parameters=args.unused)
    hook = None
    if args.compress:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}[args.compress]
        if not args.coordinator:
            ddp.register_comm_hook(None, hook)

    import trainer_hooks
    from trainer_hooks import testing

    testing.inject_from_env()  # SHADOW_FAULT_NET / SHADOW_FAULT_DIE_AT (tests and the fault matrix)
    scaler = None
    if args.disabled_scaler:
        scaler = torch.amp.GradScaler("cpu", enabled=False)  # built always, enabled only for fp16 (nanoGPT)
    elif args.amp:
        # the first scaled loss overflows (inf): that step is skipped, the scale backs off, then grows
        scaler = torch.amp.GradScaler(
            "cpu", init_scale=2.0**16, backoff_factor=0.5, growth_factor=2.0, growth_interval=2
        )
    stepper = sched
    if args.sched_steps > 1:

        class Repeating:
            """Steps the scheduler it wraps several times per call (as accelerate's AcceleratedScheduler)."""

            def __init__(self, inner) -> None:
                self.inner = inner

            def step(self) -> None:
                for _ in range(args.sched_steps):
                    self.inner.step()

            def state_dict(self):
                return self.inner.state_dict()

            def load_state_dict(self, state) -> None:
                self.inner.load_state_dict(state)

        stepper = Repeating(sched)
    attached_sched = stepper if args.sched_wrap else sched
    start = 0
    info = None
    if args.mode in ("resume", "auto"):  # auto: one command line for the first launch and every relaunch
        restore_from = trainer_hooks.resume if args.mode == "auto" else trainer_hooks.restore
        info = early or restore_from(
            ddp,
            opt,
            source=args.coordinator,
            scheduler=attached_sched,
            scaler=scaler,
            job=args.job,
            defer_rng=args.prefetch,
            resize=args.resize,
        )
    if info is not None:
        start = info.iteration
        if info_out is not None:
            info_out.update(restored=start, completed=start, tier=info.tier, extra_state=info.extra_state)
        assert start == 0 or info.extra_state["it"] == start, info.extra_state
        if args.tamper_after_restore:
            with torch.no_grad():
                next(iter(model.parameters())).add_(1e-3)
    fetched = {"seed": int(torch.randint(0, 2**31 - 1, (1,)))} if args.prefetch else {}  # nanoGPT's first get_batch
    if info is not None and args.prefetch:
        fetched["seed"] = info.extra_state["next"]  # the batch fetched before the checkpointed step
        info.apply_rng()  # only now: the script's own first fetch above drew from the RNG
    session = None
    it_box = {"it": start}
    kill_in_attach = args.coordinator and (args.kill_in_attach >= 0 or args.kill_in_bootstrap >= 0)

    def arm_kill(ms: float, phase: str) -> None:
        if info_out is not None:
            info_out.update(phase=phase, kill_ms=ms, **{f"{phase}_t": time.time()})
        if ms <= 0:
            os.kill(os.getpid(), signal.SIGKILL)  # right here: e.g. before any bootstrap state is queued
        threading.Timer(ms / 1000.0, os.kill, (os.getpid(), signal.SIGKILL)).start()

    if args.coordinator and args.kill_in_attach >= 0:
        arm_kill(args.kill_in_attach, "attach")
    elif args.coordinator and args.kill_in_bootstrap >= 0:
        from trainer_hooks.session import bootstrap

        streamed = bootstrap.bootstrap  # Attachment.open calls it through the module, after the handshake

        def bootstrap_then_die(att, carry) -> None:
            arm_kill(args.kill_in_bootstrap, "bootstrap")
            streamed(att, carry)

        bootstrap.bootstrap = bootstrap_then_die
    if args.coordinator:
        session = trainer_hooks.attach(
            ddp,
            opt,
            coordinator=args.coordinator,
            scheduler=attached_sched,
            job=args.job,
            extra_state=lambda: {"it": it_box["it"], **({"next": fetched["seed"]} if args.prefetch else {})},
            tokens=lambda: it_box["it"] * 48 * world,
            comm_hook=hook,
            scaler=scaler,
            policy=args.policy,
        )
        if kill_in_attach:
            # attach returned first: the bootstrap may still be streaming; never train
            if info_out is not None:
                info_out.update(phase="attached", attached_t=time.time())
            time.sleep(3600)
    losses, draws = [], []

    def more(it: int) -> bool:
        """Whether to take iteration ``it``: up to --steps, then (--until-resynced N) while the
        session has not yet resynced after its base was refused, N more at most."""
        if it <= args.steps:
            return True
        if not args.until_resynced or session is None or it > args.steps + args.until_resynced:
            return False
        # the iteration just taken is it - 1; its commit leaves at the next forward: the one before it
        waiting = session.epoch == first_epoch or session.degraded is not None or session.committed < it - 2
        vote = torch.tensor([int(waiting)])
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)  # every rank takes the same iterations
        if vote.item():
            time.sleep(0.05)  # the resync comes at an iteration boundary, once the cluster asks for it
        return bool(vote.item())

    first_epoch = session.epoch if session is not None else None
    it = start
    step_s = []  # each iteration's wall time, waits for the shadow included
    while more(it + 1):
        t_step = time.monotonic()
        it += 1
        it_box["it"] = it
        # Python's and numpy's global RNGs are part of the loop too (e.g. augmentation)
        jitter = random.random() + float(np.random.rand())
        if it == args.poke_at:
            model.poke()

        def forward_backward(it=it):
            for micro in range(args.accum):
                x, y = batch(args.seed, fetched["seed"] if args.prefetch else it * 7 + micro, rank)
                use_side = args.unused and it % 2 == 1
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None and scaler.is_enabled()):
                    if micro < args.accum - 1:
                        with ddp.no_sync():
                            micro_loss = nn.functional.cross_entropy(ddp(x, use_side), y) / args.accum
                            (scaler.scale(micro_loss) if scaler else micro_loss).backward()
                        continue
                    loss = nn.functional.cross_entropy(ddp(x, use_side), y) / args.accum
                if args.prefetch:  # the next batch, fetched before backward and the step
                    fetched["seed"] = int(torch.randint(0, 2**31 - 1, (1,)))
                if scaler is not None and scaler.is_enabled():
                    # iterations 1 and 5 overflow (inf gradients): GradScaler skips those steps
                    blowup = 1e36 if it in (1, 5) else 1.0
                    scaler.scale(loss * blowup).backward()
                elif scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
            if scaler is not None and (args.amp == "unscale" or args.disabled_scaler):
                scaler.unscale_(opt)
            if args.clip:
                if session is not None and args.clip_via == "session":
                    session.clip_grad_norm_(args.clip)
                else:
                    torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
            return loss

        if args.closure:
            box: dict = {}

            def closure(box=box):
                box["loss"] = forward_backward()
                return box["loss"]

            (scaler.step(opt, closure) if scaler is not None else opt.step(closure))
            loss = box["loss"]
            if scaler is not None:
                scaler.update()
        else:
            loss = forward_backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        stepper.step()
        opt.zero_grad()
        losses.append(loss.item() + 0.0 * jitter)
        draws.append((jitter,))
        if args.dump_dir:
            os.makedirs(args.dump_dir, exist_ok=True)
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "rng": torch.get_rng_state(),
                },
                os.path.join(args.dump_dir, f"it{it}-rank{rank}.pt"),
            )
        step_s.append(time.monotonic() - t_step)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if it == args.kill_worker_at and rank == 0:
            import zmq

            from shadow.transport.client import dealer, request
            from shadow.wire import messages as M

            sock = dealer(zmq.Context.instance(), args.coordinator)
            st = request(sock, args.coordinator, M.encode("status"), 10, ("status_reply",))["status"]
            sock.close(linger=0)
            os.kill(st["workers"][1]["pid"], signal.SIGKILL)
            if info_out is not None:
                info_out.update(worker_killed_t=time.time(), worker_killed_pid=st["workers"][1]["pid"])
        if info_out is not None:
            info_out.update(completed=it)
        if it == args.kill_at:
            from kill import kill_self  # run as a script: tests/helpers is on sys.path

            kill_self(None if args.kill_at_once else session, it)
    if session is not None:
        session.close()
    os.makedirs(args.out, exist_ok=True)
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "losses": losses,
            "start": start,
            "rng": torch.get_rng_state(),
            "draws": draws,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "epochs": session.epoch if session is not None else None,
            "committed": session.committed if session is not None else None,
            "stats": session.stats() if session is not None else None,
            "step_s": step_s,
            "round": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        },
        os.path.join(args.out, f"rank{rank}.pt"),
    )
    dist.barrier()  # every rank done with every collective (a compression hook's too) before teardown
    dist.destroy_process_group()
    from end import end_rank  # run as a script: tests/helpers is on sys.path

    end_rank()


if __name__ == "__main__":
    sys.exit(main())
