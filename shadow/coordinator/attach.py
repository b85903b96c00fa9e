"""Attaching a training job: the ranks' ``attach`` messages are held until every rank
has arrived and every worker is ready (``waiting`` meanwhile), then checked (world,
layout, start iteration against what the cluster holds, the job's generation) and the
workers configured for a new epoch."""

from __future__ import annotations

import logging
import time
from typing import Any

from shadow.coordinator.cluster import ClusterState, configure_fields
from shadow.coordinator.outbox import Outbox
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.queries import memory_info
from shadow.coordinator.records import JobRec, JobStatus, job_id_for
from shadow.core.jobs import job_name_problem
from shadow.core.layout import Layout, shard_bounds
from shadow.persist import checkpoints
from shadow.storage.url import local_path
from shadow.wire import messages as M
from shadow.worker.memory import human, nfields, session_bytes

logger = logging.getLogger(__name__)


Msg = dict[str, Any]

#: a ``detach`` of this epoch withdraws the sender's held attach (trainer_hooks' handshake)
WITHDRAW = -1


class Attach:
    """Handlers ``attach`` and ``detach`` (trainers); attaches held while their ranks
    arrive and workers start (periodic :meth:`start_attaches`, :meth:`expire_attaches`)."""

    def __init__(self, state: ClusterState, out: Outbox, persist: Persistence) -> None:
        self.state, self.out, self.persist = state, out, persist

    def on_attach(self, env: list[bytes], msg: Msg, size: int = 0) -> None:
        """Rank ``msg.rank`` of job ``msg.job`` attaches; ``size``: its message's bytes on the wire."""
        now = time.monotonic()
        problem = job_name_problem(msg["job"])  # the name becomes a directory under every tier's root
        if problem is not None:
            logger.error("attach refused: %s", problem)
            self.out.reply(env, "error", code="refused", message=problem)
            return
        if not 0 <= msg["rank"] < msg["world"]:
            self.out.reply(env, "error", code="refused", message=f"rank {msg['rank']} is not in world {msg['world']}")
            return
        if msg["rank"] != 0 and msg["layout"] is not None:
            msg = {**msg, "layout": None}  # rank 0's layout is the job's; the others' hashes must match it
            size = len(M.encode("attach", **{k: v for k, v in msg.items() if k not in ("t", "v")}))
        full = self._pending_full(msg["job"], msg["rank"], size)
        if full is not None:
            self.state.rejected.add("attach_full")
            logger.error("attach of job %s rank %d refused: %s", msg["job"], msg["rank"], full)
            self.out.reply(env, "error", code="busy", message=full)
            return
        p = self.state.pending.setdefault(
            msg["job"],
            {
                "ranks": {},
                "bytes": {},
                "held": 0,
                "since": now,
                "told": -1,
                "deadline": now + self.state.tuning.connect_timeout_s,
            },
        )
        p["ranks"][msg["rank"]] = (env[0], msg)  # a rank attaching again replaces its entry
        p["held"] += size - p["bytes"].get(msg["rank"], 0)
        p["bytes"][msg["rank"]] = size
        p["told"] = -1  # a newcomer hears how many workers are ready
        self.start_attaches()

    def _pending_full(self, name: str, rank: int, size: int) -> str | None:
        """Why one more held attach (job ``name``, ``rank``, a message of ``size`` bytes)
        would pass a bound on what the coordinator holds, or None."""
        p = self.state.pending.get(name)
        held = self.state.pending_view()
        again = p is not None and rank in p["ranks"]  # replaces its own entry
        jobs = held["jobs"] + (p is None)
        ranks = held["ranks"] + (not again)
        nbytes = held["bytes"] - (p["bytes"].get(rank, 0) if p is not None and again else 0) + size
        tuning = self.state.tuning
        for knob, cap, value, what in (
            ("ATTACH_PENDING_JOBS", tuning.attach_pending_jobs, jobs, "jobs with attaches waiting for their ranks"),
            ("ATTACH_PENDING_RANKS", tuning.attach_pending_ranks, ranks, "rank attaches waiting"),
            ("ATTACH_PENDING_BYTES", tuning.attach_pending_bytes, nbytes, "bytes of attach messages held"),
        ):
            if value > cap:
                waiting = (
                    f"other attaches are waiting for their ranks ({held['jobs']} jobs, {held['ranks']} "
                    f"ranks, {held['bytes']} bytes) until they arrive or SHADOW_CONNECT_TIMEOUT_S passes: "
                    "retry then, or"
                    if held["ranks"]
                    else ""
                )
                return (
                    f"the coordinator holds too many pending attaches: this one would make {value} {what}, "
                    f"over the bound of {cap} (SHADOW_{knob}); {waiting} raise SHADOW_{knob} on the coordinator"
                )
        return None

    def start_attaches(self) -> None:
        """Start every pending attach whose ranks have all arrived, once every worker is
        ready; until then each rank hears ``waiting`` whenever the count of ready workers
        changes (a cluster still compiling its kernels holds attaches, it does not refuse)."""
        if not self.state.pending:
            return
        ready = len(self.state.ready_workers())
        for name in list(self.state.pending):
            p = self.state.pending[name]
            world = next(iter(p["ranks"].values()))[1]["world"]
            if ready >= self.state.expected and len(p["ranks"]) >= world:
                owned = self._live_owner(name, p["ranks"])
                p["owned"] = owned
                if owned is not None:  # held until the live run's ranks fall silent, or the deadline
                    now = time.monotonic()
                    if now >= p.get("owner_told", 0.0):
                        p["owner_told"] = now + 5.0
                        logger.warning("attach of job %s held: %s", name, owned)
                        for ident, _ in p["ranks"].values():
                            self.out.reply(
                                [ident],
                                "waiting",
                                ready=ready,
                                expected=self.state.expected,
                                starting=len(self.state.starting),
                                reason=owned,
                            )
                    continue
                del self.state.pending[name]
                try:
                    self._start_job(name, p["ranks"])
                except Exception as exc:  # the ranks must hear, and the loop go on
                    self.state.rejected.failed("attach_error", f"the attach of job {name!r}")
                    for ident, _ in p["ranks"].values():
                        self.out.reply(
                            [ident],
                            "error",
                            code="internal",
                            message=f"attach of job {name!r} failed in the coordinator: {type(exc).__name__}: {exc}",
                        )
            elif ready < self.state.expected and p["told"] != ready:
                p["told"] = ready
                for ident, _ in p["ranks"].values():
                    self.out.reply(
                        [ident], "waiting", ready=ready, expected=self.state.expected, starting=len(self.state.starting)
                    )

    def expire_attaches(self) -> None:
        now = time.monotonic()
        for name in [n for n, p in self.state.pending.items() if now > p["deadline"]]:
            p = self.state.pending.pop(name)
            world = next(iter(p["ranks"].values()))[1]["world"]
            ready = len(self.state.ready_workers(now))
            if p.get("owned"):
                text = (
                    f"attach of job {name!r} refused after {now - p['since']:.0f} s (SHADOW_CONNECT_TIMEOUT_S): "
                    f"{p['owned']}"
                )
            elif len(p["ranks"]) < world:
                text = (
                    f"attach of job {name!r} timed out: {len(p['ranks'])} of {world} ranks arrived "
                    f"(ranks {sorted(p['ranks'])}); every rank must call attach"
                )
            else:
                text = (
                    f"the shadow cluster has {ready} of {self.state.expected} workers ready after "
                    f"{now - p['since']:.0f} s ({len(self.state.starting)} still compiling their kernels); "
                    "check the worker logs, or allow longer with SHADOW_CONNECT_TIMEOUT_S"
                )
            logger.error("attach of job %s failed: %s", name, text)
            for ident, _ in p["ranks"].values():
                self.out.reply([ident], "error", code="timeout", message=text)

    def _live_owner(self, name: str, ranks: dict) -> str | None:
        """Why the attach of job ``name`` (every rank's message in ``ranks``) may not start
        yet: the job the cluster holds still has an owner, a run whose ranks heartbeat
        within :func:`~shadow.coordinator.trainers.heard_window_s`. No launch takes over a
        live owner, whatever ``overwrite`` says; None once its ranks are silent (they are
        then taken over), and at once for the owner's own ranks re-attaching (a resync: they
        prove it with their rank tokens) or for the next round of the same elastic launch
        (torchrun's restarts, a Slurm requeue: the same run, a later restart round, whose
        launcher ended the round before)."""
        from shadow.coordinator.trainers import heard_window_s

        old = self.state.job
        if old is None or old.status == JobStatus.DETACHED:
            return None
        now, window = time.monotonic(), heard_window_s(self.state.tuning)
        alive = old.ranks_heard(now, window)
        if not alive:
            return None
        msgs = {r: m for r, (_, m) in ranks.items()}
        if old.name != name and not msgs[min(msgs)]["overwrite"]:
            return None  # refused at once by _start_job: another job only replaces this one with overwrite
        layout = self._agreed_layout([msgs[r] for r in sorted(msgs)])
        if isinstance(layout, str) or self._memory_problem(name, layout, msgs[min(msgs)]["optim"]) is not None:
            return None  # refused at once by _start_job, whoever owns the job (nothing changes)
        if old.name == name and all(_proves_owner(old, r, m.get("owner")) for r, m in msgs.items()):
            return None
        launch = _launch(msgs[min(msgs)].get("launch"))
        if old.name == name and old.launch is not None and _next_round(old.launch, launch):
            logger.warning(
                "job %s: restart round %s of launch %s takes over from round %d (epoch %d, generation %d)",
                name,
                launch["restart"] if launch else "?",
                launch["run"][:200] if launch else "?",
                old.launch["restart"],
                old.epoch,
                old.generation,
            )
            return None
        latest = now - max(old.last_heard(r) for r in alive)
        return (
            f"job {old.name!r} (epoch {old.epoch}, generation {old.generation}, committed iteration "
            f"{old.cut if old.cut >= old.base else 'none yet'}) is owned by a live run: "
            f"{len(alive)} of its {old.world} ranks sent a heartbeat within the last {window:g} s "
            f"(SHADOW_WORKER_LOST_S), the latest {latest:.1f} s ago. A launch never takes over a live job "
            "(overwrite=True neither): this attach waits until they are silent for that long and then takes "
            "over; stop the other run, or detach it on purpose with `shadow drop job=" + old.name + " force=true`"
        )

    def _start_job(self, name: str, ranks: dict) -> None:
        """Every rank of job ``name`` has asked to attach: check what they agree on, the
        workers' memory, the tiers and the job's lineage, then configure a new epoch. Nothing
        about the current job changes before every check has passed."""
        msgs = [m for _, m in (ranks[r] for r in sorted(ranks))]
        idents = {r: ranks[r][0] for r in ranks}
        first = msgs[0]

        def fail(text: str) -> None:
            logger.error("attach of job %s refused: %s", name, text)
            for ident in idents.values():
                self.out.reply([ident], "error", code="refused", message=text)

        layout = self._agreed_layout(msgs)
        if isinstance(layout, str):
            return fail(layout)
        problem = self._memory_problem(name, layout, first["optim"])
        if problem is not None:
            self.state.rejected.add("attach_memory")
            return fail(problem)
        problem = self.persist.hold_unscanned(name)
        if problem is not None:  # memory and the readable tiers still protect the run
            self.state.rejected.add("attach_tier_unreadable")
            logger.error(
                "attach of job %s goes on without the tier(s) it cannot read: %s; they are not written "
                "until a later attach reads them (fix the path, permissions or reachability)",
                name,
                problem,
            )
        old = self.state.job
        if old is not None and old.name != name and old.status != JobStatus.DETACHED and not first["overwrite"]:
            self.state.refuse("trainer", "replace_without_overwrite")  # (attaches start from the loop too)
            return fail(
                f"the cluster holds job {old.name!r} (committed iteration {old.cut}), which has not detached; "
                f"attach job {name!r} with overwrite=True to replace it (its in-memory checkpoint is dropped), "
                "or close that job's session first"
            )
        generation = self._generation(name, msgs, old)
        if isinstance(generation, str):
            return fail(generation)
        took_over = self._takeover(name, msgs, old)
        keep = _keepable(name, msgs, generation, old)
        self._new_epoch(name, first, layout, idents, generation, old, took_over, keep)

    def _takeover(self, name: str, msgs: list[dict], old: JobRec | None) -> str:
        """What the new ranks of job ``name`` are told when they take over a job whose
        previous run did not detach (its ranks crashed or were killed): the old epoch and
        generation, and how long its ranks have been silent; "" otherwise (a new job, the
        old one detached, or its own ranks re-attaching)."""
        if old is None or old.status == JobStatus.DETACHED:
            return ""
        if old.name == name and all(_proves_owner(old, r, m.get("owner")) for r, m in enumerate(msgs)):
            return ""
        silent = time.monotonic() - max((old.last_heard(r) for r in range(old.world)), default=old.created)
        text = (
            f"took over job {old.name!r} from its previous run (epoch {old.epoch}, generation {old.generation}, "
            f"committed iteration {old.cut if old.cut >= old.base else 'none'}), whose ranks were last heard "
            f"{silent:.1f} s ago and never detached"
        )
        logger.warning("job %s: %s", name, text)
        return text

    @staticmethod
    def _agreed_layout(msgs: list[dict]) -> Layout | str:
        """The layout every rank's ``attach`` agrees on, or why there is none."""
        first = msgs[0]
        if any(
            m["world"] != first["world"]
            or m["layout_hash"] != first["layout_hash"]
            or m["iteration"] != first["iteration"]
            for m in msgs
        ):
            return "ranks disagree on world size, layout or start iteration"
        if first["layout"] is None:
            return "rank 0 did not send the layout"
        try:
            layout = Layout.from_dict(first["layout"])
        except ValueError as exc:
            return str(exc)
        if layout.hash != first["layout_hash"]:
            return "layout does not match its hash"
        return layout

    def _generation(self, name: str, msgs: list[dict], old: JobRec | None) -> int | str:
        """The generation job ``name`` goes on as from the ranks' start iteration (a new one,
        recorded in every tier, when that goes back behind what the cluster holds), or why it
        may not go back."""
        first = msgs[0]
        generation, held = self.persist.lineage(name)
        if old is not None and old.name == name:
            generation, held = max(generation, old.generation), max(held, old.cut)
        base = first["iteration"]
        if held <= base:
            return generation
        # going back behind what the cluster holds: asked for (overwrite), or the ranks restored
        # that very iteration from this cluster (e.g. a restore fell back past a damaged one)
        vouched = self._restored_here(name, base, generation, [m.get("restored") for m in msgs], old)
        if not first["overwrite"] and not vouched:
            return (
                f"the cluster holds job {name!r} at iteration {held}, newer than this trainer's iteration "
                f"{base}; restore first (trainer_hooks.restore) or attach with overwrite=True"
            )
        generation += 1  # what is newer than the base is superseded, in memory and in every tier
        self.persist.supersede(name, generation, base)
        logger.warning(
            "job %s goes on from iteration %d (%s); checkpoints after it, up to %d, are superseded (generation %d)",
            name,
            base,
            "restored from this cluster" if vouched else "overwrite",
            held,
            generation,
        )
        return generation

    def _new_epoch(
        self,
        name: str,
        first: dict,
        layout: Layout,
        idents: dict,
        generation: int,
        old: JobRec | None,
        took_over: str = "",
        keep: int | None = None,
    ) -> None:
        """The job's new epoch: its record, the tiers reset to its base, and every worker
        configured for its range with a fresh data key (``keep``: offered to keep that
        epoch's state as the base, see :func:`_keepable`)."""
        # until the new epoch holds its base, restores read the old epoch's last cut
        st = self.state
        st.retired = memory_info(st, old.name) if old is not None else None
        st.epoch += 1
        bounds = shard_bounds(layout.total, st.nshards)
        ranges = [bounds[i % st.nshards] for i in range(len(st.workers))]
        base = first["iteration"]
        job = st.job = JobRec(
            name,
            job_id_for(name),
            st.epoch,
            first["layout"],
            first["layout_hash"],
            first["world"],
            first["optim"],
            base,
            ranges,
            idents,
        )
        job.cut = base - 1
        job.generation = generation
        job.launch = _launch(first.get("launch"))
        job.took_over = took_over
        same_ranges = old is not None and [tuple(r) for r in ranges] == [tuple(r) for r in old.ranges]
        job.keep = keep if same_ranges else None  # each worker keeps its own range
        self.persist.reset(base)
        st.tokens.clear()
        for w in st.workers:
            w.configured, w.prepared, w.stale, w.kept = -1, base - 1, "", False
            w.undelivered, w.out_of_service = "", False
            st.new_data_key(w)
            self.out.to_worker(w, "configure", **configure_fields(st, w, self.persist, base, keep=job.keep))
        logger.info(
            "job %s epoch %d: configuring %d workers for %d params (%d elements)",
            name,
            st.epoch,
            len(self.state.workers),
            len(layout.params),
            layout.total,
        )

    def _memory_problem(self, name: str, layout: Layout, optim: dict) -> str | None:
        """Why the workers could not hold ``layout``: the ranges of the workers of each
        host need more than the least free memory a worker there reports."""
        bounds = shard_bounds(layout.total, self.state.nshards)
        persist = self.persist.config.local.enabled
        hosts: dict[str, list] = {}
        for w in self.state.workers:
            start, stop = bounds[w.id % self.state.nshards]
            need = session_bytes(stop - start, nfields(optim), len(layout.params), persist, self.state.tuning)
            hosts.setdefault(_host(w.data), []).append((w, need))
        for host, held in sorted(hosts.items()):
            known = [w.memory for w, _ in held if w.memory >= 0]
            need = sum(n for _, n in held)
            if not known or need <= min(known):
                continue
            w, one = max(held, key=lambda x: x[1])
            start, stop = bounds[w.id % self.state.nshards]
            shared = (
                f" (with {len(held) - 1} other workers on host {host}: {human(need)} in all)" if len(held) > 1 else ""
            )
            return (
                f"not enough memory: the layout of job {name!r} ({layout.total} elements) needs about "
                f"{human(one)} on worker {w.id} (range [{start}, {stop}): optimizer state, gradient slots"
                f"{', checkpoint images' if persist else ''}){shared}, and host {host} has {human(min(known))} "
                f"free; add workers (each holds 1/{self.state.nshards} of the elements), train a smaller model, or "
                "free memory on that host"
            )
        return None

    def _restored_here(self, name: str, base: int, generation: int, records: list, old: JobRec | None) -> bool:
        """Whether every rank's claim to have restored iteration ``base`` of job ``name`` from
        this cluster checks out here, not only by what it says: from its memory, only what
        the memory holds (the current generation at ``base``); from a tier, only a checkpoint
        of ``base`` that this coordinator finds complete, and neither superseded nor diverged,
        in the tier the claim names, read with the manifest key where it signs. A claim that
        does not check out is refused and counted (``restored_unchecked``)."""
        held_in_memory = old.cut if old is not None and old.name == name else None
        checked: dict[str, bool] = {}
        for r in records:
            if not isinstance(r, dict) or r.get("job") != name or r.get("iteration") != base:
                return False
            tier = str(r.get("tier"))
            if tier == "memory":
                ok = r.get("generation") == generation and held_in_memory == base
            else:
                if tier not in checked:
                    checked[tier] = self._tier_holds(tier, str(r.get("source", "")), name, base)
                ok = checked[tier]
            if not ok:
                self.state.rejected.add("restored_unchecked")
                logger.warning(
                    "an attach of job %s claims a restore of iteration %d from %s that this coordinator cannot "
                    "check (its %s holds no such complete checkpoint)",
                    name,
                    base,
                    tier,
                    tier,
                )
                return False
        return True

    def _tier_holds(self, tier: str, source: str, name: str, base: int) -> bool:
        """Whether tier ``tier`` (whose root ``source`` must be under) holds a complete checkpoint
        of ``name`` at ``base`` that a restore may take (read here, signatures checked)."""
        t = self.persist.tiers.get(tier)
        if t is None or not source.startswith(local_path(t.root).rstrip("/") + "/"):
            return False
        try:
            found = checkpoints.list_checkpoints(t.storage, t.name, name, sign_key=self.persist.sign_key)
        except Exception as exc:  # an unreadable tier vouches for nothing
            logger.warning("tier %s: cannot check a restore claim: %s: %s", t.name, type(exc).__name__, exc)
            return False
        return any(c.iteration == base and not c.superseded and not c.diverged for c in found)

    def on_detach(self, env: list[bytes], msg: Msg) -> None:
        if msg["epoch"] == WITHDRAW:  # a rank gave up waiting: its held attach goes (from its connection only)
            for name, p in list(self.state.pending.items()):
                held = p["ranks"].get(msg["rank"])
                if held is not None and held[0] == env[0]:
                    del p["ranks"][msg["rank"]]
                    p["held"] -= p["bytes"].pop(msg["rank"], 0)
                    logger.info("attach of job %s rank %d withdrawn by the rank", name, msg["rank"])
                    if not p["ranks"]:
                        del self.state.pending[name]
            return
        job = self.state.job
        if job is not None and msg["epoch"] == job.epoch and self.state.from_rank(env, msg["rank"]):
            job.detached.add(msg["rank"])
            if len(job.detached) == job.world:
                job.status = JobStatus.DETACHED
                logger.info("job %s epoch %d detached at iteration %d", job.name, job.epoch, job.cut)


