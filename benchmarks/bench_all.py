"""Run the performance benchmarks as one set and write a report: every figure, the goal
beside it, and the machine it ran on.

    python scripts/bench_all.py [--out docs/bench] [--only overhead,replay,...] [--full]

Runs, each in its own process, writing ``<out>/<name>.json`` and its printed table:
trainer overhead (bench_overhead), replay vs torch fused and the bandwidth baselines
(bench_replay), the worker's apply path before/after applying from frames
(bench_apply), transport vs bare pyzmq (bench_transport), restore vs DCP load
(bench_restore), scaling and sizing (bench_scaling), compression of persisted shards
(bench_compress). Then ``<out>/REPORT.md`` and, when
matplotlib is installed (``pip install -e .[bench]``), PNG plots beside it. The default
sizes keep the whole set under ~9 minutes on a 2-core machine; ``--full`` uses each
benchmark's own (larger) defaults; ``--only`` writes ``REPORT-partial.md`` (the JSON of
the benchmarks it runs is replaced; ``REPORT.md`` stays the last full set's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (script, arguments of the default set, arguments with --full)
BENCHES = {
    "overhead": (
        "bench_overhead.py",
        ["--steps", "8", "--rounds", "2", "--n-layer", "8", "--n-embd", "576"],
        ["--steps", "20", "--rounds", "3", "--n-layer", "8", "--n-embd", "576"],
    ),
    "replay": ("bench_replay.py", ["--params", "50e6", "--repeat", "15"], ["--repeat", "31"]),
    "apply": ("bench_apply.py", ["--params", "20e6", "--iters", "5"], []),
    "transport": ("bench_transport.py", [], []),
    "restore": ("bench_restore.py", ["--no-evict", "--repeat", "5"], []),
    "scaling": ("bench_scaling.py", ["--quick"], []),
    "compress": ("bench_compress.py", ["--repeat", "3"], ["--repeat", "5"]),
}


def goals(name: str, d: dict) -> list[tuple[str, str, str, bool | None]]:
    """``(figure, value, goal, met)`` rows of one benchmark's JSON."""
    rows = []
    if name == "overhead":
        r = d["results"]
        base = r["none"]["s_per_step"]
        for mode in r:
            if mode != "none":
                ratio = r[mode]["s_per_step"] / base
                goal = "<= 1.05x" if mode == "shadow" else ""
                rows.append(
                    (f"step time, {mode} / none", f"{ratio:.3f}x", goal, ratio <= 1.05 if mode == "shadow" else None)
                )
        if "shadow" in r and "dcp_async" in r:
            sh, dc = r["shadow"]["s_per_step"] - base, r["dcp_async"]["s_per_step"] - base
            if dc > 0:
                rows.append(("shadow overhead / DCP async_save overhead", f"{sh / dc:.2f}", "<= 0.2", sh / dc <= 0.2))
    elif name == "replay":
        rows.append(
            ("replay vs torch AdamW(fused)", f"{d['shadow_vs_torch']:.2f}x", ">= 0.95x", d["shadow_vs_torch"] >= 0.95)
        )
        rows.append(
            (
                "replay GB/s vs the Adam-traffic stream",
                f"{d['shadow_vs_stream_bw']:.2f}",
                ">= 0.9",
                d["shadow_vs_stream_bw"] >= 0.9,
            )
        )
        for rule in ("cuda_fused", "cuda_foreach"):
            if f"{rule}_vs_torch" in d:
                rows.append(
                    (
                        f"replay, {rule} rule vs torch AdamW(fused)",
                        f"{d[f'{rule}_vs_torch']:.2f}x",
                        ">= 0.95x",
                        d[f"{rule}_vs_torch"] >= 0.95,
                    )
                )
        rows.append(("replay bit-identical to torch", str(d["bit_identical"]), "True", bool(d["bit_identical"])))
    elif name == "apply":
        for path in ("after", "after+snapshot"):
            p, b = d["paths"][path], d["paths"][path.replace("after", "before")]
            rows.append(
                (f"worker CPU / iteration, {path} vs before", f"{p['cpu_speedup_vs_before']:.2f}x faster", "", None)
            )
            rows.append(
                (f"bytes moved / param, {path}", f"{p['bytes_per_param']} (was {b['bytes_per_param']})", "", None)
            )
        rows.append(
            (
                "worker CPU-s / iteration / B params",
                f"{d['paths']['after']['cpu_s_per_iter_per_Bparams']:.2f}",
                "",
                None,
            )
        )
        if "whole_path_vs_replay_alone" in d:
            r = d["whole_path_vs_replay_alone"]
            rows.append(("whole worker path / replay alone (CPU-s, same threads)", f"{r:.2f}x", "<= 1.25x", r <= 1.25))
    elif name == "transport":
        for r in d["rows"]:
            rows.append(
                (
                    f"{r['transport']} {r['shape']}: shadow (zero-copy) / bare pyzmq",
                    f"{r['zc_vs_bare']:.2f}x",
                    ">= 0.8x",
                    r["zc_vs_bare"] >= 0.8,
                )
            )
    elif name == "restore":
        for r in d["rows"]:
            if r["path"].startswith("shadow"):
                goal = "<= 0.5x" if "local" in r["path"] else "<= 1.0x"
                lim = 0.5 if "local" in r["path"] else 1.0
                rows.append(
                    (
                        f"restore {r['path']} / DCP load",
                        f"{r['vs_dcp_load']:.2f}x ({r['median_s']:.3f} s)",
                        goal,
                        r["vs_dcp_load"] <= lim,
                    )
                )
    elif name == "scaling":
        for kind in ("threads", "workers"):
            for n, r in d[kind].items():
                rows.append((f"replay speedup, {n} {kind}", f"{r['speedup']:.2f}x", "", None))
        s = d["sizing"]
        per_b = s["worker_path_cpu_s_per_iter_per_Bparams"] or s["replay_cpu_s_per_iter_per_Bparams"]
        rows.append(("shadow CPU-s per iteration per B params", f"{per_b:.2f}", "", None))
    elif name == "compress":
        for codec in ("zstd-1", "planes-1", "planes-3"):
            r = d["shard"][codec]
            rows.append(
                (
                    f"persisted shard, {codec}: ratio, compress / decompress MB/s",
                    f"{r['ratio']:.3f}, {r['compress_MBps']:.0f} / {r['decompress_MBps']:.0f}",
                    "",
                    None,
                )
            )
    return rows


