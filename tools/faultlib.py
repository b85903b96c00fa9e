"""Plumbing of the fault matrix (tools/fault_matrix.py): a trial's processes, the local
cluster, the status watcher, the reference runs and the verdicts."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shadow.testing import LocalCluster, assert_same_state, free_port, status

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "tests" / "helpers" / "tiny_trainer.py"  # run as a program, never imported

RANKS = 2
RUN_TIMEOUT_S = 120.0  # one launch of the trainer ranks
LOST_S = "1.5"  # SHADOW_WORKER_LOST_S for the worker scenarios

#: every scenario of the matrix by name (``tools/matrix_process.py``, ``tools/matrix_net.py``)
SCENARIOS: dict[str, Callable[[Trial], dict]] = {}
#: the network scenarios among them (root and ``ip netns`` needed; ``--scenarios net``)
NET_SCENARIOS: list[str] = []


def scenario(fn: Callable[[Trial], dict]) -> Callable[[Trial], dict]:
    """Register a ``(Trial) -> dict`` scenario under its function's name."""
    SCENARIOS[fn.__name__] = fn
    return fn


def net_scenario(fn: Callable[[Trial], dict]) -> Callable[[Trial], dict]:
    """Register a network scenario (run only where :func:`netfaults.unavailable` is None)."""
    NET_SCENARIOS.append(fn.__name__)
    return scenario(fn)


# -- plumbing ------------------------------------------------------------------------------------
def result(
    exact: bool,
    training_failed: bool,
    lost: int | None,
    detection_s: float | None = None,
    detail: str = "",
    lost_allowed: int = 0,
    **extra,
) -> dict:
    return {
        "exact": bool(exact) and not training_failed,
        "training_failed": bool(training_failed),
        "lost_iterations": lost,
        "lost_allowed": lost_allowed,
        "detection_s": None if detection_s is None else round(detection_s, 3),
        "detail": detail,
        **extra,
    }


def same_state(got: list[dict] | None, ref: list[dict]) -> tuple[bool, str]:
    """assert_same_state (model, optimizer, scheduler) plus the torch RNG, as a verdict."""
    if got is None:
        return False, "no final state was written"
    if len(got) != len(ref):
        return False, f"{len(got)} ranks' final states against {len(ref)} in the reference"
    for r, (a, b) in enumerate(zip(got, ref, strict=True)):
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


class Poller(threading.Thread):
    """A daemon thread that calls :meth:`poll` every ``period`` s while it is entered (``with``)."""

    def __init__(self, period: float) -> None:
        super().__init__(daemon=True)
        self.period = period
        self._stop_evt = threading.Event()

    def poll(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        while not self._stop_evt.is_set():
            self.poll()
            self._stop_evt.wait(self.period)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop_evt.set()
        self.join(timeout=5)


class Watch(Poller):
    """Polls the coordinator every ``period`` s; ``first`` is (wall time, what) of the first
    status that shows the job degraded or a worker lost/stale."""

    def __init__(self, address: str, period: float = 0.05) -> None:
        super().__init__(period)
        self.address = address
        self.first: tuple[float, str] | None = None
        self.last: dict | None = None

    def poll(self) -> None:
        try:
            st = status(self.address, timeout=1.0)
        except Exception:
            return
        self.last = st
        bad = [f"worker {w['id']} {w['health']}" for w in st["workers"] if w["health"] != "ok"]
        if st["job"] and st["job"]["status"] == "degraded":
            bad.insert(0, "job degraded")
        if bad and self.first is None:
            self.first = (time.time(), ", ".join(bad))

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

    def start(
        self,
        tag: str,
        *args: str,
        coordinator: LocalCluster | None = None,
        env: dict | None = None,
        steps: int | None = None,
    ) -> list[subprocess.Popen]:
        """Launch the trainer ranks; output in tmp/tag, progress in tmp/tag-info-{rank}.json."""
        port = free_port()
        common = [
            "--out",
            str(self.tmp / tag),
            "--steps",
            str(steps or self.steps),
            "--info-out",
            str(self.tmp / f"{tag}-info-{{rank}}.json"),
        ]
        if coordinator is not None:
            common += ["--coordinator", coordinator.address]
        procs = []
        for r in range(RANKS):
            e = dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(RANKS),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                PYTHONPATH=str(ROOT),
                **(env or {}),
            )
            log = open(self.tmp / f"{tag}-rank{r}.log", "w")
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(TRAINER), *common, *args],
                    env=e,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
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


