"""Fault matrix: run each fault scenario N times with seeded randomness and tabulate what held.

    python scripts/fault_matrix.py --trials 3 --seed 0 [--scenarios a,b] [--steps 24] [--json PATH]

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
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from shadow import knobs
from tests.conftest import TRAINER, Cluster, free_port, status
from tests.test_integration import assert_same_state

RANKS = 2
RUN_TIMEOUT_S = 120.0  # one launch of the trainer ranks
LOST_S = "1.5"  # SHADOW_WORKER_LOST_S for the worker scenarios
SCENARIOS: dict[str, Callable[[Trial], dict]] = {}


def scenario(fn: Callable[[Trial], dict]) -> Callable[[Trial], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn


# -- plumbing ------------------------------------------------------------------------------------
def result(exact: bool, training_failed: bool, lost: int | None, detection_s: float | None = None,
           detail: str = "", lost_allowed: int = 0, **extra) -> dict:
    return {"exact": bool(exact) and not training_failed, "training_failed": bool(training_failed),
            "lost_iterations": lost, "lost_allowed": lost_allowed,
            "detection_s": None if detection_s is None else round(detection_s, 3), "detail": detail, **extra}


def same_state(got: list[dict] | None, ref: list[dict]) -> tuple[bool, str]:
    """assert_same_state (model, optimizer, scheduler) plus the torch RNG, as a verdict."""
    if got is None:
        return False, "no final state was written"
    for r, (a, b) in enumerate(zip(got, ref)):
        try:
            assert_same_state(a, b)
        except AssertionError as exc:
            return False, f"rank {r} differs from the reference: {exc or 'keys'}"
        if not torch.equal(a["rng"], b["rng"]):
            return False, f"rank {r}: torch RNG state differs from the reference"
    return True, "equal to the reference"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


class _Cluster(Cluster):
    """tests.conftest.Cluster, stopped again when it fails to start."""

    def __init__(self, tmp: Path, env: dict | None = None, workers: int = 2, args: tuple = ()) -> None:
        try:
            super().__init__(tmp, env=env, workers=workers, args=args)
        except BaseException as exc:
            if getattr(self, "proc", None) is not None:
                self.stop()
            errors = [ln for ln in self.log.read_text(errors="replace").splitlines() if "Error" in ln]
            raise RuntimeError(f"shadow cluster did not start ({errors[-1] if errors else exc}); log {self.log}") \
                from None


@contextlib.contextmanager
def cluster(tmp: Path, env: dict | None = None, workers: int = 2, args: tuple = ()) -> Iterator[Cluster]:
    """A fresh local cluster, always stopped (and its workers killed if stop was not enough)."""
    c = _Cluster(tmp, env=env, workers=workers, args=args)
    pids: set[int] = set()

    def note_pids() -> None:
        with contextlib.suppress(Exception):
            pids.update(w["pid"] for w in status(c.address, timeout=1.0)["workers"])

    def signal_ours(sig: int) -> None:
        for pid in pids:  # only a worker process of this cluster (its command line names the address)
            with contextlib.suppress(OSError):
                if f"coordinator={c.address}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, sig)

    note_pids()
    try:
        yield c
    finally:
        note_pids()
        signal_ours(signal.SIGCONT)  # a SIGSTOPped worker would not exit on SIGTERM
        try:
            c.stop()
        except Exception:
            c.proc.kill()
            c.proc.wait(timeout=10)
        signal_ours(signal.SIGKILL)


class Watch(threading.Thread):
    """Polls the coordinator every ``period`` s; ``first`` is (wall time, what) of the first
    status that shows the job degraded or a worker lost/stale."""

    def __init__(self, address: str, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.address, self.period = address, period
        self.first: tuple[float, str] | None = None
        self.last: dict | None = None
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while not self._stop_evt.is_set():
            try:
                st = status(self.address, timeout=1.0)
            except Exception:
                st = None
            now = time.time()
            if st is not None:
                self.last = st
                bad = [f"worker {w['id']} {w['health']}" for w in st["workers"] if w["health"] != "ok"]
                if st["job"] and st["job"]["status"] == "degraded":
                    bad.insert(0, "job degraded")
                if bad and self.first is None:
                    self.first = (now, ", ".join(bad))
            self._stop_evt.wait(self.period)

    def __enter__(self) -> Watch:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop_evt.set()
        self.join(timeout=5)

    def detection(self, t_fault: float | None) -> tuple[float | None, str]:
        if t_fault is None:
            return None, "fault time unknown"
        if self.first is None:
            return None, "the coordinator never reported the fault"
        return self.first[0] - t_fault, self.first[1]


@dataclass
class Trial:
    """One trial's context: its folder, its seeded RNG, the step count and the reference."""

    tmp: Path
    rng: random.Random
    steps: int
    reference: Callable[[int], list[dict]]
    timeout: float = RUN_TIMEOUT_S
    notes: list[str] = field(default_factory=list)

    def start(self, tag: str, *args: str, coordinator: Cluster | None = None, env: dict | None = None,
              steps: int | None = None) -> list[subprocess.Popen]:
        """Launch the trainer ranks; output in tmp/tag, progress in tmp/tag-info-{rank}.json."""
        port = free_port()
        common = ["--out", str(self.tmp / tag), "--steps", str(steps or self.steps),
                  "--info-out", str(self.tmp / f"{tag}-info-{{rank}}.json")]
        if coordinator is not None:
            common += ["--coordinator", coordinator.address]
        procs = []
        for r in range(RANKS):
            e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), PYTHONPATH=str(ROOT), **(env or {}))
            log = open(self.tmp / f"{tag}-rank{r}.log", "w")
            procs.append(subprocess.Popen([sys.executable, str(TRAINER), *common, *args], env=e, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=ROOT))
            log.close()
        return procs

    def wait(self, procs: list[subprocess.Popen]) -> list[int | None]:
        """Exit codes (None: still running at the timeout, then killed)."""
        deadline = time.monotonic() + self.timeout
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        return codes

    def run(self, tag: str, *args: str, **kw) -> list[int | None]:
        return self.wait(self.start(tag, *args, **kw))

    def info(self, tag: str, rank: int = 0) -> dict:
        return read_json(self.tmp / f"{tag}-info-{rank}.json")

    def state(self, tag: str) -> list[dict] | None:
        try:
            return [torch.load(self.tmp / tag / f"rank{r}.pt", weights_only=True) for r in range(RANKS)]
        except (OSError, RuntimeError):
            return None

    def error(self, tag: str) -> str:
        """The last error line of each rank's log."""
        out = []
        for r in range(RANKS):
            try:
                lines = (self.tmp / f"{tag}-rank{r}.log").read_text(errors="replace").splitlines()
            except OSError:
                continue
            hits = [ln for ln in lines if "Error" in ln or "error" in ln]
            if hits:
                out.append(f"rank {r}: {hits[-1].strip()[:300]}")
        return " | ".join(out) or "no error in the logs"


