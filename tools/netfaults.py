"""Network faults with hosts apart, for the fault matrix (tools/fault_matrix.py).

Each scenario runs on a :class:`shadow.testing.netns.Network`: the coordinator, each worker
(and, where a scenario needs one, an S3 object store) on a host of its own, the 2 trainer
ranks on this machine's own host, CURVE keys laid out as the deployment recipes lay them
out. One cluster serves every trial of a scenario (so that leaks across trials show); each
trial is a job of its own: it trains with a seeded fault, heals it, and is then checked:

* training finished, equal bit for bit to the uninterrupted run without the shadow;
* no wait of a step longer than ``SHADOW_BLOCK_TIMEOUT_S`` (plus one step's slack);
* the cluster's committed iteration never went back and never passed the trainers';
* after the heal, the cluster streamed every iteration again (job ok, every worker ok,
  committed within one iteration of the trainers) within the stated bound, 2 x the loss
  timeout plus one resync (``HEAL_BOUND_S``);
* every restore equals the trainer's state at the iteration it names: the newest from
  memory, and every complete checkpoint of every tier (compared with ``torch.equal`` to the
  state the trainer dumped after that iteration); memory holds the last iteration (nothing
  lost), each tier its schedule's newest, and the local tier at most ``keep``;
* no service's descriptors or memory grow across trials (checked from the third trial on,
  against the second: the first warms caches up).

Root and ``ip netns`` are needed; elsewhere every scenario is reported as skipped.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from faultlib import RANKS, Trial, read_json, result, same_state

from shadow import security
from shadow.restore import open_source
from shadow.restore.resolve import cluster_tiers
from shadow.restore.sources import COMPLETE
from shadow.testing import rss_bytes
from shadow.testing.netns import HostCluster, Network, unavailable

__all__ = ["unavailable"]
from shadow.testing.state import state_differences
from shadow.testing.wait import wait_until

WORKER_LOST_S = 1.5  # SHADOW_WORKER_LOST_S: the loss timeout of these clusters
COORDINATOR_LOST_S = 3.0  # SHADOW_COORDINATOR_LOST_S for the trainers
BLOCK_TIMEOUT_S = 6.0  # SHADOW_BLOCK_TIMEOUT_S for the trainers
RESYNC_S = 6.0  # one resync: the vote, the bootstrap, the first commit (2-core machine, loaded)
HEAL_BOUND_S = 2 * max(WORKER_LOST_S, COORDINATOR_LOST_S) + RESYNC_S
LOCAL_KEEP = 3
REMOTE_EVERY = 4
FD_SLACK = 8  # descriptors a service may hold beyond its second trial's count (a new job's sockets)
RSS_SLACK = 64 << 20  # bytes of growth past the second trial's resident memory that count as a leak

SERVICE_ENV = {"SHADOW_WORKER_LOST_S": str(WORKER_LOST_S)}
TRAINER_ENV = {
    "SHADOW_COORDINATOR_LOST_S": str(COORDINATOR_LOST_S),
    "SHADOW_BLOCK_TIMEOUT_S": str(BLOCK_TIMEOUT_S),
    "SHADOW_CONNECT_TIMEOUT_S": "20",
}


@dataclass
class Rig:
    """One scenario's network and cluster, kept across its trials."""

    net: Network
    cluster: HostCluster
    store: object | None = None  # an S3Server on the host "store"
    baseline: dict = field(default_factory=dict)  # host -> (pid, fds, rss) after the second trial
    resources: dict = field(default_factory=dict)  # host -> [descriptors, resident MiB] after the last trial
    trials: int = 0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.net.heal_all()
        self.cluster.stop()
        if self.store is not None:
            self.store.stop()  # type: ignore[attr-defined]
        self.net.close()
        security.reset_client()


_RIGS: dict[str, Rig] = {}


def close_rig(name: str) -> None:
    """Stop scenario ``name``'s cluster and remove its network (after its last trial)."""
    rig = _RIGS.pop(name, None)
    if rig is not None:
        rig.close()


