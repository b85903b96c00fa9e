"""The failure-cost simulator: public scenarios, a sweep over GPU counts, shadow sizing
over model sizes, and how sensitive the answer is to each input.

    python tools/plan_failures.py [--out docs/plan] [--trials 4] [--days 30]

Writes ``<out>/plan.json`` and, with matplotlib (``pip install -e .[bench]``),
``lost_gpu_hours_vs_gpus.png`` and ``shadow_cores_vs_model_size.png``. Every figure is
computed twice: analytically (Daly's expected-time formula at the Young/Daly interval) and
by the seeded discrete-event simulation. One scenario at a time: ``shadow plan``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from shadow.cli._compose import compose, split
from shadow.planner import (
    PlanConfig,
    analyse,
    break_even_overhead,
    plan,
    simulate_many,
    size,
    strategies,
)
from shadow.planner.config import LLAMA3_GPU_MTBF_H
from shadow.planner.model import breakdown

ROOT = Path(__file__).resolve().parents[1]

SCENARIOS = ("plan_llama3_405b", "plan_100k_hourly")
GPUS = (256, 1024, 4096, 16384, 32768, 65536, 131072, 262144)
SENSITIVITY = {  # key -> (low, high) multipliers or values
    "gpu_mtbf_h": (0.5, 2.0),
    "restart_s": (0.25, 3.0),
    "iteration_s": (0.5, 2.0),
    "params": (0.5, 2.0),
    "sync.write_GBps": (0.5, 2.0),
    "tiered.write_GBps": (0.5, 2.0),
    "tiered.snapshot_GBps_per_gpu": (0.25, 4.0),
    "tiered.overhead": ("=0.0", "=0.02"),
    "shadow.overhead": ("=0.0", "=0.02"),
    "shadow.lag_iterations": ("=0", "=3"),
}


def scenario(name: str) -> PlanConfig:
    return compose("plan", split(["--config-dir", str(ROOT / "configs"), "--config-name", name]))


def with_value(cfg: PlanConfig, key: str, how) -> PlanConfig:
    """``cfg`` with ``key`` scaled by ``how`` (a number) or set to it (``"=v"``)."""
    parts = key.split(".")
    if len(parts) == 1:
        old = getattr(cfg, key)
        new = type(old)(float(how[1:]) if isinstance(how, str) else old * how)
        return dataclasses.replace(cfg, **{key: new})
    sub = getattr(cfg, parts[0])
    old = getattr(sub, parts[1])
    new = type(old)(float(how[1:]) if isinstance(how, str) else old * how)
    return dataclasses.replace(cfg, **{parts[0]: dataclasses.replace(sub, **{parts[1]: new})})


def sweep_gpus(base: PlanConfig, trials: int, days: float) -> list[dict]:
    rows = []
    restore = None
    for n in GPUS:
        cfg = dataclasses.replace(base, gpus=n, gpu_mtbf_h=LLAMA3_GPU_MTBF_H, job_mtbf_h=0.0)
        restore = size(cfg)["restore_GBps"]
        ana = analyse(cfg, restore)
        row = {
            "gpus": n,
            "job_mtbf_h": cfg.mtbf_s / 3600,
            "break_even_shadow_overhead": break_even_overhead(cfg, restore),
        }
        for name, st in strategies(cfg, restore).items():
            sim = simulate_many(st, cfg.mtbf_s, days * 86400, trials, cfg.seed)
            row[name] = {
                "lost_gpu_h_per_day": ana[name]["lost_gpu_h_per_day"],
                "simulated_lost_gpu_h_per_day": n * 24 * (1 - sim["useful"]),
                "breakdown": breakdown(st, cfg.mtbf_s),
                "dominant": ana[name]["dominant"],
            }
        rows.append(row)
    return rows


def cores_by_model(base: PlanConfig) -> dict:
    sizes = (1e9, 7e9, 13e9, 70e9, 175e9, 405e9, 1e12, 2e12)
    out = {}
    for it in (2.0, 6.0, 20.0):
        out[str(it)] = [
            {
                "params": p,
                **{
                    k: v
                    for k, v in size(dataclasses.replace(base, params=p, iteration_s=it)).items()
                    if k in ("cores", "memory_GB", "network_GBps", "hosts", "limited_by")
                },
            }
            for p in sizes
        ]
    return out


def sensitivity(base: PlanConfig) -> list[dict]:
    restore = size(base)["restore_GBps"]
    ref = analyse(base, restore)
    rows = []
    for key, (lo, hi) in SENSITIVITY.items():
        for how in (lo, hi):
            cfg = with_value(base, key, how)
            r = size(cfg)["restore_GBps"]
            res = analyse(cfg, r)
            rows.append(
                {
                    "key": key,
                    "change": how if isinstance(how, str) else f"x{how}",
                    **{n: res[n]["lost_gpu_h_per_day"] / ref[n]["lost_gpu_h_per_day"] for n in res},
                    "break_even_shadow_overhead": break_even_overhead(cfg, r),
                }
            )
    return rows


def plot(out: Path, sweep: list[dict], cores: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no plots", file=sys.stderr)
        return []
    made = []
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    gpus = [r["gpus"] for r in sweep]
    for name, color in (("sync", "tab:blue"), ("async", "tab:orange"), ("shadow", "tab:green")):
        ax.plot(gpus, [r[name]["lost_gpu_h_per_day"] for r in sweep], "-", color=color, label=f"{name} (analytic)")
        ax.plot(
            gpus,
            [r[name]["simulated_lost_gpu_h_per_day"] for r in sweep],
            "o",
            color=color,
            ms=4,
            label=f"{name} (simulated)",
        )
        bx.plot(
            gpus,
            [r[name]["breakdown"]["restart"] / sum(r[name]["breakdown"].values()) for r in sweep],
            "o-",
            color=color,
            label=name,
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="GPUs (per-GPU MTBF of Llama 3's run)",
        ylabel="lost GPU-hours / day",
        title="Cost of failures, 405B model, 6 s iterations",
    )
    ax.legend(fontsize=7)
    bx.axhline(0.5, color="grey", lw=0.8, ls="--")
    bx.set(
        xscale="log",
        ylim=(0, 1),
        xlabel="GPUs",
        ylabel="share of the loss spent restarting",
        title="The restart-dominant regime",
    )
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "lost_gpu_hours_vs_gpus.png", dpi=110)
    plt.close(fig)
    made.append("lost_gpu_hours_vs_gpus.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for it, rows in cores.items():
        ax.plot([r["params"] / 1e9 for r in rows], [r["cores"] for r in rows], "o-", label=f"{it} s / iteration")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="model parameters (B)",
        ylabel="shadow cores (with headroom)",
        title="Shadow cores needed (measured CPU-s per iteration per B params)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "shadow_cores_vs_model_size.png", dpi=110)
    plt.close(fig)
    made.append("shadow_cores_vs_model_size.png")
    return made


def print_storage(s: dict) -> None:
    """One scenario's storage side: each tier, then which tier a restore reads after each failure."""
    m = s["memory"]
    print(f"  storage: memory {m['bytes'] / 1e12:.2f} TB, restore {m['restore_s']:.1f} s")
    for name in ("local", "remote"):
        t = s.get(name)
        if t is None:
            continue
        took = t.get("write_s", t.get("upload_s"))
        print(
            f"    {name:<6} every {t['every_n']} it ({t['interval_s'] / 60:.0f} min): {t['bytes'] / 1e12:.2f} TB, "
            f"held {t['held_bytes'] / 1e12:.2f} TB, needs {t['needed_GBps']:.2f} GB/s, "
            f"{'write' if name == 'local' else 'upload'} {took:.1f} s, restore {t['restore_s']:.1f} s"
        )
    for row in s["after"]:
        tier = row["tier"] or "none"
        lost = f"{row['lost_iterations']:.0f}/{row['lost_iterations_max']:.0f} it" if row["tier"] else "-"
        print(f"    after {row['failure']}: {tier}, lost {lost}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "plan"))
    ap.add_argument("--trials", type=int, default=4, help="simulated trials per point")
    ap.add_argument("--days", type=float, default=30.0, help="simulated days per trial in the sweep")
    args = ap.parse_args()
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"scenarios": {}, "command": "python tools/plan_failures.py " + " ".join(sys.argv[1:])}
    for name in SCENARIOS:
        r = plan(scenario(name))
        result["scenarios"][name] = r
        print(f"== {name}: {r['scenario']['gpus']} GPUs, MTBF {r['scenario']['job_mtbf_h']:.2f} h")
        for s in ("sync", "async", "shadow"):
            a, m = r["analytic"][s], r["simulated"][s]
            print(
                f"  {s:<7} useful {a['useful']:.4f} (sim {m['useful']:.4f} ± {m['useful_std']:.4f}, "
                f"{m['failures_per_trial']:.0f} failures/trial)  lost {a['lost_gpu_h_per_day']:>10,.0f} GPU-h/day  "
                f"dominant: {a['dominant']}"
            )
        be = r["break_even_shadow_overhead"]
        print(
            f"  shadow break-even step overhead: {'-' if be is None else f'{be * 100:.2f}%'} (used: "
            f"{r['scenario']['shadow_overhead'] * 100:.2f}%, {r['scenario']['shadow_overhead_source']}); cluster "
            f"{r['sizing']['hosts']} hosts ({r['sizing']['limited_by']}-bound), {r['sizing']['cores']:.0f} cores"
        )
        print_storage(r["storage"])
    base = scenario("plan_llama3_405b")
    result["sweep_gpus"] = sweep_gpus(base, args.trials, args.days)
    print("\n== GPUs (Llama 3 per-GPU MTBF), lost GPU-h/day analytic [simulated], restart share of the loss")
    for r in result["sweep_gpus"]:
        cells = "  ".join(
            f"{s} {r[s]['lost_gpu_h_per_day']:>9,.0f} [{r[s]['simulated_lost_gpu_h_per_day']:>9,.0f}] "
            f"{r[s]['breakdown']['restart'] / sum(r[s]['breakdown'].values()):.0%}"
            for s in ("sync", "async", "shadow")
        )
        print(f"  {r['gpus']:>7}  MTBF {r['job_mtbf_h']:7.2f} h  {cells}")
    result["cores_by_model"] = cores_by_model(base)
    result["sensitivity"] = sensitivity(base)
    print("\n== sensitivity (Llama 3 scenario): lost GPU-h/day relative to the fixture's, break-even shadow overhead")
    for r in result["sensitivity"]:
        be = r["break_even_shadow_overhead"]
        print(
            f"  {r['key']:<30} {r['change']:>7}  sync {r['sync']:.2f}  async {r['async']:.2f}  shadow {r['shadow']:.2f}"
            f"  break-even {'-' if be is None else f'{be * 100:.2f}%'}"
        )
    result["plots"] = plot(out, result["sweep_gpus"], result["cores_by_model"])
    result["wall_s"] = time.monotonic() - t0
    (out / "plan.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out / 'plan.json'} and {result['plots']} in {result['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