def settled(c: Cluster, quiet: float = 1.0) -> dict:
    try:
        return c.settled(quiet=quiet, limit=30.0)
    except Exception:
        return c.status()


def committed(st: dict) -> int | None:
    return st["job"]["committed"] if st.get("job") else None


def resume_and_judge(t: Trial, c: Cluster, tag: str, completed: int, allowed: int, detail: str) -> dict:
    """Restore in a new process group, finish the run, compare with the reference.
    ``completed``: the last iteration trained before the fault."""
    codes = t.run(tag, "--mode", "resume", coordinator=c)
    info = t.info(tag)
    restored = info.get("restored")
    detail += f"; the final resume restored {restored}"
    if restored is not None and info.get("extra_state") != {"it": restored}:
        detail += f" with extra_state {info.get('extra_state')!r} (expected {{'it': {restored}}})"
    if codes != [0] * RANKS:
        lost = completed if restored is None else completed - restored
        return result(False, True, lost, None, f"{detail}; resume exited {codes}: {t.error(tag)}", allowed)
    ok, why = same_state(t.state(tag), t.reference(t.steps))
    return result(ok, False, completed - restored, None, f"{detail}; final state {why}", allowed)


# -- scenarios ----------------------------------------------------------------------------------
@scenario
def trainer_kill(t: Trial) -> dict:
    """SIGKILL both ranks right after iteration k (and a short sleep); resume to the end."""
    k = t.rng.randint(2, t.steps - 1)
    with cluster(t.tmp) as c:
        codes = t.run("train", "--kill-at", str(k), "--step-sleep", "0.05", coordinator=c)
        done = min(t.info("train", r).get("completed", 0) for r in range(RANKS))
        if codes != [-9] * RANKS:
            return result(False, True, None, None, f"kill at {k}: training exited {codes}: {t.error('train')}")
        cut = committed(settled(c))
        # the sender streams asynchronously: a SIGKILL may catch up to MAX_LAG iterations in flight
        return resume_and_judge(t, c, "resume", done, knobs.get_int("MAX_LAG"),
                                f"killed after iteration {done}, cluster committed {cut}")


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
        res = resume_and_judge(t, c, "resume", k - 1, 0,
                               f"died in iteration {k} after {n} messages (exit {codes}; ranks had trained "
                               f"through {local} locally), cluster committed {cut}")
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
        codes = t.run("train", "--kill-at", str(j), "--step-sleep", "0.05", coordinator=c)
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
            landed = f"inside the bootstrap (epoch {job['epoch']} {job['status']}, base {job['base']}, nothing committed)"
        else:
            landed = f"after the bootstrap committed {job['committed']} (phase {boot.get('phase')})"
        detail = (f"killed after iteration {j} (cluster committed {c1}); a resume restored {boot.get('restored')} "
                  f"and was killed {delay} ms into its bootstrap (exit {codes}): landed {landed}")
        allowed = j - c1 if c1 is not None else j
        res = resume_and_judge(t, c, "resume", j, allowed, detail)
        res["landed"] = landed.split(" (")[0]
        return res


