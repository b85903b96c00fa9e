"""Write the on-disk format fixture: checkpoints of the tiny model written by this build's
cluster, one tier per shard encoding, and the trainer's state at the checkpointed iteration.

    python tools/make_format_fixture.py [--out tests/data/format]

``tests/persist/test_format_fixture.py`` restores them, so a change that leaves old checkpoints
unreadable, or reads them into another state, fails. Run this only when the on-disk format
changes on purpose (and keep the old fixture beside the new one while old checkpoints must
still restore). Writes ``OUT/<encoding>/<job>/iteration-*`` (the job's directory as the
local tier holds it) and ``OUT/expected.npz``: each parameter (``param/NAME``) and its Adam
moments and step (``exp_avg/NAME``, ``exp_avg_sq/NAME``, ``step/NAME``) after ``STEPS``
iterations, float32 and bit-exact."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 4
JOB = "format"
ENCODINGS = ("none", "zstd")


def _train(address: str) -> dict:
    import numpy as np
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_hooks
    from tests.helpers.loop import train_step
    from tests.helpers.tiny_trainer import build

    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=address, scheduler=sched, job=JOB)
    for it in range(1, STEPS + 1):
        train_step(ddp, opt, sched, it)
    assert session.close() == STEPS
    out = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = p.detach().numpy().copy()
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq", "step"):
            if k in st:
                out[f"{k}/{name}"] = np.asarray(st[k].detach().numpy(), dtype=np.float32).copy()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "format"))
    args = ap.parse_args(argv)
    import numpy as np
    import torch.distributed as dist

    from shadow.testing import LocalCluster

    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="format-fixture-"))
    store = dist.FileStore(str(work / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    expected = None
    try:
        if out.exists():
            shutil.rmtree(out)
        for enc in ENCODINGS:
            tier = work / enc
            cluster = LocalCluster(
                work,
                workers=2,
                args=(
                    f"persist.local.dir={tier}",
                    "persist.local.every_n=2",
                    "persist.local.keep=2",
                    f"persist.local.compress={enc}",
                ),
            )
            try:
                state = _train(cluster.address)
                cluster.wait_status(
                    lambda st: (
                        ((st["persist"]["local"]["last_complete"] or {}).get("iteration") == STEPS)
                        and not st["persist"]["local"]["in_flight"]
                    ),
                    what=f"iteration {STEPS} complete on the local tier",
                )
            finally:
                cluster.stop()
            if expected is None:
                expected = state
            assert all(np.array_equal(expected[k], state[k]) for k in expected), "training is not deterministic"
            shutil.copytree(tier / JOB, out / enc / JOB)
        np.savez(out / "expected.npz", **expected)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size} bytes): {', '.join(ENCODINGS)} at iteration {STEPS}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("SHADOW_CONNECT_TIMEOUT_S", "120")
    sys.exit(main())
