"""The process fault scenarios of the fault matrix (``tools/fault_matrix.py``): a trainer
rank, a worker, the coordinator or the whole cluster killed, stopped or cut off inside one
machine, and a tier damaged. Each is a ``(Trial) -> dict`` registered with ``@scenario``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from faultlib import (
    LOST_S,
    RANKS,
    Trial,
    Watch,
    committed,
    judge_worker_fault,
    result,
    resume_and_judge,
    scenario,
    settled,
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