@scenario
def worker_kill(t: Trial) -> dict:
    """Rank 0 SIGKILLs shadow worker 1 at iteration k; training must finish unchanged, the
    cluster restart and resync the worker, and the final restore be exact."""
    k = t.rng.randint(3, 6)
    sleep = max(0.1, 6.0 / (t.steps - k))  # time after the kill for the restart (1-4 s) + resync
    with cluster(t.tmp, env={"SHADOW_WORKER_LOST_S": LOST_S}) as c, Watch(c.address) as w:
        codes = t.run("train", "--kill-worker-at", str(k), "--step-sleep", f"{sleep:.3f}", coordinator=c)
        t_kill = t.info("train").get("worker_killed_t")
        det, what = w.detection(t_kill)
        return judge_worker_fault(t, c, codes, det, f"worker 1 SIGKILLed at iteration {k}; detected as {what}")


@scenario
def worker_stop(t: Trial) -> dict:
    """SIGSTOP worker 0 for a few seconds during training (policy block), then SIGCONT:
    training waits until the worker is declared lost, goes on degraded, resyncs."""
    stop_at, stop_s = t.rng.randint(3, 6), round(t.rng.uniform(2.5, 3.5), 2)
    sleep = max(0.1, (stop_s + 4.0) / (t.steps - stop_at))
    with cluster(t.tmp, env={"SHADOW_WORKER_LOST_S": LOST_S}) as c, Watch(c.address) as w:
        procs = t.start("train", "--step-sleep", f"{sleep:.3f}", coordinator=c)
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
        return judge_worker_fault(t, c, codes, det, f"worker 0 SIGSTOPped at committed {stop_at} for {stop_s} s; "
                                                    f"detected as {what}")


@scenario
def worker_stop_skip(t: Trial) -> dict:
    """SIGSTOP worker 0 for a few seconds under policy skip: training never waits (it stops
    streaming once SHADOW_MAX_LAG ahead), the cluster resyncs after SIGCONT."""
    stop_at, stop_s = t.rng.randint(3, 6), round(t.rng.uniform(2.5, 3.5), 2)
    sleep = max(0.1, (stop_s + 4.0) / (t.steps - stop_at))
    with cluster(t.tmp, env={"SHADOW_WORKER_LOST_S": LOST_S}) as c, Watch(c.address) as w:
        procs = t.start("train", "--step-sleep", f"{sleep:.3f}", "--policy", "skip", coordinator=c)
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
        return judge_worker_fault(t, c, codes, det, f"worker 0 SIGSTOPped (policy skip) at committed {stop_at} "
                                                    f"for {stop_s} s; detected as {what}")


