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

from faultlib import RANKS, Trial, result, same_state
from netchecks import (
    LOCAL_KEEP,
    REMOTE_EVERY,
    Watch,
    check_leaks,
    check_restores,
    compare,
    degraded_why,
    dumped,
    wait_persisted,
)

from shadow import security
from shadow.restore import open_source
from shadow.restore.resolve import cluster_tiers
from shadow.testing.netns import HostCluster, Network, unavailable

__all__ = ["unavailable"]
from shadow.testing.wait import wait_until

WORKER_LOST_S = 1.5  # SHADOW_WORKER_LOST_S: the loss timeout of these clusters
COORDINATOR_LOST_S = 3.0  # SHADOW_COORDINATOR_LOST_S for the trainers
BLOCK_TIMEOUT_S = 6.0  # SHADOW_BLOCK_TIMEOUT_S for the trainers
RESYNC_S = 6.0  # one resync: the vote, the bootstrap, the first commit (2-core machine, loaded)
HEAL_BOUND_S = 2 * max(WORKER_LOST_S, COORDINATOR_LOST_S) + RESYNC_S

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
    wait_persisted(rig, job, steps)
    bad, seen = check_restores(rig, t, job, steps)
    problems += bad
    leaks = check_leaks(rig)
    problems += leaks
    stats = trained[0]["stats"] if trained else {}
    if protected and stats.get("unprotected_steps_total", 0):
        problems.append(f"{stats['unprotected_steps_total']} steps trained unprotected: {degraded_why(t)}")
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


def one_way(a: str, b: str, hold: float) -> Fault:
    """Packets from ``a`` to ``b`` dropped; ``b``'s still reach ``a`` (an asymmetric partition)."""

    def fault(rig: Rig, t: Trial):
        rig.net.drop(a, b)
        return f"dropped {a} -> {b} (one way)", lambda: rig.net.undrop(a, b), hold

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
        while dumped(t, state["iteration"]) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        why = compare(t, state, f"a restore during the partition ({source.name})")
        if why:
            return "WRONG STATE: " + why
        return f"a restore during the partition got iteration {c.iteration} from {source.name}, exact"
    return f"a restore during the partition found nothing complete ({'; '.join(tried)})"
