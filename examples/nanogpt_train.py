"""A plain training loop written the way nanoGPT's train.py is, attached to the shadow.

    torchrun --standalone --nproc_per_node=2 examples/nanogpt_train.py --coordinator=tcp://127.0.0.1:5555
    # after a crash, the same command with --resume=True: it goes on from the shadow's last iteration

Configuration is module-level variables, overridden by ``--key=value`` (as nanoGPT's
configurator does). The loop keeps nanoGPT's habits, each of which the shadow handles:

* batches drawn from torch's global RNG (``get_batch``), the next one fetched *before*
  backward and the step: the RNG recorded with iteration k is past that fetch, so the
  fetched batch's indices ride in ``extra_state`` and a resume restores with
  ``defer_rng=True``, fetches the batch again from those indices, then applies the RNG;
* gradient accumulation by ``model.require_backward_grad_sync`` (DDP reduces the last
  micro-step only);
* a ``GradScaler`` built always, enabled only for float16 (a disabled one is no scaler);
* torch's ``clip_grad_norm_`` on the model's parameters (recorded, replayed exactly);
* the learning rate set by hand in every param group each iteration (no scheduler: the
  commit carries each group's lr as the step used it);
* AdamW with weight-decay groups, fused on CUDA, torch's default on CPU (single-tensor,
  replayed bit for bit with the CPU's square roots).

Only the lines marked ``# shadow`` are the shadow's: five of them (and the two lines that put
the fetched batch back on resume).
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from gpt import GPT, CharData, GPTConfig, corpus  # examples/ is on sys.path when run as a script
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks  # shadow

# -----------------------------------------------------------------------------
# default config values
out_dir = "out-nanogpt"
coordinator = ""  # tcp://host:port of the shadow cluster ("" = no shadow)
job = "nanogpt"
resume = False
max_iters = 40
gradient_accumulation_steps = 2
batch_size = 8
block_size = 32
n_layer, n_head, n_embd, dropout = 2, 2, 64, 0.1
learning_rate, min_lr, warmup_iters, lr_decay_iters = 3e-3, 3e-4, 5, 40
weight_decay, beta1, beta2, grad_clip = 0.1, 0.9, 0.95, 1.0
dtype = "float32"  # float32 | bfloat16 | float16 (float16: the GradScaler scales)
seed = 1337
kill_at = 0  # tests: SIGKILL this process right after iteration kill_at
# -----------------------------------------------------------------------------
for arg in sys.argv[1:]:  # nanoGPT's configurator, the --key=value half of it
    key, _, val = arg.removeprefix("--").partition("=")
    if key not in globals() or key.startswith("_"):
        raise SystemExit(f"unknown config key {key!r}")
    default = globals()[key]
    globals()[key] = (val.lower() == "true") if isinstance(default, bool) else type(default)(val)

dist.init_process_group(backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(seed + rank)
device_type = "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type=device_type, dtype=ptdtype)

data = CharData(corpus(4000)).data
n = int(0.9 * len(data))
splits = {"train": data[:n], "val": data[n:]}


def get_batch(split: str, ix: torch.Tensor | None = None):
    d = splits[split]
    if ix is None:
        ix = torch.randint(len(d) - block_size, (batch_size,))
    x = torch.stack([d[i : i + block_size] for i in ix])
    y = torch.stack([d[i + 1 : i + 1 + block_size] for i in ix])
    return x, y, ix


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


model = GPT(
    GPTConfig(vocab_size=64, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=dropout)
)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
    lr=learning_rate,
    betas=(beta1, beta2),
    **({"fused": True} if device_type == "cuda" else {}),
)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
model = DDP(model)

iter_num = 0
if resume:
    info = trainer_hooks.restore(model, optimizer, source=coordinator, scaler=scaler, job=job, defer_rng=True)  # shadow
    iter_num = info.iteration
X, Y, ix = get_batch("train")  # fetch the very first batch
if resume:  # the batch fetched before the checkpointed step, then the RNG as it was after that fetch
    X, Y, ix = get_batch("train", torch.tensor(info.extra_state["ix"]))
    info.apply_rng()  # shadow
session = None
if coordinator:
    session = trainer_hooks.attach(  # shadow
        model,
        optimizer,
        coordinator,
        scaler=scaler,
        job=job,
        extra_state=lambda: {"ix": ix.tolist()},  # shadow
    )
losses = []
t0 = time.time()
while iter_num < max_iters:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    for micro_step in range(gradient_accumulation_steps):
        model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            loss = model(X, Y) / gradient_accumulation_steps
        X, Y, ix = get_batch("train")  # prefetch the next batch while the backward runs
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    losses.append(loss.item() * gradient_accumulation_steps)
    if rank == 0 and iter_num % 10 == 0:
        print(f"iter {iter_num}: loss {losses[-1]:.4f}, {(time.time() - t0) * 1000 / 10:.0f} ms/iter", flush=True)
        t0 = time.time()
    if iter_num == kill_at:
        os.kill(os.getpid(), 9)
if session is not None:
    session.close()
os.makedirs(out_dir, exist_ok=True)
raw = model.module
torch.save(
    {
        "model": raw.state_dict(),
        "optimizer": optimizer.state_dict(),
        "losses": losses,
        "iter_num": iter_num,
        "rng": torch.get_rng_state(),
    },
    os.path.join(out_dir, f"rank{rank}.pt"),
)
dist.destroy_process_group()