def _rig(name: str, t: Trial, workers: int = 2, replicas: int = 1, store: bool = False) -> Rig:
    if name in _RIGS:
        return _RIGS[name]
    hosts = ["coord", *(f"w{i + 1}" for i in range(workers))] + (["store"] if store else [])
    root = Path(tempfile.mkdtemp(prefix=f"{name}-cluster-", dir=t.tmp.parent))
    net = Network(hosts)
    s3 = None
    try:
        args = [
            f"replicas={replicas}",
            f"persist.local.dir={root / 'manifests'}",
            "persist.local.every_n=1",
            f"persist.local.keep={LOCAL_KEEP}",
        ]
        env = dict(SERVICE_ENV)
        if store:
            from shadow.testing.s3 import S3Server

            s3 = S3Server(root / "s3", host=net.address("store"), wrap=net.command("store"))
            env.update(s3.env)
            args += [f"persist.remote.url=s3://{s3.bucket}/ckpt", f"persist.remote.every_n={REMOTE_EVERY}"]
        cluster = HostCluster(net, root, "coord", hosts[1 : 1 + workers], args=args, env=env)
    except BaseException:
        if s3 is not None:
            s3.stop()
        net.close()
        raise
    if s3 is not None:
        os.environ.update(s3.env)  # this process reads the remote tier too
    security.set_client(cluster.keys.client("trainer"))  # this process restores as a trainer
    _RIGS[name] = rig = Rig(net, cluster, s3)
    return rig