def _host(endpoint: str) -> str:
    """The host of a worker's ``tcp://host:port`` data endpoint (workers on one host
    share its memory)."""
    return endpoint.removeprefix("tcp://").rsplit(":", 1)[0]


def _keepable(name: str, msgs: list[dict], generation: int, old: JobRec | None) -> int | None:
    """The epoch of ``old`` whose state the workers may keep as the base of job ``name``'s
    new epoch, instead of taking it from the ranks' STATE frames, or None. Offered when the
    cluster's memory holds exactly the ranks' start iteration, in the same layout, world and
    optimizer, of an epoch that never diverged, and every rank says it restored that
    iteration from this memory and can prove it (``keep``): not for a resync (``owner``).
    An offer is only that: each rank then proves, by a digest of every run it would have
    sent, that its state is the kept one, and a worker that finds any other goes stale (a
    resync then sends the state whole)."""
    first = msgs[0]
    base = first["iteration"]
    if (
        old is None
        or old.name != name
        or old.diverged is not None
        or old.cut != base
        or old.cut < old.base
        or old.layout_hash != first["layout_hash"]
        or old.world != first["world"]
        or old.optim != first["optim"]
    ):
        return None
    for m in msgs:
        r = m.get("restored")
        if m.get("keep") is not True or m.get("owner") is not None or not isinstance(r, dict):
            return None
        if r.get("tier") != "memory" or r.get("job") != name or r.get("iteration") != base:
            return None
        if r.get("generation") != generation:
            return None
    return old.epoch


def _proves_owner(job: JobRec, rank: int, owner: object) -> bool:
    """``owner`` (an attach's) proves its sender is rank ``rank`` of ``job``'s epoch: the
    epoch and the rank token its ``attached`` gave it."""
    return (
        isinstance(owner, dict)
        and owner.get("epoch") == job.epoch
        and 0 <= rank < job.world
        and job.rank_token_ok(rank, owner.get("token"))
    )


def _launch(value: object) -> dict | None:
    """An attach's ``launch`` (``{"run": str, "restart": int}``), or None when absent or
    not of that form."""
    if (
        isinstance(value, dict)
        and isinstance(value.get("run"), str)
        and 0 < len(value["run"]) <= 256
        and isinstance(value.get("restart"), int)
        and not isinstance(value["restart"], bool)
        and value["restart"] >= 0
    ):
        return {"run": value["run"], "restart": value["restart"]}
    return None


def _next_round(held: dict | None, launch: object) -> bool:
    """``launch`` is a later restart round of the launch that attached ``held``: its
    launcher ended the earlier round's ranks before starting these."""
    new = _launch(launch)
    return held is not None and new is not None and new["run"] == held["run"] and new["restart"] > held["restart"]