def plots(out: Path, data: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)

    if "overhead" in data:
        r = data["overhead"]["results"]
        base = r["none"]["s_per_step"]
        fig, ax = plt.subplots(figsize=(6, 3.2))
        modes = list(r)
        vals = [r[m]["s_per_step"] / base for m in modes]
        ax.bar(
            modes, vals, color=["grey" if m == "none" else "tab:green" if m == "shadow" else "tab:blue" for m in modes]
        )
        ax.axhline(1.05, color="red", lw=0.8, ls="--", label="goal 1.05x")
        ax.set_ylabel("step time / no checkpoint")
        ax.set_title(f"Trainer overhead, GPT {data['overhead']['params'] / 1e6:.0f}M, 2 gloo ranks")
        ax.legend()
        save(fig, "overhead.png")
    if "transport" in data:
        rows = data["transport"]["rows"]
        fig, ax = plt.subplots(figsize=(7, 3.4))
        labels = [f"{r['transport']}\n{r['shape']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["bare_GBps"] for r in rows], 0.4, label="bare pyzmq")
        ax.bar([i + 0.2 for i in x], [r["shadow_zc_GBps"] for r in rows], 0.4, label="shadow (framed, checked)")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel("GB/s")
        ax.set_title("Gradient transport, one sender -> one worker")
        ax.legend(fontsize=8)
        save(fig, "transport.png")
    if "apply" in data:
        p = data["apply"]["paths"]
        names = ["before", "after", "before+snapshot", "after+snapshot"]
        fig, ax1 = plt.subplots(figsize=(6, 3.2))
        ax1.bar(
            names, [p[n]["cpu_s_per_iter_per_Bparams"] for n in names], color=["grey", "tab:green", "grey", "tab:green"]
        )
        for i, n in enumerate(names):
            ax1.text(
                i,
                p[n]["cpu_s_per_iter_per_Bparams"],
                f"{p[n]['bytes_per_param']} B/param",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax1.set_ylabel("worker CPU-s / iteration / B params")
        ax1.set_title("Apply from frames, snapshot in the apply pass")
        save(fig, "apply.png")
    if "scaling" in data:
        d = data["scaling"]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for kind in ("threads", "workers"):
            ns = [int(n) for n in d[kind]]
            ax.plot(ns, [d[kind][str(n) if str(n) in d[kind] else n]["Mparams_per_s"] for n in ns], "o-", label=kind)
        ax.set_xlabel("threads (one worker) / workers (one thread each)")
        ax.set_ylabel("M params / s")
        ax.set_title("Replay scaling on this machine")
        ax.legend()
        save(fig, "scaling.png")
    if "restore" in data:
        rows = data["restore"]["rows"]
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.barh([r["path"] for r in rows], [r["median_s"] for r in rows])
        ax.set_xlabel("seconds")
        ax.set_title(f"Restore of {data['restore']['model']['params'] / 1e6:.0f}M params + AdamW state")
        save(fig, "restore.png")
    return made


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--full", action="store_true")
    args = ap.parse_args()
    from benchlib import machine_info

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.only.split(",") if n] or list(BENCHES)
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHES)}")
    started = time.monotonic()
    machine = machine_info()
    data, tables, commands, seconds = {}, {}, {}, {}
    for name in names:
        script, quick, full = BENCHES[name]
        extra = ["--apply-json", str(out / "apply.json")] if name == "scaling" else []
        cmd = [
            sys.executable,
            str(ROOT / "scripts" / script),
            *(full if args.full else quick),
            *extra,
            "--json",
            str(out / f"{name}.json"),
        ]
        shown = os.path.relpath(out / f"{name}.json", ROOT)
        shown_extra = ["--apply-json", os.path.relpath(out / "apply.json", ROOT)] if extra else []
        commands[name] = "python scripts/" + " ".join(
            [script, *(full if args.full else quick), *shown_extra, "--json", shown]
        )
        print(f"== {name}: {commands[name]}", flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        seconds[name] = time.monotonic() - t0
        tables[name] = proc.stdout
        print(proc.stdout, flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            tables[name] += f"\n(exit status {proc.returncode})\n"
        try:
            data[name] = json.loads((out / f"{name}.json").read_text())
        except (OSError, ValueError):
            print(f"{name}: no JSON written", file=sys.stderr)
    pngs = plots(out, data)
    about = (
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine.get('memory_GiB')} GiB, "
        f"load {machine['loadavg_1m_at_start']:.2f} at start; Python {machine['python']}, torch "
        f"{machine.get('torch')}, numba {machine.get('numba')}, pyzmq {machine['pyzmq']} (libzmq "
        f"{machine['libzmq']}). The shadow's workers share the cores with the trainer ranks."
    )
    made = (
        f"Produced by `python scripts/bench_all.py{' --full' if args.full else ''}` in "
        f"{time.monotonic() - started:.0f} s."
    )
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
        for fig, val, goal, met in goals(name, data[name]) if name in data else [("(failed)", "", "", False)]:
            lines.append(f"| {name} | {fig} | {val} | {goal} | {'' if met is None else 'yes' if met else 'no'} |")
    for name in names:
        lines += ["", f"## {name} ({seconds[name]:.0f} s)", "", f"`{commands[name]}`", "", tables[name].strip()]
    if pngs:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in pngs]
    report = out / ("REPORT-partial.md" if args.only else "REPORT.md")  # a subset never replaces the full report
    report.write_text("\n".join(lines) + "\n")
    print(f"report: {report} ({time.monotonic() - started:.0f} s)")
    return 0 if all(n in data for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