class Watch(threading.Thread):
    """Polls the coordinator (client key) and rank 0's progress; keeps the series."""

    def __init__(self, rig: Rig, info: Path, job: str, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.rig, self.info, self.job, self.period = rig, info, job, period
        self.series: list[tuple[float, dict | None, int]] = []  # (time, status or None, trainer's completed)
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while not self._stop_evt.is_set():
            try:
                st = self.rig.cluster.status(timeout=1.0)
            except Exception:
                st = None
            self.series.append((time.time(), st, int(read_json(self.info).get("completed", 0))))
            self._stop_evt.wait(self.period)

    def __enter__(self) -> Watch:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop_evt.set()
        self.join(timeout=5)

    def committed(self) -> int:
        for _, st, _ in reversed(self.series):
            if st and st.get("job") and st["job"]["name"] == self.job and st["job"]["committed"] is not None:
                return st["job"]["committed"]
        return 0

    def streaming_since(self, t0: float) -> float | None:
        """Seconds from ``t0`` to the first status after it with the job ok, every worker ok
        and the cut within one iteration of the trainers (None: never)."""
        for t, st, done in self.series:
            if t < t0 or not st or not st.get("job") or st["job"]["name"] != self.job:
                continue
            job = st["job"]
            if (
                job["status"] in ("ok", "running")
                and all(w["health"] == "ok" for w in st["workers"])
                and job["committed"] is not None
                and job["committed"] >= done - 1
            ):
                return t - t0
        return None

    def regressions(self) -> list[str]:
        """Committed iterations that went back, or passed what the trainers had completed."""
        out, last = [], None
        for _, st, done in self.series:
            j = st.get("job") if st else None
            if not j or j["name"] != self.job or j["committed"] is None:
                continue
            c = j["committed"]
            if last is not None and c < last:
                out.append(f"committed went back from {last} to {c}")
            if done and c > done + 1:  # the info file lags a step behind the status
                out.append(f"committed {c} passed the trainers' {done}")
            last = c
        return out[:5]


def _degraded(t: Trial) -> str:
    """Why rank 0 went unprotected, as its log says."""
    with contextlib.suppress(OSError):
        for line in (t.tmp / "train-rank0.log").read_text(errors="replace").splitlines():
            if "degraded" in line:
                return line.strip()[:300]
    return "its log does not say"


def _dumped(t: Trial, it: int) -> dict | None:
    path = t.tmp / "dump" / f"it{it}-rank0.pt"
    return torch.load(path, weights_only=True) if path.exists() else None


def _compare(t: Trial, state: dict, where: str) -> str | None:
    """None if ``state`` (a snapshot's state dicts) equals what the trainer dumped after its
    iteration, bit for bit; else what differs."""
    it = state["iteration"]
    if it == 0:
        return None  # the bootstrap's initial state: nothing trained yet
    ref = _dumped(t, it)
    if ref is None:
        return f"{where} iteration {it}: the trainer dumped no state for it"
    got = {"model": state["model"], "optimizer": state["optimizer"], "scheduler": state["scheduler"]}
    diffs = state_differences(got, ref)
    if diffs:
        return f"{where} iteration {it} differs from the trainer's: {'; '.join(diffs[:4])}"
    if not torch.equal(state["rng"][0]["torch"], ref["rng"]):
        return f"{where} iteration {it}: rank 0's torch RNG differs"
    return None


def check_restores(rig: Rig, t: Trial, job: str, final: int) -> tuple[list[str], dict]:
    """Every restore there is now: memory's newest and every complete checkpoint of every
    tier, each against the trainer's state at its iteration; and the contract: memory at
    ``final``, the local tier's newest at ``final`` holding at most ``LOCAL_KEEP``, the
    remote tier's newest within ``REMOTE_EVERY`` of it."""
    from shadow.export.state import state_dicts

    bad: list[str] = []
    seen: dict = {}
    src = open_source(rig.cluster.address, timeout=20.0)
    mem = [c for c in src.candidates(job) if c.loadable]
    if not mem:
        bad.append(f"memory holds nothing of job {job} ({getattr(src, 'problem', '')})")
    for c in mem:
        seen["memory"] = c.iteration
        if c.iteration != final:
            bad.append(f"memory holds iteration {c.iteration}, the trainers finished {final}")
        why = _compare(t, state_dicts(src.load(c)), "memory")
        if why:
            bad.append(why)
    for tier in cluster_tiers(src):
        cands = [c for c in tier.candidates(job) if c.state == COMPLETE]
        seen[tier.name] = [c.iteration for c in cands]
        for c in cands:
            try:
                why = _compare(t, state_dicts(tier.load(c)), f"{tier.name} tier")
            except Exception as exc:
                why = f"{tier.name} tier iteration {c.iteration} did not load: {type(exc).__name__}: {exc}"
            if why:
                bad.append(why)
        newest = max((c.iteration for c in cands), default=None)
        if tier.name == "local":
            if newest != final:
                bad.append(f"the local tier's newest is {newest}, not the last iteration {final}")
            if len(cands) > LOCAL_KEEP:
                bad.append(f"the local tier holds {len(cands)} checkpoints, keep={LOCAL_KEEP}")
        elif newest is None or newest < final - REMOTE_EVERY:
            bad.append(f"the {tier.name} tier's newest is {newest}; every {REMOTE_EVERY} of {final} expected")
    return bad, seen


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def check_leaks(rig: Rig) -> list[str]:
    """Descriptors and memory of every service against the second trial's (same process)."""
    rig.trials += 1
    now = {}
    for host, pid in rig.cluster.pids().items():
        with contextlib.suppress(OSError, AssertionError):
            now[host] = (pid, _descriptors(pid), rss_bytes(pid))
    rig.resources = {host: [fds, rss >> 20] for host, (_, fds, rss) in now.items()}
    if rig.trials <= 2:
        rig.baseline = now
        return []
    out = []
    for host, (pid, fds, rss) in now.items():
        base = rig.baseline.get(host)
        if base is None or base[0] != pid:  # restarted since: its own baseline from now on
            rig.baseline[host] = (pid, fds, rss)
            continue
        if fds > base[1] + FD_SLACK:
            out.append(f"{host} holds {fds} descriptors, {base[1]} after trial 2")
        if rss > base[2] + RSS_SLACK:
            out.append(f"{host} resident memory {rss >> 20} MiB, {base[2] >> 20} MiB after trial 2")
    return out


def _wait_persisted(rig: Rig, job: str, final: int, limit: float = 30.0) -> None:
    """Until the cluster has persisted ``final`` to the local tier (or ``limit`` s pass)."""
    deadline = time.monotonic() + limit
    src = open_source(rig.cluster.address, timeout=10.0)
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            src.candidates(job)
            tiers = cluster_tiers(src)
            local = [c.iteration for tier in tiers if tier.name == "local" for c in tier.candidates(job)]
            if final in local:
                return
        time.sleep(0.3)


Fault = Callable[[Rig, Trial], tuple[str, Callable[[], None], float]]


def net_trial(
    name: str,
    t: Trial,
    fault: Fault,
    *,
    policy: str = "block",
    steps: int = 40,
    step_sleep: float = 0.1,
    at: tuple[int, int] = (4, 8),
    rig_kw: dict | None = None,
    during: Callable[[Rig, Trial, str], str] | None = None,
    protected: bool = False,
) -> dict:
    """Train job ``<name>-<trial>`` with ``steps`` iterations; once the cluster committed a
    seeded iteration in ``at``, apply ``fault`` (returns what it did, its heal, and how long
    to hold it), call ``during`` while it holds (a restore, say), heal, and judge.
    ``protected``: the fault must not cost the trainers a single unprotected step (a fault
    away from the data path: the object store, a slower link)."""
    rig = _rig(name, t, **(rig_kw or {}))
    job = f"{name.replace('_', '-')}-{t.tmp.name.rsplit('-', 1)[-1]}"
    k = t.rng.randint(*at)
    env = {**TRAINER_ENV, **rig.cluster.keys.env("trainer")}
    info = t.tmp / "train-info-0.json"
    notes: list[str] = []
    with Watch(rig, info, job) as w:
        procs = t.start(
            "train",
            "--job",
            job,
            "--policy",
            policy,
            "--step-sleep",
            f"{step_sleep}",
            "--dump-dir",
            str(t.tmp / "dump"),
            coordinator=rig.cluster,  # type: ignore[arg-type]  # has .address
            env=env,
            steps=steps,
        )
        t_fault = t_heal = None
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and all(p.poll() is None for p in procs):
                if w.committed() >= k:
                    break
                time.sleep(0.05)
            if all(p.poll() is None for p in procs):
                what, heal, hold = fault(rig, t)
                t_fault = time.time()
                notes.append(f"at committed {w.committed()}: {what} for {hold:.1f} s")
                try:
                    if during is not None:
                        notes.append(during(rig, t, job))
                    left = hold - (time.time() - t_fault)
                    if left > 0:
                        time.sleep(left)
                finally:
                    heal()
                    t_heal = time.time()
        finally:
            codes = t.wait(procs)
        heal_s = w.streaming_since(t_heal) if t_heal else None
        regress = w.regressions()
    if t_fault is None:
        return result(False, True, None, None, f"the fault never fired (committed {w.committed()} < {k}; {codes})")
    if codes != [0] * RANKS:
        return result(False, True, None, heal_s, f"{'; '.join(notes)}; training exited {codes}: {t.error('train')}")
    trained = t.state("train")
    ok, why_train = same_state(trained, t.reference(steps))
    problems = [] if ok else [f"training: {why_train}"]
    waits = [max(r["step_s"]) for r in trained] if trained else []
    if waits and max(waits) > BLOCK_TIMEOUT_S + 2.0:
        problems.append(f"a step waited {max(waits):.1f} s (SHADOW_BLOCK_TIMEOUT_S={BLOCK_TIMEOUT_S})")
    problems += regress
    problems += [n for n in notes if n.startswith("WRONG STATE")]
    if heal_s is None:
        problems.append("the cluster never streamed every iteration again after the heal")
    elif heal_s > HEAL_BOUND_S:
        problems.append(f"back to streaming {heal_s:.1f} s after the heal (bound {HEAL_BOUND_S:.1f} s)")
    _wait_persisted(rig, job, steps)
    bad, seen = check_restores(rig, t, job, steps)
    problems += bad
    leaks = check_leaks(rig)
    problems += leaks
    stats = trained[0]["stats"] if trained else {}
    if protected and stats.get("unprotected_steps_total", 0):
        problems.append(f"{stats['unprotected_steps_total']} steps trained unprotected: {_degraded(t)}")
    notes.append(
        f"back to streaming {heal_s if heal_s is None else round(heal_s, 2)} s after the heal; "
        f"held {seen}; rank 0 blocked {stats.get('blocked_s', 0):.1f} s, "
        f"{stats.get('unprotected_steps_total', 0)} unprotected steps, longest step {max(waits, default=0):.2f} s"
    )
    lost = steps - seen["memory"] if isinstance(seen.get("memory"), int) else None
    return result(
        not problems,
        False,
        lost,
        heal_s,
        "; ".join(notes) + ("; PROBLEMS: " + " | ".join(problems) if problems else ""),
        heal_s=heal_s,
        resources=rig.resources,
    )


# -- the faults ---------------------------------------------------------------------------
def cut(a: str, b: str, hold: float) -> Fault:
    def fault(rig: Rig, t: Trial):
        rig.net.cut(a, b)
        return f"cut {a} <-> {b}", lambda: rig.net.heal(a, b), hold

    return fault


def isolate(host: str, hold: float) -> Fault:
    def fault(rig: Rig, t: Trial):
        rig.net.isolate(host)
        return f"isolated {host}", lambda: rig.net.rejoin(host), hold

    return fault


def flap(a: str, b: str, length: float, period: float) -> Fault:
    """Cut the link ``a`` - ``b`` and heal it every ``period`` s for ``length`` s."""

    def fault(rig: Rig, t: Trial):
        stop = threading.Event()

        def run() -> None:
            down = False
            while not stop.wait(period):
                (rig.net.heal if down else rig.net.cut)(a, b)
                down = not down

        rig.net.cut(a, b)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()

        def heal() -> None:
            stop.set()
            thread.join()
            rig.net.heal(a, b)

        return f"flapped {a} <-> {b} every {period:.0f} s", heal, length

    return fault


def cap(host: str, rate: str, hold: float) -> Fault:
    def fault(rig: Rig, t: Trial):
        rig.net.cap(host, rate)
        return f"capped {host} at {rate}", lambda: rig.net.uncap(host), hold

    return fault


def recopy_cut(i: int, hold: float) -> Fault:
    """SIGKILL worker ``i``, cut it from the worker holding the same shard, start it again:
    its recopy meets the cut."""

    def fault(rig: Rig, t: Trial):
        st = rig.cluster.status()
        ws = {w["id"]: w for w in st["workers"]}
        shard = ws[i]["shard"]
        peers = [w for w in ws if w != i and ws[w]["shard"] == shard]
        if not peers:
            raise RuntimeError(f"worker {i} (shard {shard}) has no replica peer: {st['workers']}")
        me, peer = rig.cluster.worker_hosts[i], rig.cluster.worker_hosts[peers[0]]
        p = rig.cluster.procs[me]
        p.kill()
        p.wait()
        rig.net.cut(me, peer)
        pid = rig.cluster.start_worker(i).pid

        def registered() -> bool:  # the copy is asked for once it has registered: hold from then
            with contextlib.suppress(TimeoutError):
                return any(w["id"] == i and w["pid"] == pid for w in rig.cluster.status(2.0)["workers"])
            return False

        wait_until(registered, 120, f"worker {i} registered again", period=0.1)
        return f"worker {i} killed and restarted, cut from its peer {peers[0]}", lambda: rig.net.heal(me, peer), hold

    return fault


def restore_now(rig: Rig, t: Trial, job: str) -> str:
    """A restore of the newest checkpoint now, as `shadow restore` picks it (memory, then
    the tiers): exact at its iteration, or an error; never a wrong state."""
    from shadow.export.state import state_dicts
    from shadow.restore import pick

    src = open_source(rig.cluster.address, timeout=20.0)
    tried = []
    sources: list = [src]
    try:
        src.candidates(job)
        sources += cluster_tiers(src)
    except Exception as exc:
        tried.append(f"memory: {type(exc).__name__}: {exc}")
    for source in sources:
        try:
            c, snap = pick(source, job)
        except Exception as exc:
            tried.append(f"{source.name}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        state = state_dicts(snap)
        # the trainer may not have dumped it yet: it is written after the step, before the sleep
        deadline = time.monotonic() + 10
        while _dumped(t, state["iteration"]) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        why = _compare(t, state, f"a restore during the partition ({source.name})")
        if why:
            return "WRONG STATE: " + why
        return f"a restore during the partition got iteration {c.iteration} from {source.name}, exact"
    return f"a restore during the partition found nothing complete ({'; '.join(tried)})"
