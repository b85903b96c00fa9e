"""One rank of bench_recovery's training run (under torchrun): the example GPT with fused
AdamW on gloo, checkpointed one of four ways, resuming by itself at every (re)start.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 benchmarks/recovery_trainer.py \\
        --mode shadow --coordinator tcp://127.0.0.1:5555 --events events.jsonl --steps 100

``--mode``: ``shadow`` (``trainer_hooks.attach(resume="auto")``), ``dcp`` (``dcp.save``
every ``--every`` iterations, ``dcp.load`` of the newest at start), ``torch`` (rank 0
``torch.save`` every ``--every``, every rank ``torch.load`` of the newest at start), or
``none``. Each rank appends what it does, with wall times, to ``--events`` (one JSON line
per event: start, pg, built, restore_start, restored, attached, step, saved), which the
benchmark reads to split a failure's cost into its parts.
"""

from __future__ import annotations

import time

T_START = time.time()  # before any import: the process's start as near as Python sees it

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("shadow", "dcp", "torch", "none"), required=True)
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--job", default="recovery")
    ap.add_argument("--every", type=int, default=10, help="dcp / torch: iterations between checkpoints")
    ap.add_argument("--ckpt-dir", default="")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--events", required=True)
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = open(args.events, "a")

    def emit(event: str, t: float | None = None, **fields) -> None:
        line = {"t": time.time() if t is None else t, "event": event, "rank": rank, "round": restart, **fields}
        events.write(json.dumps({**line, "pid": os.getpid()}) + "\n")  # one small write: appended whole
        events.flush()

    emit("start", T_START)
    import torch
    import torch.distributed as dist
    from benchlib import example_gpt
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    emit("pg")
    GPT, CharData, GPTConfig, corpus = example_gpt()
    data = CharData(corpus(4000))
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=len(data.chars),
            block_size=args.block,
            n_layer=args.n_layer,
            n_head=max(1, args.n_embd // 64),
            n_embd=args.n_embd,
            dropout=0.0,
        )
    )
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    emit("built", params=sum(p.numel() for p in model.parameters()))

    start, session = 0, None
    emit("restore_start")
    if args.mode == "shadow":
        import trainer_hooks

        info = trainer_hooks.resume(ddp, opt, args.coordinator, job=args.job)
        start = info.iteration if info is not None else 0
        emit("restored", iteration=start, tier=info.tier if info is not None else None)
        session = trainer_hooks.attach(ddp, opt, args.coordinator, job=args.job)
        emit("attached", base_kept=session.stats()["base_kept"])
    elif args.mode in ("dcp", "torch"):
        start = _load(args, model, opt)
        emit("restored", iteration=start, tier="local disk" if start else None)
    else:
        emit("restored", iteration=0, tier=None)
    for it in range(start + 1, args.steps + 1):
        x, y = data.batch(it, rank, args.batch, args.block)
        loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        emit("step", it=it)
        if args.mode in ("dcp", "torch") and it % args.every == 0:
            t0 = time.time()
            _save(args, model, opt, it)
            emit("saved", it=it, seconds=time.time() - t0)
    if session is not None:
        session.close()
    emit("done")
    dist.barrier()
    from benchlib import destroy_process_group

    del ddp, session  # the group's last owner must not be DDP's reducer (benchlib.destroy_process_group)
    destroy_process_group()
    events.close()
    os._exit(0)  # no interpreter teardown with the session's threads gone and the group destroyed


def _newest(ckpt: Path, suffix: str) -> int:
    """The newest iteration with a complete checkpoint under ``ckpt`` (0: none)."""
    done = [int(p.name.split("-")[1].split(".")[0]) for p in ckpt.glob(f"step-*{suffix}") if p.exists()]
    return max(done, default=0)


def _prune(ckpt: Path, below: int) -> None:
    """Remove the DCP checkpoints of iterations before ``below`` (the newest two stay)."""
    for old in ckpt.glob("step-*"):
        if int(old.name.split("-")[1].split(".")[0]) < below:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)


def _save(args, model, opt, it: int) -> None:
    """A checkpoint of iteration ``it``: DCP (every rank writes its part; rank 0 marks it
    complete once all have) or torch.save (rank 0 writes the whole of it)."""
    import torch
    import torch.distributed as dist

    ckpt = Path(args.ckpt_dir)
    if args.mode == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt / f"step-{it}"))
        dist.barrier()
        if dist.get_rank() == 0:
            (ckpt / f"step-{it}.done").touch()
            _prune(ckpt, it - args.every)
        return
    if dist.get_rank() == 0:
        tmp = ckpt / f".step-{it}.pt.tmp"
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp)
        os.replace(tmp, ckpt / f"step-{it}.pt")
        for old in ckpt.glob("step-*.pt"):  # keep the newest two
            if int(old.name.split("-")[1].split(".")[0]) < it - args.every:
                old.unlink(missing_ok=True)
    dist.barrier()


def _load(args, model, opt) -> int:
    """Load the newest checkpoint under ``--ckpt-dir``; its iteration (0: none there)."""
    import torch

    ckpt = Path(args.ckpt_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    if args.mode == "dcp":
        it = _newest(ckpt, ".done")
        if not it:
            return 0
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(ckpt / f"step-{it}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return it
    it = _newest(ckpt, ".pt")
    if not it:
        return 0
    state = torch.load(ckpt / f"step-{it}.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return it


if __name__ == "__main__":
    sys.exit(main())