@scenario
def coordinator_kill(t: Trial) -> dict:
    """SIGKILL the coordinator mid-run (its workers live on) and start a new one on the same
    port: it rebuilds the job from the workers, the ranks reconnect, nothing is lost.
    Detection column: seconds from the new coordinator's start to the rebuilt job."""
    k = t.rng.randint(3, 8)
    with cluster(t.tmp) as c:
        procs = t.start("train", "--step-sleep", "0.25", coordinator=c)
        new = None
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (committed(status(c.address, 2.0)) or 0) < k:
                time.sleep(0.05)
            c.proc.kill()
            c.proc.wait()
            time.sleep(t.rng.uniform(0.2, 1.5))  # the ranks train on within SHADOW_MAX_LAG meanwhile
            t0 = time.time()
            log = open(t.tmp / "coordinator2.log", "w")
            new = subprocess.Popen([sys.executable, "-m", "shadow", "coordinator", "workers=2", f"port={c.port}"],
                                   stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            c.proc = new  # stopped with the cluster
            rebuilt = None
            while time.monotonic() < deadline + 30 and rebuilt is None:
                with contextlib.suppress(Exception):
                    if status(c.address, 1.0)["job"]:
                        rebuilt = time.time() - t0
                time.sleep(0.05)
        finally:
            codes = t.wait(procs)
        return judge_worker_fault(t, c, codes, rebuilt, f"coordinator SIGKILLed at committed >= {k}, restarted; "
                                                        f"job rebuilt from the workers in {rebuilt} s")


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
    with cluster(t.tmp, env={"SHADOW_WORKER_LOST_S": LOST_S}, workers=4, args=("replicas=2",)) as c, \
            Watch(c.address) as w:
        codes = t.run("train", "--kill-worker-at", str(k), "--step-sleep", f"{sleep:.3f}", coordinator=c)
        det, what = w.detection(t.info("train").get("worker_killed_t"))
        res = judge_worker_fault(t, c, codes, det, f"worker 1 of 4 (replicas=2) SIGKILLed at iteration {k}; "
                                                   f"detected as {what}")
        log = c.log.read_text(errors="replace")
        epoch = settled(c)["job"]["epoch"]
        res["detail"] += f"; peer copies {log.count('copied iteration')}"
        # the trainer re-attached once for the final restore check (epoch 2); more means a resync
        if "copied iteration" not in log or epoch > 2:
            res["exact"] = False
            res["detail"] += f"; EXPECTED a peer copy and no resync (epoch {epoch})"
        return res


def judge_worker_fault(t: Trial, c: Cluster, codes: list, det: float | None, detail: str) -> dict:
    """Training finished unchanged, and a restore (resume with nothing left to train) brings
    back the last iteration exactly."""
    if codes != [0] * RANKS:
        return result(False, True, None, det, f"{detail}; training exited {codes}: {t.error('train')}")
    ok, why = same_state(t.state("train"), t.reference(t.steps))
    st = settled(c)
    detail += (f"; training {why}; cluster committed {committed(st)}, epoch {st['job']['epoch']}, "
               f"workers {[w['health'] for w in st['workers']]}")
    codes = t.run("restore", "--mode", "resume", coordinator=c)
    restored = t.info("restore").get("restored")
    if codes != [0] * RANKS:
        return result(False, False, None if restored is None else t.steps - restored, det,
                      f"{detail}; restore exited {codes}: {t.error('restore')}")
    same, rwhy = same_state(t.state("restore"), t.reference(t.steps))
    exact = ok and same and restored == t.steps
    return result(exact, False, t.steps - restored, det, f"{detail}; restored {restored}, {rwhy}")


# -- runner -------------------------------------------------------------------------------------
class References:
    """The uninterrupted run without the shadow, once per step count."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.cache = workdir, {}

    def __call__(self, steps: int) -> list[dict]:
        if steps not in self.cache:
            tmp = self.workdir / f"reference-{steps}"
            tmp.mkdir(parents=True, exist_ok=True)
            t = Trial(tmp, random.Random(0), steps, self)
            codes = t.run("ref")
            state = t.state("ref")
            if codes != [0] * RANKS or state is None:
                raise RuntimeError(f"reference run failed ({codes}): {t.error('ref')}")
            self.cache[steps] = state
        return self.cache[steps]


def run_trial(name: str, i: int, seed: int, steps: int, workdir: Path, refs: References) -> dict:
    tmp = workdir / f"{name}-{i}"
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        res = SCENARIOS[name](Trial(tmp, random.Random(f"{seed}:{name}:{i}"), steps, refs))
    except Exception as exc:
        res = result(False, True, None, None, f"trial error: {type(exc).__name__}: {str(exc)[:500]}",
                     trial_error=True, traceback=traceback.format_exc()[-3000:])
    res.update(trial=i, wall_s=round(time.monotonic() - t0, 1), dir=str(tmp))
    return res


def summarize(trials: list[dict]) -> dict:
    lost = [r["lost_iterations"] for r in trials if r["lost_iterations"] is not None]
    det = [r["detection_s"] for r in trials if r["detection_s"] is not None]
    return {"trials": len(trials), "exact": sum(r["exact"] for r in trials),
            "training_failures": sum(r["training_failed"] for r in trials),
            "lost_max": max(lost) if lost else None,
            "lost_unexpected": sum(1 for r in trials if r["lost_iterations"] is not None
                                   and r["lost_iterations"] > r["lost_allowed"]),
            "detection_max_s": max(det) if det else None}


def table(summaries: dict[str, dict]) -> str:
    head = ["scenario", "trials", "restores exact", "training failures", "lost iterations (max)",
            "max detection time (s)"]
    rows = [[name, str(s["trials"]), f"{s['exact']}/{s['trials']}", str(s["training_failures"]),
             "-" if s["lost_max"] is None else str(s["lost_max"]),
             "-" if s["detection_max_s"] is None else f"{s['detection_max_s']:.2f}"] for name, s in summaries.items()]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def fmt(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, rows)])


def problems(report: dict) -> list[str]:
    """Trials that were not exact or lost more iterations than their scenario allows."""
    out = []
    for name, sc in report["scenarios"].items():
        for r in sc["trials"]:
            if not r["exact"] or (r["lost_iterations"] or 0) > r["lost_allowed"]:
                out.append(f"{name}#{r['trial']}: exact={r['exact']} lost={r['lost_iterations']} "
                           f"(allowed {r['lost_allowed']}): {r['detail']}")
    return out


def main(argv: list[str] | None = None, default_scenarios: str = ",".join(SCENARIOS), default_trials: int = 3,
         strict: bool = False) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=default_trials)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenarios", default=default_scenarios, help=f"comma-separated, from {list(SCENARIOS)}")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default="", help="write every trial and the summary here")
    ap.add_argument("--workdir", default="", help="logs and states of every trial (default: a new temp dir)")
    ap.add_argument("--strict", action="store_true", default=strict,
                    help="exit 1 if any restore was not exact or lost more iterations than allowed")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; known: {list(SCENARIOS)}")
    if args.steps < 8:
        ap.error(f"--steps {args.steps} is too short for the scenarios; use 8 or more")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fault_matrix-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"fault matrix: {names} x {args.trials} trials, seed {args.seed}, {args.steps} steps; logs in {workdir}",
          flush=True)
    refs = References(workdir)
    t0 = time.monotonic()
    try:
        refs(args.steps)
        print(f"reference run ({args.steps} steps, no shadow): {time.monotonic() - t0:.1f} s", flush=True)
    except Exception as exc:  # every trial will record it
        print(f"reference run failed: {exc}", flush=True)
    report: dict = {"seed": args.seed, "trials": args.trials, "steps": args.steps, "workdir": str(workdir),
                    "scenarios": {}}
    for name in names:
        trials = []
        for i in range(args.trials):
            r = run_trial(name, i, args.seed, args.steps, workdir, refs)
            trials.append(r)
            verdict = ("exact" if r["exact"] else "TRIAL ERROR" if r.get("trial_error") else
                       "TRAINING FAILED" if r["training_failed"] else "NOT EXACT")
            print(f"  {name}#{i}: {verdict}, lost {r['lost_iterations']}, detection {r['detection_s']} s, "
                  f"{r['wall_s']} s: {r['detail']}", flush=True)
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
