"""What ``shadow plan`` prints: every strategy side by side, the cluster it needs, its
storage tiers and, for a mix of jobs, each job's part of a shared cluster."""

from __future__ import annotations

from rich.table import Table

from shadow.cli._render import _dur, stdout_console


def render_plan(r: dict) -> None:
    """``shadow plan``: the scenario, every strategy side by side, the break-even and the sizing."""
    console = stdout_console()
    sc = r["scenario"]
    console.print(
        f"[bold]{sc['name'] or 'scenario'}[/bold]: {sc['gpus']} GPUs, job MTBF {sc['job_mtbf_h']:.2f} h "
        f"({sc['failures_per_day']:.1f} failures/day), {sc['params'] / 1e9:.0f}B params, state "
        f"{sc['state_TB']:.2f} TB, {sc['iteration_s']} s/iteration, restart {_dur(sc['restart_s'])} + load"
    )
    t = Table(title="expected cost of failures, per strategy")
    for col in (
        "strategy",
        "interval",
        "stall / ckpt",
        "restorable after",
        "restart + load",
        "useful (analytic)",
        "useful (simulated)",
        "lost GPU-h/day",
        "dominant cost",
    ):
        t.add_column(col, justify="left" if col in ("strategy", "dominant cost") else "right")
    sim = r.get("simulated", {})
    for name, a in r["analytic"].items():
        st = a["strategy"]
        s = sim.get(name)
        simulated = f"{s['useful']:.4f} ± {s['useful_std']:.4f}" if s else "-"
        lost = f"{a['lost_gpu_h_per_day']:,.0f}" + (f" ({s['lost_gpu_h_per_day']:,.0f})" if s else "")
        t.add_row(
            name,
            _dur(st["work_s"]),
            _dur(st["stall_s"]),
            _dur(st["delay_s"]),
            _dur(st["restart_s"]),
            f"{a['useful']:.4f}",
            simulated,
            lost,
            a["dominant"],
        )
    console.print(t)
    console.print(
        "lost GPU-h/day: analytic (simulated); interval = training between checkpoints; dominant cost "
        "= the largest of checkpoint overhead, rework after failures, restarts"
    )
    be = r["break_even_shadow_overhead"]
    console.print(
        "shadow loses less than the better alternative while its step overhead stays below "
        + (f"[bold]{be * 100:.2f}%[/bold]" if be is not None else "[red]0% (it cannot win here)[/red]")
    )
    z = r["sizing"]
    t = Table(title="shadow cluster")
    for col in ("cores", "memory", "network in", "hosts", "limited by", "trainer egress / GPU", "measured CPU"):
        t.add_column(col, justify="right")
    t.add_row(
        f"{z['cores']:.0f}",
        f"{z['memory_GB'] / 1e3:.1f} TB",
        f"{z['network_GBps']:.1f} GB/s",
        str(z["hosts"]),
        z["limited_by"],
        f"{z['trainer_egress_MBps_per_gpu']:.1f} MB/s",
        f"{z['cpu_s_per_iter_per_Bparams']:.2f} CPU-s/it/B ({z['measured_in']})",
    )
    console.print(t)
    par = z["parallelism"]
    per, boot = par["bytes_per_rank_per_iter"] / 1e6, par["bootstrap_bytes_per_rank"] / 1e6
    console.print(
        f"dp {par['dp']} x tp {par['tp']} x pp {par['pp']}: each rank streams {per:.1f} MB per iteration "
        f"(its unique share, {par['stream_starts']}), {boot:.1f} MB at attach"
    )
    console.print(f"shadow step overhead {sc['shadow_overhead'] * 100:.2f}% ({sc['shadow_overhead_source']})")
    _render_storage(console, r["storage"])
    if "mix" in r:
        _render_mix(console, r["mix"])


def _render_mix(console, m: dict) -> None:
    """``shadow plan mix=[...]``: each job's part of the shared cluster, and the cluster."""
    t = Table(title=f"a shared shadow cluster: {len(m['jobs'])} jobs at once")
    for col in ("job", "params", "cores (needed)", "share", "memory", "per host", "network in"):
        t.add_column(col, justify="left" if col == "job" else "right")
    for j in m["jobs"]:
        t.add_row(
            j["name"],
            f"{j['params'] / 1e9:.1f}B",
            f"{j['cores']:.1f} ({j['cores_needed']:.1f})",
            f"{j['share'] * 100:.0f}%",
            f"{j['memory_GB']:.1f} GB",
            f"{j['cores_per_host']:.1f} cores, {j['memory_GB_per_host']:.1f} GB",
            f"{j['network_GBps']:.2f} GB/s",
        )
    console.print(t)
    console.print(
        f"{m['hosts']} hosts (limited by {m['limited_by']}): {m['cores']:.0f} cores, {m['memory_GB']:.0f} GB "
        f"(with {m['job_worker_fixed_GB']} GB per job worker), {m['network_GBps']:.1f} GB/s in; "
        f"{m['cpu_s_per_iter_per_Bparams']:.2f} CPU-s/it/B ({m['measured_in']})"
    )


def _render_storage(console, s: dict) -> None:
    """The storage side of ``shadow plan``: each tier's bytes, cadence, bandwidth and
    restore time, then which tier serves a restore after each kind of failure."""
    t = Table(title="storage tiers")
    for col in ("tier", "every", "bytes / checkpoint", "held", "needed", "write / upload", "restore"):
        t.add_column(col, justify="left" if col == "tier" else "right")
    m = s["memory"]
    t.add_row("memory", "iteration", f"{m['bytes'] / 1e12:.2f} TB", "-", "-", "-", _dur(m["restore_s"]))
    for name in ("local", "remote"):
        x = s.get(name)
        if x is None:
            continue
        need = f"{x['needed_GBps']:.1f} GB/s" + (
            f" ({x['needed_GBps_per_host']:.2f}/host)" if "needed_GBps_per_host" in x else ""
        )
        took = x.get("write_s", x.get("upload_s", 0.0))
        t.add_row(
            name,
            f"{x['every_n']} it ({_dur(x['interval_s'])})",
            f"{x['bytes'] / 1e12:.2f} TB",
            f"{x['held_bytes'] / 1e12:.2f} TB",
            need,
            _dur(took) + ("" if x["fits"] else " [red](longer than the interval)[/red]"),
            _dur(x["restore_s"]),
        )
    console.print(t)
    t = Table(title="which tier a restore reads")
    for col in ("failure", "tier", "lost iterations (mean / max)", "read state"):
        t.add_column(col, justify="left" if col in ("failure", "tier") else "right")
    for row in s["after"]:
        if row["tier"] is None:
            t.add_row(row["failure"], "[red]none[/red]", "-", "-")
        else:
            t.add_row(
                row["failure"],
                row["tier"],
                f"{row['lost_iterations']:.0f} / {row['lost_iterations_max']:.0f}",
                _dur(row["restore_s"]),
            )
    console.print(t)
    console.print(f"object store: stored / plain {s['remote_ratio']:.2f} ({s['remote_ratio_source']})")