def settled(c: LocalCluster, quiet: float = 1.0) -> dict:
    """The status once a killed trainer's last messages are processed (the scenarios kill at
    random points, so the end state is not known in advance); the latest status if the
    cluster does not go quiet within 30 s (the verdict then says what it shows)."""
    try:
        return c.wait_quiet(quiet=quiet, limit=30.0)
    except Exception:
        return c.status()


def committed(st: dict) -> int | None:
    return st["job"]["committed"] if st.get("job") else None


def resume_and_judge(t: Trial, c: LocalCluster, tag: str, completed: int, allowed: int, detail: str) -> dict:
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


def judge_worker_fault(t: Trial, c: LocalCluster, codes: list, det: float | None, detail: str) -> dict:
    """Training finished unchanged, and a restore (resume with nothing left to train) brings
    back the last iteration exactly."""
    if codes != [0] * RANKS:
        return result(False, True, None, det, f"{detail}; training exited {codes}: {t.error('train')}")
    ok, why = same_state(t.state("train"), t.reference(t.steps))
    st = settled(c)
    detail += (
        f"; training {why}; cluster committed {committed(st)}, epoch {st['job']['epoch']}, "
        f"workers {[w['health'] for w in st['workers']]}"
    )
    codes = t.run("restore", "--mode", "resume", coordinator=c)
    restored = t.info("restore").get("restored")
    if codes != [0] * RANKS:
        return result(
            False,
            False,
            None if restored is None else t.steps - restored,
            det,
            f"{detail}; restore exited {codes}: {t.error('restore')}",
        )
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


def summarize(trials: list[dict]) -> dict:
    lost = [r["lost_iterations"] for r in trials if r["lost_iterations"] is not None]
    det = [r["detection_s"] for r in trials if r["detection_s"] is not None]
    return {
        "trials": len(trials),
        "exact": sum(r["exact"] for r in trials),
        "training_failures": sum(r["training_failed"] for r in trials),
        "lost_max": max(lost) if lost else None,
        "lost_unexpected": sum(
            1 for r in trials if r["lost_iterations"] is not None and r["lost_iterations"] > r["lost_allowed"]
        ),
        "detection_max_s": max(det) if det else None,
    }


def table(summaries: dict[str, dict]) -> str:
    head = [
        "scenario",
        "trials",
        "restores exact",
        "training failures",
        "lost iterations (max)",
        "max detection time (s)",
    ]
    rows = [
        [
            name,
            str(s["trials"]),
            f"{s['exact']}/{s['trials']}",
            str(s["training_failures"]),
            "-" if s["lost_max"] is None else str(s["lost_max"]),
            "-" if s["detection_max_s"] is None else f"{s['detection_max_s']:.2f}",
        ]
        for name, s in summaries.items()
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def fmt(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, rows)])


def problems(report: dict) -> list[str]:
    """Trials that were not exact or lost more iterations than their scenario allows."""
    out = []
    for name, sc in report["scenarios"].items():
        for r in sc["trials"]:
            if not r["exact"] or (r["lost_iterations"] or 0) > r["lost_allowed"]:
                out.append(
                    f"{name}#{r['trial']}: exact={r['exact']} lost={r['lost_iterations']} "
                    f"(allowed {r['lost_allowed']}): {r['detail']}"
                )
    return out
