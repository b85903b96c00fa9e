"""What a failure costs, from the kill to training again past the iteration it hit, with
nobody at the keyboard: the shadow against DCP and torch.save on the same run.

    python benchmarks/bench_recovery.py [--n-layer 4 --n-embd 256] [--repeat 2] [--json out.json]

Each row runs ``benchmarks/recovery_trainer.py`` (the example GPT, fused AdamW, 2 gloo
ranks) under ``torchrun --standalone --max-restarts 1``, SIGKILLs rank 1 part-way through
a random iteration (the same one in every row of a round; rows interleaved round by
round), and lets torchrun restart the ranks, which resume by themselves. Rows:

* ``shadow memory``: ``attach(resume="auto")`` against a default ``shadow cluster``;
  the ranks restore from the workers' memory.
* ``shadow, cluster restarted``: the same, and the whole cluster is SIGKILLed with the rank
  and started again; the ranks restore from its local tier (every ``--every-short``
  iterations here, as DCP's short interval).
* ``dcp every N``: ``dcp.save`` every ``--every-short`` / ``--every-long`` iterations,
  ``dcp.load`` of the newest at start, on local disk.
* ``torch.save every N``: rank 0 saves every ``--every-long``; every rank loads it.

Per failure: ``total_s`` from the kill until every rank has completed the iteration the
killed rank was on (what the failure really cost), split into ``detect_s`` (kill to the
first restarted process: torchrun noticing, stopping the other rank, starting the round),
``init_s`` (process start to model built: interpreter, imports, rendezvous),
``restore_s``, ``attach_s`` (the shadow's re-attach: after a restore from memory the
workers keep their state and the ranks prove theirs equal by digests) and ``redo_s``
(training again up to that iteration: the lost iterations redone); and ``lost``, the
completed iterations that had to be redone. ``save_s``: what a checkpoint cost the
training loop (DCP, torch.save: the mean blocking save).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import Goal, bars, machine_info

from shadow.testing import LocalCluster
from shadow.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
TRAINER = Path(__file__).resolve().parent / "recovery_trainer.py"

GOALS = [
    Goal("shadow memory: failure cost / DCP's (its short interval)", "summary.shadow_vs_dcp_short", 0.5, "<=", "x"),
    Goal("shadow memory: iterations lost per failure", "rows.shadow memory.lost", 1.0, "<="),
    Goal("shadow memory: restore / recovery time", "summary.shadow_restore_share", 0.2, "<="),
    Goal("{key}: seconds a failure costs", "rows.*.total_s", None, unit="s"),
    Goal("{key}: iterations lost", "rows.*.lost", None),
]
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full: a GPT of about
# 110M parameters), ARGS_SMOKE (--smoke: seconds, the figures meaningless)
ARGS_QUICK = ["--repeat", "1"]
ARGS_FULL = ["--n-layer", "16", "--n-embd", "768", "--repeat", "2"]
ARGS_SMOKE = ["--n-layer", "1", "--n-embd", "32", "--kill-from", "6", "--kill-to", "8", "--every-short", "2"]
ARGS_SMOKE += ["--every-long", "5", "--repeat", "1"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--every-short", type=int, default=10, help="DCP's short interval (and the shadow tier's)")
    ap.add_argument("--every-long", type=int, default=50, help="DCP's and torch.save's long interval")
    ap.add_argument("--kill-from", type=int, default=51, help="the kill falls in a random iteration from this")
    ap.add_argument("--kill-to", type=int, default=100, help="... to this one")
    ap.add_argument("--repeat", type=int, default=2, help="rounds (each row once per round, interleaved)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", default="", help="comma-separated subset of the rows")
    ap.add_argument("--json", default="")
    return ap


ROWS = ("shadow memory", "shadow, cluster restarted", "dcp every short", "dcp every long", "torch.save every long")


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            raise RuntimeError(
                f"torchrun exited ({proc.returncode}) before {what}; log {log}:\n{log.read_text()[-4000:]}"
            )
        time.sleep(0.02)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}; log {log}:\n{log.read_text()[-4000:]}")


def run_row(row: str, kill_at: int, args, tmp: Path, rng: random.Random) -> dict:
    """One training run of ``row``, rank 1 SIGKILLed during iteration ``kill_at``; the
    failure's figures."""
    tmp.mkdir(parents=True)
    events = tmp / "events.jsonl"
    every = args.every_long if row.endswith("long") else args.every_short
    mode = "shadow" if row.startswith("shadow") else "dcp" if row.startswith("dcp") else "torch"
    cluster = None
    cluster_args: tuple[str, ...] = ()
    if row == "shadow, cluster restarted":
        cluster_args = (f"persist.local.every_n={args.every_short}",)  # the default tier's place, DCP's interval
    if mode == "shadow":
        cluster = LocalCluster(tmp, workers=2, durable=True, args=cluster_args, port=free_port())
    steps = args.kill_to + 3
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        str(TRAINER),
        "--mode",
        mode,
        "--events",
        str(events),
        "--steps",
        str(steps),
        "--every",
        str(every),
        "--ckpt-dir",
        str(tmp / "ckpt"),
        "--n-layer",
        str(args.n_layer),
        "--n-embd",
        str(args.n_embd),
        "--batch",
        str(args.batch),
        *(("--coordinator", cluster.address) if cluster is not None else ()),
    ]
    log = tmp / "torchrun.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:

            def reached():
                ev = [e for e in _events(events) if e["rank"] == 1 and e["round"] == 0 and e["event"] == "step"]
                return ev if ev and ev[-1]["it"] >= kill_at - 1 else None

            steps_seen = _wait(reached, 3600, f"rank 1 at iteration {kill_at - 1}", proc, log)
            times = [e["t"] for e in steps_seen[-6:]]
            step_s = (times[-1] - times[0]) / max(1, len(times) - 1)
            time.sleep(rng.uniform(0.1, 0.9) * step_s)  # part-way through the iteration
            ev = _events(events)
            victim = next(e["pid"] for e in ev if e["rank"] == 1 and e["round"] == 0 and e["event"] == "start")
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            # the last step it finished: read after the kill, as it may have finished one more meanwhile
            ev = _events(events)
            done = max(e["it"] for e in ev if e["rank"] == 1 and e["round"] == 0 and e["event"] == "step")
            if row == "shadow, cluster restarted":
                assert cluster is not None
                port = cluster.port
                cluster.kill_all()
                cluster = LocalCluster(tmp, workers=2, durable=True, args=cluster_args, port=port)
            proc.wait(timeout=3600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"{row}: torchrun exited {proc.returncode}; log {log}:\n{log.read_text()[-4000:]}")
    finally:
        if cluster is not None:
            cluster.stop()
    return _figures(row, _events(events), t_kill, done, step_s)


