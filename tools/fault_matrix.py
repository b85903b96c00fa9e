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

Add a scenario by decorating a ``(Trial) -> dict`` function with ``@scenario``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import netfaults  # tools/ is on sys.path when run as a script
from faultlib import (
    LOST_S,
    RANKS,
    References,
    Trial,
    Watch,
    committed,
    judge_worker_fault,
    problems,
    result,
    resume_and_judge,
    settled,
    summarize,
    table,
)

from shadow.config.tuning import Tuning
from shadow.testing import LocalCluster, status

TUNING = Tuning.load()  # the knobs, as the services would read them here
#: what every trial's cluster is started with beyond its scenario's own (``--transport``)
CLUSTER_ARGS: list[str] = []


def cluster(tmp: Path, args: tuple[str, ...] = (), **kw) -> LocalCluster:
    """A trial's cluster: its scenario's arguments after :data:`CLUSTER_ARGS`."""
    return LocalCluster(tmp, args=(*CLUSTER_ARGS, *args), **kw)


ROOT = Path(__file__).resolve().parents[1]

SCENARIOS: dict[str, Callable[[Trial], dict]] = {}


def scenario(fn: Callable[[Trial], dict]) -> Callable[[Trial], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn


# -- scenarios ----------------------------------------------------------------------------------
@scenario
def trainer_kill(t: Trial) -> dict:
    """SIGKILL both ranks right after iteration k (and a short sleep); resume to the end."""
    k = t.rng.randint(2, t.steps - 1)
    with cluster(t.tmp) as c:
        codes = t.run("train", "--kill-at", str(k), "--kill-at-once", "--step-sleep", "0.05", coordinator=c)
        done = min(t.info("train", r).get("completed", 0) for r in range(RANKS))
        if codes != [-9] * RANKS:
            return result(False, True, None, None, f"kill at {k}: training exited {codes}: {t.error('train')}")
        cut = committed(settled(c))
        # the sender streams asynchronously: a SIGKILL may catch up to MAX_LAG iterations in flight
        return resume_and_judge(
            t, c, "resume", done, TUNING.max_lag_iterations, f"killed after iteration {done}, cluster committed {cut}"
        )


@scenario
def trainer_kill_mid_iteration(t: Trial) -> dict:
    """SHADOW_FAULT_DIE_AT=k:n: iteration k sends n data messages, the rest to worker 0 only,
    then the ranks die; the cluster must hold exactly k-1."""
    k, n = t.rng.randint(2, t.steps - 2), t.rng.randint(0, 3)
    with cluster(t.tmp) as c:
        codes = t.run("train", "--step-sleep", "0.05", coordinator=c, env={"SHADOW_FAULT_DIE_AT": f"{k}:{n}"})
        local = min(t.info("train", r).get("completed", 0) for r in range(RANKS))
        if 137 not in codes:
            return result(False, True, None, None, f"die at {k}:{n} did not fire: exit codes {codes}")
        cut = committed(settled(c))
        res = resume_and_judge(
            t,
            c,
            "resume",
            k - 1,
            0,
            f"died in iteration {k} after {n} messages (exit {codes}; ranks had trained "
            f"through {local} locally), cluster committed {cut}",
        )
        if cut is not None and cut >= k:
            res["exact"] = False
            res["detail"] += f"; CUT VIOLATION: committed {cut} includes the half-sent iteration {k}"
        return res


@scenario
def trainer_kill_bootstrap(t: Trial) -> dict:
    """Train to j and SIGKILL; resume, SIGKILL inside attach's bootstrap (seeded delay after
    the coordinator opened the new epoch); resume again and finish. Nothing trained between
    the two kills, so the second restore should bring back what the first did."""
    j = t.rng.randint(3, t.steps - 2)
    # about half the trials die at once after the handshake, the others up to 10 ms later (the
    # tiny model's bootstrap commits 2-5 ms after the handshake, so some land just after it)
    delay = t.rng.choice([0.0, round(t.rng.uniform(0.1, 10.0), 1)])
    with cluster(t.tmp) as c:
        codes = t.run("train", "--kill-at", str(j), "--kill-at-once", "--step-sleep", "0.05", coordinator=c)
        if codes != [-9] * RANKS:
            return result(False, True, None, None, f"kill at {j}: training exited {codes}: {t.error('train')}")
        st = settled(c)
        c1, epoch = committed(st), st["job"]["epoch"]
        codes = t.run("boot", "--mode", "resume", "--kill-in-bootstrap", str(delay), coordinator=c)
        boot = t.info("boot")
        st = settled(c)
        job = st["job"]
        if job["epoch"] == epoch:
            landed = "before the coordinator opened a new epoch"
        elif job["committed"] is None or job["committed"] < job["base"]:
            landed = (
                f"inside the bootstrap (epoch {job['epoch']} {job['status']}, base {job['base']}, nothing committed)"
            )
        else:
            landed = f"after the bootstrap committed {job['committed']} (phase {boot.get('phase')})"
        detail = (
            f"killed after iteration {j} (cluster committed {c1}); a resume restored {boot.get('restored')} "
            f"and was killed {delay} ms into its bootstrap (exit {codes}): landed {landed}"
        )
        allowed = j - c1 if c1 is not None else j
        res = resume_and_judge(t, c, "resume", j, allowed, detail)
        res["landed"] = landed.split(" (")[0]
        return res


@scenario
def worker_kill(t: Trial) -> dict:
    """Rank 0 SIGKILLs shadow worker 1 at iteration k; training must finish unchanged, the
    cluster restart and resync the worker, and the final restore be exact."""
    k = t.rng.randint(3, 6)
    # time after the kill for the restart (1-4 s), the resync, and one more resync if a new
    # connection loses its stream (UCX, about 1 trial in 30: docs/ucx.md)
    sleep = max(0.1, 10.0 / (t.steps - k))
    with cluster(t.tmp, env={"SHADOW_WORKER_LOST_S": LOST_S}) as c, Watch(c.address) as w:
        codes = t.run("train", "--kill-worker-at", str(k), "--step-sleep", f"{sleep:.3f}", coordinator=c)
        t_kill = t.info("train").get("worker_killed_t")
        det, what = w.detection(t_kill)
        return judge_worker_fault(t, c, codes, det, f"worker 1 SIGKILLed at iteration {k}; detected as {what}")


def _stop_worker(t: Trial, policy: str) -> dict:
    """SIGSTOP worker 0 once the cut reaches a seeded iteration, SIGCONT a few seconds later."""
    stop_at, stop_s = t.rng.randint(3, 6), round(t.rng.uniform(2.5, 3.5), 2)
    sleep = max(0.1, (stop_s + 4.0) / (t.steps - stop_at))
    with cluster(t.tmp, env={"SHADOW_WORKER_LOST_S": LOST_S}) as c, Watch(c.address) as w:
        procs = t.start("train", "--step-sleep", f"{sleep:.3f}", "--policy", policy, coordinator=c)
        victim, t_stop = None, None
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and all(p.poll() is None for p in procs):
                st = w.last
                if st and st["job"] and (committed(st) or 0) >= stop_at:
                    victim = st["workers"][0]["pid"]
                    os.kill(victim, signal.SIGSTOP)
                    t_stop = time.time()
                    break
                time.sleep(0.02)
            time.sleep(stop_s if victim else 0)
        finally:
            if victim:
                os.kill(victim, signal.SIGCONT)
        codes = t.wait(procs)
        if victim is None:
            return result(False, True, None, None, f"training never reached iteration {stop_at} ({codes})")
        det, what = w.detection(t_stop)
        return judge_worker_fault(
            t,
            c,
            codes,
            det,
            f"worker 0 SIGSTOPped (policy {policy}) at committed {stop_at} for {stop_s} s; detected as {what}",
        )


@scenario
def worker_stop(t: Trial) -> dict:
    """SIGSTOP worker 0 for a few seconds during training (policy block), then SIGCONT:
    training waits until the worker is declared lost, goes on degraded, resyncs."""
    return _stop_worker(t, "block")


@scenario
def worker_stop_skip(t: Trial) -> dict:
    """The same under policy skip: training never waits (it stops streaming once
    SHADOW_MAX_LAG ahead), the cluster resyncs after SIGCONT."""
    return _stop_worker(t, "skip")


def _restart_coordinator(t: Trial, outage_s: float, env: dict | None, k: int, step_s: float) -> dict:
    """SIGKILL the coordinator once the cut reaches iteration ``k``, start a new one on the
    same port ``outage_s`` later."""
    with cluster(t.tmp) as c:
        procs = t.start("train", "--step-sleep", f"{step_s}", coordinator=c, env=env)
        new = None
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (committed(status(c.address, 2.0)) or 0) < k:
                time.sleep(0.05)
            c.proc.kill()
            c.proc.wait()
            time.sleep(outage_s)  # the ranks train on meanwhile
            t0 = time.time()
            log = open(t.tmp / "coordinator2.log", "w")
            new = subprocess.Popen(
                [sys.executable, "-m", "shadow", "coordinator", "workers=2", f"port={c.port}", "persist.durable=false"],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
            c.proc = new  # stopped with the cluster
            rebuilt = None
            while time.monotonic() < deadline + 30 and rebuilt is None:
                with contextlib.suppress(Exception):
                    if status(c.address, 1.0)["job"]:
                        rebuilt = time.time() - t0
                time.sleep(0.05)
        finally:
            codes = t.wait(procs)
        return judge_worker_fault(
            t,
            c,
            codes,
            rebuilt,
            f"coordinator SIGKILLed at committed >= {k}, restarted "
            f"{outage_s:.1f} s later; job rebuilt from the workers in "
            f"{rebuilt} s",
        )


@scenario
def coordinator_kill(t: Trial) -> dict:
    """SIGKILL the coordinator mid-run (its workers live on) and start a new one on the same
    port within a second or so: it rebuilds the job from the workers, the ranks reconnect,
    nothing is lost, no resync. Detection column: seconds from the new coordinator's start
    to the rebuilt job."""
    return _restart_coordinator(t, t.rng.uniform(0.2, 1.5), None, t.rng.randint(3, 8), 0.25)


@scenario
def coordinator_outage(t: Trial) -> dict:
    """The same with the coordinator away longer than SHADOW_COORDINATOR_LOST_S: the ranks
    stop waiting and train on unprotected, tell the new coordinator so, and the cluster
    resyncs from their state; training is unchanged and the last iteration restorable."""
    # slower steps: training must outlast the outage, the new coordinator's start (about 1 s on
    # 2 loaded cores), the rebuild and the resync for the end to be checkpointed
    outage_s, k = t.rng.uniform(2.5, 3.5), t.rng.randint(3, 5)
    return _restart_coordinator(
        t, outage_s, {"SHADOW_COORDINATOR_LOST_S": "1.5"}, k, max(0.5, (outage_s + 5.0) / (t.steps - k))
    )


@scenario
def cluster_loss(t: Trial) -> dict:
    """SIGKILL the coordinator and every worker mid-run (policy block). The ranks hear
    nothing for SHADOW_COORDINATOR_LOST_S and train on unprotected; a new cluster on the
    same port is found by their heartbeats and they re-attach by themselves. Training must
    finish unchanged and the new cluster hold the last iteration exactly. Detection column:
    seconds from the new cluster's start to the re-attached job."""
    k, outage_s = t.rng.randint(3, 6), t.rng.uniform(2.0, 3.0)
    env = {"SHADOW_COORDINATOR_LOST_S": "1.5"}
    # slower steps: training must outlast the outage, the new cluster's start (3-4 s on 2
    # loaded cores: processes, kernels from the cache, registration) and the resync (the
    # coordinator's ask, the vote, the bootstrap) for the end to be checkpointed
    step_s = max(0.3, (outage_s + 8.0) / (t.steps - k))
    with cluster(t.tmp) as c:
        procs = t.start("train", "--step-sleep", f"{step_s:.3f}", coordinator=c, env=env)
        back = None
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (committed(status(c.address, 2.0)) or 0) < k:
                time.sleep(0.05)
            c.kill_all()
            time.sleep(outage_s)  # past SHADOW_COORDINATOR_LOST_S: the ranks go on unprotected
            t0 = time.time()
            log = open(t.tmp / "cluster2.log", "w")
            c.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shadow",
                    "cluster",
                    "workers=2",
                    f"port={c.port}",
                    "threads_per_worker=1",
                    "persist.durable=false",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
            while time.monotonic() < deadline + 60 and back is None:
                with contextlib.suppress(Exception):
                    job = status(c.address, 1.0)["job"]
                    if job and job["committed"] is not None:
                        back = time.time() - t0
                time.sleep(0.05)
        finally:
            codes = t.wait(procs)
        return judge_worker_fault(
            t,
            c,
            codes,
            back,
            f"coordinator and workers SIGKILLed at committed >= {k}, a new "
            f"cluster started; ranks re-attached after {back} s",
        )


@scenario
def network_faults(t: Trial) -> dict:
    """Seeded drop/dup/reorder/truncate/bitflip of the ranks' data messages (all but the last
    five iterations): every fault is caught, the damaged replica resyncs, nothing is wrong."""
    spec = ",".join(f"{k}=0.02" for k in ("drop", "dup", "reorder", "truncate", "bitflip"))
    spec += f",seed={t.rng.randint(0, 1 << 20)},until={t.steps - 5}"
    with cluster(t.tmp, env={"SHADOW_WORKER_LOST_S": LOST_S}) as c:
        codes = t.run("train", "--step-sleep", "0.1", coordinator=c, env={"SHADOW_FAULT_NET": spec})
        logs = "".join((t.tmp / f"train-rank{r}.log").read_text(errors="replace") for r in range(RANKS))
        injected = logs.count("fault injection: ")
        rejected: dict[str, int] = {}
        for w in settled(c)["workers"]:
            for reason, n in w["rejected"].items():
                rejected[reason] = rejected.get(reason, 0) + n
        return judge_worker_fault(t, c, codes, None, f"{injected} faults injected; workers rejected {rejected}")


@scenario
def replica_kill(t: Trial) -> dict:
    """replicas=2 (4 workers): rank 0 SIGKILLs worker 1 at iteration k; the job never
    degrades, the restarted worker copies shard 1 from worker 3 (no resync)."""
    k = t.rng.randint(3, 6)
    sleep = max(0.1, 6.0 / (t.steps - k))
    with (
        cluster(t.tmp, env={"SHADOW_WORKER_LOST_S": LOST_S}, workers=4, args=("replicas=2",)) as c,
        Watch(c.address) as w,
    ):
        codes = t.run("train", "--kill-worker-at", str(k), "--step-sleep", f"{sleep:.3f}", coordinator=c)
        det, what = w.detection(t.info("train").get("worker_killed_t"))
        res = judge_worker_fault(
            t, c, codes, det, f"worker 1 of 4 (replicas=2) SIGKILLed at iteration {k}; detected as {what}"
        )
        log = c.log.read_text(errors="replace")
        epoch = settled(c)["job"]["epoch"]
        res["detail"] += f"; peer copies {log.count('copied iteration')}"
        # the trainer re-attached once for the final restore check (epoch 2); more means a resync
        if "copied iteration" not in log or epoch > 2:
            res["exact"] = False
            res["detail"] += f"; EXPECTED a peer copy and no resync (epoch {epoch})"
        return res


@scenario
def tier_damage_fallback(t: Trial) -> dict:
    """Every iteration persisted to the local tier (keep 3), every 4 to a remote one; the
    ranks and then the whole cluster SIGKILLed at a seeded iteration; one byte flipped in
    the newest local checkpoint's largest shard. A new cluster on the same tiers must
    restore the newest checkpoint intact in any tier (never an older one while a newer
    copy reads back), and the run must finish equal to the uninterrupted one."""
    from shadow.persist import checkpoints

    k = t.rng.randint(6, t.steps - 2)
    local, remote = t.tmp / "local", t.tmp / "remote"
    args = (
        f"persist.local.dir={local}",
        "persist.local.every_n=1",
        "persist.local.keep=3",
        f"persist.remote.url=file://{remote}",
        "persist.remote.every_n=4",
        "persist.remote.keep=3",
    )
    with cluster(t.tmp, args) as c:
        codes = t.run("train", "--kill-at", str(k), "--kill-at-once", coordinator=c)
        c.kill_all()
    done = min(t.info("train", r).get("completed", 0) for r in range(RANKS))
    if codes != [-9] * RANKS:
        return result(False, True, None, None, f"kill at {k}: training exited {codes}: {t.error('train')}")
    held = {tier: checkpoints.list_checkpoints(str(root)) for tier, root in (("local", local), ("remote", remote))}
    if not held["local"]:
        return result(False, True, None, None, f"killed after {done}: the local tier holds no checkpoint")
    newest = held["local"][-1]
    shard = max(newest.manifest["shards"], key=lambda s: s["bytes"])
    path = Path(newest.path) / shard["file"]
    with open(path, "r+b") as f:
        f.seek(shard["bytes"] // 2)
        byte = f.read(1)
        f.seek(shard["bytes"] // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    intact = [c.iteration for c in held["local"][:-1]] + [c.iteration for c in held["remote"]]
    expected = max(intact, default=0)
    listing = {tier: [c.iteration for c in cs] for tier, cs in held.items()}
    (t.tmp / "again").mkdir()
    with cluster(t.tmp / "again", args) as c:
        res = resume_and_judge(
            t,
            c,
            "resume",
            done,
            done - expected,
            f"killed after {done}; tiers held {listing}; flipped a byte of local {newest.iteration}; "
            f"newest intact {expected}",
        )
    restored = t.info("resume").get("restored")
    if restored is not None and restored != expected:
        res["exact"] = False
        res["detail"] += f"; RESTORED {restored}, not the newest intact checkpoint {expected}"
    return res


# -- network faults with hosts apart (tools/netfaults.py: the rig, the trial, the checks) -------
NET_SCENARIOS: list[str] = []


def net_scenario(fn: Callable[[Trial], dict]) -> Callable[[Trial], dict]:
    NET_SCENARIOS.append(fn.__name__)
    return scenario(fn)


@net_scenario
def net_trainer_worker_cut(t: Trial) -> dict:
    """The trainers' host cut off from one worker mid-send for 1-3 s (the worker still talks
    to the coordinator), then healed: the queued stream resumes over the same connection."""
    w = t.rng.choice(["w1", "w2"])
    return netfaults.net_trial("net_trainer_worker_cut", t, netfaults.cut("here", w, t.rng.uniform(1.0, 3.0)))


@net_scenario
def net_trainer_worker_cut_long(t: Trial) -> dict:
    """The same cut held past the trainers' loss timeout (SHADOW_BLOCK_TIMEOUT_S): they train
    on unprotected, and after the heal the cluster resyncs from their state."""
    w = t.rng.choice(["w1", "w2"])
    hold = t.rng.uniform(netfaults.BLOCK_TIMEOUT_S + 1.0, netfaults.BLOCK_TIMEOUT_S + 4.0)
    return netfaults.net_trial("net_trainer_worker_cut_long", t, netfaults.cut("here", w, hold), steps=150)


@net_scenario
def net_split_brain(t: Trial) -> dict:
    """A worker cut off from the coordinator past its loss timeout while the trainers still
    reach it: the coordinator declares it lost, the job goes on without it, and it must never
    serve, persist or report as newest a state the cluster has moved past."""
    w = t.rng.choice(["w1", "w2"])
    hold = t.rng.uniform(netfaults.WORKER_LOST_S + 1.0, netfaults.WORKER_LOST_S + 4.0)
    return netfaults.net_trial("net_split_brain", t, netfaults.cut("coord", w, hold), steps=120)


@net_scenario
def net_coordinator_isolated(t: Trial) -> dict:
    """The coordinator's host isolated from everyone for 1-7 s (shorter and longer than the
    trainers' SHADOW_COORDINATOR_LOST_S and the workers' loss timeout), then healed."""
    hold = t.rng.uniform(1.0, netfaults.COORDINATOR_LOST_S + 4.0)
    return netfaults.net_trial("net_coordinator_isolated", t, netfaults.isolate("coord", hold), steps=150)


@net_scenario
def net_replica_recopy_cut(t: Trial) -> dict:
    """replicas=2 on 4 worker hosts: a worker is SIGKILLed and started again, and its link to
    the peer it recopies its shard from is cut while it does so (2-4 s); then healed."""
    return netfaults.net_trial(
        "net_replica_recopy_cut",
        t,
        netfaults.recopy_cut(t.rng.randrange(4), t.rng.uniform(2.0, 4.0)),
        steps=150,
        rig_kw={"workers": 4, "replicas": 2},
    )


@net_scenario
def net_store_unreachable(t: Trial) -> dict:
    """The object store's host (S3, every 4 iterations) isolated for 3-8 s while the local
    tier (every iteration, keep 3) keeps writing; healed, the remote tier catches up."""
    return netfaults.net_trial(
        "net_store_unreachable",
        t,
        netfaults.isolate("store", t.rng.uniform(3.0, 8.0)),
        steps=120,
        rig_kw={"store": True},
        protected=True,
    )


@net_scenario
def net_flapping_link(t: Trial) -> dict:
    """A link (the trainers' to a worker, or a worker's to the coordinator) cut and healed
    every second for a minute."""
    a, b = t.rng.choice([("here", "w1"), ("coord", "w1"), ("here", "w2"), ("coord", "w2")])
    return netfaults.net_trial("net_flapping_link", t, netfaults.flap(a, b, 60.0, 1.0), steps=340, step_sleep=0.25)


def _capped(t: Trial, policy: str) -> dict:
    w = t.rng.choice(["w1", "w2"])
    return netfaults.net_trial(
        f"net_capped_{policy}",
        t,
        netfaults.cap(w, "1gbit", t.rng.uniform(4.0, 8.0)),
        policy=policy,
        steps=100,
        protected=True,
    )


@net_scenario
def net_capped_block(t: Trial) -> dict:
    """A worker's host capped at 1 Gbit/s for 4-8 s, policy block."""
    return _capped(t, "block")


@net_scenario
def net_capped_skip(t: Trial) -> dict:
    """The same under policy skip."""
    return _capped(t, "skip")


@net_scenario
def net_restore_in_partition(t: Trial) -> dict:
    """A restore started while a worker is cut off from the coordinator: it returns the
    trainer's exact state at the iteration it names, from whichever source still holds one
    complete, or fails saying why; never a wrong state."""
    w = t.rng.choice(["w1", "w2"])
    hold = t.rng.uniform(netfaults.WORKER_LOST_S + 2.0, netfaults.WORKER_LOST_S + 5.0)
    return netfaults.net_trial(
        "net_restore_in_partition", t, netfaults.cut("coord", w, hold), steps=120, during=netfaults.restore_now
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
    CLUSTER_ARGS[:] = [f"transport.data={args.transport}"]
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
