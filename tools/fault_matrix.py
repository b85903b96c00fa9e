"""Fault matrix: run each fault scenario N times with seeded randomness and tabulate what held.

    python tools/fault_matrix.py --trials 3 --seed 0 [--scenarios a,b] [--steps 24] [--json PATH]

Every trial starts a fresh local cluster (``python -m shadow cluster workers=2``), runs the
2-rank gloo tiny trainer (``tests/helpers/tiny_trainer.py``) with the fault, restores, and
compares the final state with ``torch.equal`` to an uninterrupted run without the shadow
(one reference run per step count, cached). A scenario returns::

    exact            the final state (model, optimizer, scheduler, every rank's RNG) equals the reference
    training_failed  the run that should have reached the last iteration did not
    lost_iterations  iterations trained before the fault that the restore did not bring back
    lost_allowed     how many of those the design allows (e.g. the sender's in-flight window)
    detection_s      fault -> first coordinator status showing it (job degraded / worker not ok)
    detail           what happened, in words

Add a scenario by decorating a ``(Trial) -> dict`` function with ``@scenario``
(``tools/matrix_process.py``) or ``@net_scenario`` (``tools/matrix_net.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import matrix_net  # noqa: F401  (registers the network scenarios)
import matrix_process
import netfaults  # tools/ is on sys.path when run as a script
from faultlib import (
    NET_SCENARIOS,
    SCENARIOS,
    References,
    Trial,
    problems,
    result,
    summarize,
    table,
)


def run_trial(name: str, i: int, seed: int, steps: int, workdir: Path, refs: References) -> dict:
    tmp = workdir / f"{name}-{i}"
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        res = SCENARIOS[name](Trial(tmp, random.Random(f"{seed}:{name}:{i}"), steps, refs))
    except Exception as exc:
        res = result(
            False,
            True,
            None,
            None,
            f"trial error: {type(exc).__name__}: {str(exc)[:500]}",
            trial_error=True,
            traceback=traceback.format_exc()[-3000:],
        )
    res.update(trial=i, wall_s=round(time.monotonic() - t0, 1), dir=str(tmp))
    return res


def main(
    argv: list[str] | None = None,
    default_scenarios: str = ",".join(n for n in SCENARIOS if n not in NET_SCENARIOS),
    default_trials: int = 3,
    strict: bool = False,
) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=default_trials)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--scenarios",
        default=default_scenarios,
        help=f"comma-separated, from {list(SCENARIOS)}; 'net': every network scenario (root needed)",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default="", help="write every trial and the summary here")
    ap.add_argument("--workdir", default="", help="logs and states of every trial (default: a new temp dir)")
    ap.add_argument("--transport", choices=("zmq", "ucx"), default="zmq", help="the data path (transport.data)")
    ap.add_argument(
        "--strict",
        action="store_true",
        default=strict,
        help="exit 1 if any restore was not exact or lost more iterations than allowed",
    )
    args = ap.parse_args(argv)
    matrix_process.CLUSTER_ARGS[:] = [f"transport.data={args.transport}"]
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    names = [m for n in names for m in (NET_SCENARIOS if n == "net" else [n])]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; known: {list(SCENARIOS)}")
    if args.steps < 8:
        ap.error(f"--steps {args.steps} is too short for the scenarios; use 8 or more")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fault_matrix-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"fault matrix: {names} x {args.trials} trials, seed {args.seed}, {args.steps} steps; logs in {workdir}",
        flush=True,
    )
    refs = References(workdir)
    t0 = time.monotonic()
    try:
        refs(args.steps)
        print(f"reference run ({args.steps} steps, no shadow): {time.monotonic() - t0:.1f} s", flush=True)
    except Exception as exc:  # every trial will record it
        print(f"reference run failed: {exc}", flush=True)
    report: dict = {
        "seed": args.seed,
        "trials": args.trials,
        "steps": args.steps,
        "workdir": str(workdir),
        "scenarios": {},
    }
    why = netfaults.unavailable()
    if why is not None and any(n in NET_SCENARIOS for n in names):
        print(f"skipping the network scenarios: {why}", flush=True)
        names = [n for n in names if n not in NET_SCENARIOS]
    for name in names:
        trials = []
        for i in range(args.trials):
            try:
                r = run_trial(name, i, args.seed, args.steps, workdir, refs)
            finally:
                if i == args.trials - 1:
                    netfaults.close_rig(name)
            trials.append(r)
            verdict = (
                "exact"
                if r["exact"]
                else "TRIAL ERROR"
                if r.get("trial_error")
                else "TRAINING FAILED"
                if r["training_failed"]
                else "NOT EXACT"
            )
            print(
                f"  {name}#{i}: {verdict}, lost {r['lost_iterations']}, detection {r['detection_s']} s, "
                f"{r['wall_s']} s: {r['detail']}",
                flush=True,
            )
        report["scenarios"][name] = {"summary": summarize(trials), "trials": trials}
    print(table({n: s["summary"] for n, s in report["scenarios"].items()}))
    bad = problems(report)
    report["problems"] = bad
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    for line in bad:
        print(f"PROBLEM {line}")
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