def _figures(row: str, ev: list[dict], t_kill: float, done: int, step_s: float) -> dict:
    """The failure's parts from the ranks' events (round 1: the restarted ranks)."""
    after = [e for e in ev if e["round"] == 1]

    def first(name: str) -> float:
        return min(e["t"] for e in after if e["event"] == name)

    def last(name: str) -> float:
        return max(e["t"] for e in after if e["event"] == name)

    in_flight = done + 1
    restored = min(e["iteration"] for e in after if e["event"] == "restored")
    # back where it was: the first iteration at or past the one in flight, done by every rank (the
    # restore may start past it: its commit can leave before the rank logs the step)
    later = [e for e in after if e["event"] == "step" and e["it"] >= in_flight]
    if not later:
        raise RuntimeError(f"{row}: the restarted ranks never reached iteration {in_flight} (killed in it)")
    back = min(e["it"] for e in later)
    redone = max(e["t"] for e in later if e["it"] == back)
    attached = last("attached") if any(e["event"] == "attached" for e in after) else last("restored")
    saves = [e["seconds"] for e in ev if e["event"] == "saved" and e["round"] == 0]
    fig = {
        "row": row,
        "kill_in": in_flight,
        "restored": restored,
        "lost": max(0, done - restored),
        "total_s": redone - t_kill,
        "detect_s": first("start") - t_kill,
        "init_s": last("built") - first("start"),
        "restore_s": last("restored") - first("restore_start"),
        "attach_s": attached - last("restored"),
        "redo_s": redone - attached,
        "step_s": step_s,
        "save_s": sum(saves) / len(saves) if saves else 0.0,
        "tier": next((e.get("tier") for e in after if e["event"] == "restored"), None),
        "params": next((e["params"] for e in ev if e["event"] == "built"), None),
    }
    return fig


PARTS = ("detect_s", "init_s", "restore_s", "attach_s", "redo_s")


def run(args) -> dict:
    rows = [r for r in ROWS if not args.rows or r in args.rows.split(",")]
    names = {
        r: r.replace("every short", f"every {args.every_short}").replace("every long", f"every {args.every_long}")
        for r in rows
    }
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench_recovery-"))
    per: dict[str, list[dict]] = {names[r]: [] for r in rows}
    for rnd in range(args.repeat):
        kill_at = rng.randint(args.kill_from, args.kill_to)
        for r in rows:
            fig = run_row(r, kill_at, args, tmp / f"round{rnd}-{r.replace(' ', '_').replace(',', '')}", rng)
            fig["row"] = names[r]
            per[names[r]].append(fig)
            print(
                f"round {rnd}: {names[r]:<28} killed in {fig['kill_in']:>4}, restored {fig['restored']:>4} "
                f"({fig['tier']}), lost {fig['lost']:>3}, {fig['total_s']:.2f} s",
                flush=True,
            )
    keys = ("total_s", "lost", *PARTS, "step_s", "save_s")
    summary_rows = {
        name: {k: sum(f[k] for f in figs) / len(figs) for k in keys} | {"failures": len(figs)}
        for name, figs in per.items()
        if figs
    }
    params = next((f["params"] for figs in per.values() for f in figs), None)
    print(
        f"\nGPT {args.n_layer} layers x {args.n_embd} ({(params or 0) / 1e6:.1f}M parameters), 2 gloo ranks, "
        f"killed in iterations {args.kill_from}-{args.kill_to}"
    )
    print("| row | failure costs (s) | lost its | detect | init | restore | attach | redo | step (s) | save (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, s in summary_rows.items():
        print(
            f"| {name} | {s['total_s']:.2f} | {s['lost']:.1f} | "
            + " | ".join(f"{s[p]:.2f}" for p in PARTS)
            + f" | {s['step_s']:.3f} | {s['save_s']:.3f} |"
        )
    mem = summary_rows.get("shadow memory")
    dcp = summary_rows.get(f"dcp every {args.every_short}")
    summary = {
        "shadow_vs_dcp_short": mem["total_s"] / dcp["total_s"] if mem and dcp else None,
        "shadow_restore_share": mem["restore_s"] / mem["total_s"] if mem else None,
    }
    return {
        "rows": summary_rows,
        "failures": per,
        "summary": summary,
        "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "params": params},
        "machine": machine_info(),
    }


def plot(results: dict, path) -> bool:
    """Seconds a failure costs, per row."""
    rows = results["rows"]
    return bars(path, list(rows), [r["total_s"] for r in rows.values()], "What a failure costs", "seconds")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    doc = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
