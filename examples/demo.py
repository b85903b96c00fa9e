"""The end-to-end demo: crash a DDP training run with SIGKILL, restore it from the shadow,
and check that the resumed run is bit-identical to one that never crashed.

    python examples/demo.py [--steps 24] [--workers 2]

1. start a local shadow cluster (coordinator + workers) on a free port;
2. train the example GPT with 2 ranks, no shadow: the uninterrupted reference;
3. train it again attached to the shadow and SIGKILL every trainer process mid-run;
4. in a new process group, restore from the shadow and finish the run;
5. compare losses and final parameters/optimizer state with the reference, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(out: Path, steps: int, *extra: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(ROOT / "examples" / "train_gpt.py"),
        f"steps={steps}",
        f"out={out}",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TORCH_CPP_LOG_LEVEL="ERROR")
    return subprocess.Popen(
        cmd, env=env, stdout=open(out / "train.log", "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def losses(out: Path) -> dict[int, str]:
    path = out / "losses.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["iteration"]: r["loss_hex"] for r in rows}


def wait(proc: subprocess.Popen, what: str, out: Path, timeout: float = 900) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"{what} did not finish in {timeout:.0f} s; see {out / 'train.log'}") from None
    if code != 0:
        raise SystemExit(
            f"{what} failed (exit {code}); see {out / 'train.log'}:\n{(out / 'train.log').read_text()[-3000:]}"
        )


def wait_for_cluster(address: str, workers: int, proc: subprocess.Popen, work: Path, timeout: float = 600) -> None:
    """Wait until every worker of the cluster is ready (on a first start they compile the
    replay kernels, which takes a while), saying so every few seconds."""
    import zmq

    from shadow.core.errors import ShadowConnectionError
    from shadow.transport.client import dealer, request
    from shadow.wire import messages as M

    t0 = time.monotonic()
    said = -1.0
    sock = dealer(zmq.Context.instance(), address)
    try:
        while True:
            try:
                st = request(sock, address, M.encode("status"), 2.0, ("status_reply",))["status"]
                ready = sum(1 for w in st["workers"] if w["ready"])
            except ShadowConnectionError:  # not listening yet: a fresh socket for the next try
                sock.close(linger=0)
                sock = dealer(zmq.Context.instance(), address)
                ready = 0
            waited = time.monotonic() - t0
            if ready >= workers:
                if said >= 0:
                    print(f"   the shadow cluster is ready ({workers} workers, after {waited:.0f} s)")
                return
            if proc.poll() is not None:
                raise SystemExit(
                    f"the shadow cluster exited; see {work / 'cluster.log'}:\n"
                    f"{(work / 'cluster.log').read_text()[-3000:]}"
                )
            if waited > timeout:
                raise SystemExit(
                    f"the shadow cluster had {ready} of {workers} workers ready after {timeout:.0f} s; "
                    f"see {work / 'cluster.log'}"
                )
            if said < 0 or waited - said >= 5:
                said = waited
                print(
                    f"   waiting for the shadow cluster: {ready} of {workers} workers ready "
                    f"(a first start compiles the replay kernels)",
                    flush=True,
                )
            time.sleep(0.5)
    finally:
        sock.close(linger=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=None, help="picks the kill point; random by default")
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    kill_after = rnd.randint(args.steps // 3, 2 * args.steps // 3)
    work = Path(tempfile.mkdtemp(prefix="shadow-demo-"))
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    print(f"shadow demo in {work}")
    print(f"1. starting a shadow cluster at {address} with {args.workers} workers")
    cluster = subprocess.Popen(
        [sys.executable, "-m", "shadow", "cluster", f"workers={args.workers}", f"port={port}", "threads_per_worker=1"],
        stdout=open(work / "cluster.log", "w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    try:
        t0 = time.monotonic()
        print(f"2. uninterrupted reference run: {args.steps} iterations, 2 ranks, no shadow")
        ref = work / "reference"
        wait(torchrun(ref, args.steps), "reference run", ref)
        print(f"   done in {time.monotonic() - t0:.0f} s")

        wait_for_cluster(address, args.workers, cluster, work)
        print(f"3. the same run attached to the shadow; SIGKILL all trainer processes after iteration {kill_after}")
        crashed = work / "crashed"
        proc = torchrun(crashed, args.steps, f"coordinator={address}")
        while max(losses(crashed), default=0) < kill_after:
            if proc.poll() is not None:
                raise SystemExit(
                    f"attached run exited early; see {crashed / 'train.log'}:\n"
                    f"{(crashed / 'train.log').read_text()[-3000:]}"
                )
            time.sleep(0.02)
        # torchrun starts each rank in its own session: kill the ranks and the launcher
        for pid_file in (crashed / "pids").glob("rank*"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"   killed during iteration {max(losses(crashed)) + 1}")

        print("4. new process group: restore from the shadow, re-attach, finish the run")
        resumed = work / "resumed"
        wait(torchrun(resumed, args.steps, f"coordinator={address}", "resume=true"), "resumed run", resumed)
        log = (resumed / "train.log").read_text()
        restored = int(log.split("restored iteration ")[1].split()[0])
        print(
            f"   restored iteration {restored} (rank 0 of the crashed run had logged {max(losses(crashed))}; the "
            "shadow holds the newest iteration every rank had finished sending)"
        )

        print("5. comparing with the uninterrupted run")
        import torch

        ref_l, res_l = losses(ref), losses(resumed)
        same_losses = all(res_l[i] == ref_l[i] for i in range(restored + 1, args.steps + 1))
        a = torch.load(ref / "final.pt", weights_only=True)
        b = torch.load(resumed / "final.pt", weights_only=True)
        same_params = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        same_opt = all(
            torch.equal(v, b["optimizer"]["state"][i][k])
            for i, st in a["optimizer"]["state"].items()
            for k, v in st.items()
        )
        n = args.steps - restored
        print(
            f"   losses of iterations {restored + 1}..{args.steps} ({n}): "
            f"{'identical, bit for bit' if same_losses else 'DIFFERENT'}"
        )
        print(
            f"   final parameters ({len(a['model'])} tensors): "
            f"{'identical (torch.equal)' if same_params else 'DIFFERENT'}"
        )
        print(f"   final optimizer state: {'identical (torch.equal)' if same_opt else 'DIFFERENT'}")
        ok = same_losses and same_params and same_opt
        print("RESULT:", "the resumed run equals the uninterrupted run bit for bit" if ok else "MISMATCH")
        return 0 if ok else 1
    finally:
        cluster.send_signal(signal.SIGTERM)
        try:
            cluster.wait(timeout=10)
        except subprocess.TimeoutExpired:
            cluster.kill()
        if not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
