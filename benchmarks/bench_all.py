"""Run the performance benchmarks as one set and write a report: every figure, the goal
beside it, and the machine it ran on.

    python benchmarks/bench_all.py [--out docs/bench] [--only overhead,replay,...] [--full] [--list]
    python benchmarks/bench_all.py --smoke     # every benchmark at toy sizes, in a temp dir

Runs every benchmark of ``REGISTRY``, each in its own process (``python
benchmarks/bench_<name>.py ... --json <out>/<name>.json``: numba's thread count is fixed
when it loads, bench_apply re-executes its process, and each starts with clean memory):
trainer overhead (bench_overhead), replay vs torch fused and the bandwidth baselines
(bench_replay), the worker's apply path (bench_apply), transport vs bare pyzmq
(bench_transport), restore vs DCP load (bench_restore), scaling and sizing
(bench_scaling), compression of persisted shards (bench_compress), shard writes vs raw
O_DIRECT and torch.save (bench_persist), replicas' cost and heal (bench_replicas), jobs on one
shared cluster against each alone on its share (bench_shared), what a
failure costs from the kill to training again against DCP and torch.save (bench_recovery), what
strangers with no key cost a keyed worker (bench_attack), and the
GPU set (bench_gpu, skipped where torch sees no CUDA device). After each it prints every
figure of the benchmark's ``GOALS`` with its goal and PASS / MISS; at the end
``<out>/REPORT.md`` (all of them, the printed tables, the commands) and, when matplotlib
is installed (``pip install -e .[bench]``), each benchmark's ``plot`` beside it. The
default sizes (each module's ``ARGS_QUICK``) keep the whole set around 10 minutes on a
2-core machine; ``--full`` uses ``ARGS_FULL`` (mostly each benchmark's own, larger,
defaults); ``--only`` writes ``REPORT-partial.md`` (the JSON of the benchmarks it runs is
replaced; ``REPORT.md`` stays the last full set's). ``--smoke`` runs ``ARGS_SMOKE``: toy
sizes that only show every benchmark, goal and plot still work (a few minutes in all;
its report goes to a temp dir unless ``--out`` says otherwise; CI runs it, ``.ci/run``). The exit
status is 1 when a benchmark failed (exited non-zero, e.g. a restore that is not bit-identical,
or wrote no figures), not when a goal is missed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import Verdict, check, fmt, machine_info, print_verdicts

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

# the benchmarks, in the order they run (apply before scaling: scaling reads apply.json);
# each module has parser / run / GOALS / plot / ARGS_QUICK / ARGS_FULL (see benchlib)
REGISTRY = [
    "bench_overhead",
    "bench_replay",
    "bench_apply",
    "bench_transport",
    "bench_restore",
    "bench_scaling",
    "bench_compress",
    "bench_persist",
    "bench_replicas",
    "bench_shared",
    "bench_recovery",
    "bench_attack",
    "bench_fsdp",
    "bench_gpu",
]


def short(module: str) -> str:
    """``bench_overhead`` -> ``overhead`` (the name of its JSON, plot and ``--only``)."""
    return module.removeprefix("bench_")


NAMES = {short(m): m for m in REGISTRY}


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def plots(out: Path, mods: dict, data: dict) -> list[str]:
    """Each benchmark's plot as ``<out>/<name>.png``; the names written."""
    made = []
    for name, d in data.items():
        try:
            if mods[name].plot(d, out / f"{name}.png"):
                made.append(f"{name}.png")
        except Exception as exc:  # a plot is never worth losing the report for
            print(f"{name}: no plot ({type(exc).__name__}: {exc})", file=sys.stderr)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="where the JSON, plots and report go (default docs/bench)")
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(NAMES))
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="each benchmark's ARGS_FULL (larger sizes)")
    size.add_argument("--smoke", action="store_true", help="each benchmark's ARGS_SMOKE (toy sizes, a temp dir)")
    ap.add_argument("--list", action="store_true", help="print the registry, arguments and goals; run nothing")
    args = ap.parse_args(argv)

    names = [n for n in args.only.split(",") if n] or list(NAMES)
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; choose from {sorted(NAMES)}")
    mods = {n: importlib.import_module(NAMES[n]) for n in names}
    kind = "ARGS_FULL" if args.full else "ARGS_SMOKE" if args.smoke else "ARGS_QUICK"
    if args.list:
        for n, mod in mods.items():
            bench_args = getattr(mod, kind)
            print(f"{n}: python benchmarks/{NAMES[n]}.py {' '.join(bench_args)}".rstrip())
            for g in mod.GOALS:
                print(f"    {g.name} [{g.key}] {g.goal or '(figure only)'}")
        return 0
    if args.out:
        out = Path(args.out)
    elif args.smoke:
        out = Path(tempfile.mkdtemp(prefix="bench_all-smoke-"))
    else:
        out = ROOT / "docs" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    machine = machine_info()
    has_cuda = cuda_available()
    data, tables, commands, seconds = {}, {}, {}, {}
    verdicts: dict[str, list[Verdict]] = {}
    skipped: dict[str, str] = {}
    exited: dict[str, int] = {}  # benchmarks that exited non-zero (they failed, figures or not)
    for name in names:
        mod = mods[name]
        if getattr(mod, "NEEDS_CUDA", False) and not has_cuda:
            skipped[name] = "no CUDA device"
            print(f"== {name}: skipped (no CUDA device)", flush=True)
            continue
        script = f"{NAMES[name]}.py"
        bench_args = list(getattr(mod, kind))
        extra = ["--apply-json", str(out / "apply.json")] if name == "scaling" else []
        cmd = [sys.executable, str(HERE / script), *bench_args, *extra, "--json", str(out / f"{name}.json")]
        shown = os.path.relpath(out / f"{name}.json", ROOT)
        shown_extra = ["--apply-json", os.path.relpath(out / "apply.json", ROOT)] if extra else []
        commands[name] = "python benchmarks/" + " ".join([script, *bench_args, *shown_extra, "--json", shown])
        print(f"== {name}: {commands[name]}", flush=True)
        (out / f"{name}.json").unlink(missing_ok=True)  # a failed run must not pass with the last run's figures
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        seconds[name] = time.monotonic() - t0
        tables[name] = proc.stdout
        print(proc.stdout, flush=True)
        if proc.returncode != 0:
            exited[name] = proc.returncode
            print(proc.stderr[-4000:], file=sys.stderr)
            print(f"{name}: exited with status {proc.returncode}", file=sys.stderr)
            tables[name] += f"\n(exit status {proc.returncode})\n"
        try:
            data[name] = json.loads((out / f"{name}.json").read_text())
        except (OSError, ValueError):
            print(f"{name}: no JSON written", file=sys.stderr)
            continue
        verdicts[name] = check(mod.GOALS, data[name])
        print_verdicts(verdicts[name], f"-- {name}: goals ({seconds[name]:.0f} s)")
        print(flush=True)
    pngs = plots(out, mods, data)
    about = (
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine.get('memory_GiB')} GiB, "
        f"load {machine['loadavg_1m_at_start']:.2f} at start; Python {machine['python']}, torch "
        f"{machine.get('torch')}, numba {machine.get('numba')}, pyzmq {machine['pyzmq']} (libzmq "
        f"{machine['libzmq']}). The shadow's workers share the cores with the trainer ranks."
    )
    flag = " --full" if args.full else " --smoke" if args.smoke else ""
    made = f"Produced by `python benchmarks/bench_all.py{flag}` in {time.monotonic() - started:.0f} s."
    lines = [
        f"# Benchmark report ({datetime.date.today().isoformat()})",
        "",
        about,
        made,
        "",
        "| benchmark | figure | value | goal | met |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        if name in skipped:
            lines.append(f"| {name} | (skipped: {skipped[name]}) | | | |")
            continue
        if name not in verdicts:
            lines.append(f"| {name} | (failed) | | | MISS |")
            continue
        if name in exited:
            lines.append(f"| {name} | (failed: exit status {exited[name]}) | | | MISS |")
        for v in verdicts[name]:
            lines.append(f"| {name} | {v.name} | {fmt(v.value, v.goal.unit)} | {v.goal.goal} | {v.status} |")
    for name in names:
        if name in seconds:
            lines += ["", f"## {name} ({seconds[name]:.0f} s)", "", f"`{commands[name]}`", "", tables[name].strip()]
    if pngs:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in pngs]
    report = out / ("REPORT-partial.md" if args.only else "REPORT.md")  # a subset never replaces the full report
    report.write_text("\n".join(lines) + "\n")
    every = [v for vs in verdicts.values() for v in vs if v.status]
    failed = [n for n in names if n in exited or (n not in data and n not in skipped)]
    print(
        f"goals: {sum(v.status == 'PASS' for v in every)} PASS, {sum(v.status == 'MISS' for v in every)} MISS, "
        f"{sum(v.status == 'n/a' for v in every)} not measured; failed: "
        f"{', '.join(failed) or 'none'}"
    )
    print(f"report: {report} ({time.monotonic() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
