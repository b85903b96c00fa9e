"""Starting a job's new epoch once every rank's ``attach`` is in: whether a live run still
owns the job (:meth:`EpochStart.live_owner`), the checks every attach passes before anything
about the current job changes, taking over from a run that never detached, and the new
epoch itself (the job's record, the tiers reset to its base, every worker configured for its
range with a fresh data key)."""

from __future__ import annotations

import logging
import time

from shadow.coordinator.attach_checks import (
    agreed_layout,
    keepable,
    launch_of,
    memory_problem,
    next_round,
    proves_owner,
)
from shadow.coordinator.attach_lineage import Lineage
from shadow.coordinator.cluster import ClusterState, configure_fields
from shadow.coordinator.outbox import Outbox
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.queries import memory_info
from shadow.coordinator.records import JobRec, JobStatus, job_id_for
from shadow.coordinator.trainers import heard_window_s
from shadow.core.layout import Layout, shard_bounds

logger = logging.getLogger(__name__)


class EpochStart:
    """Starts the epoch of a job whose ranks have all attached (:meth:`start_job`), once no
    live run owns the job (:meth:`live_owner`); refusals go to every rank."""

    def __init__(self, state: ClusterState, out: Outbox, persist: Persistence) -> None:
        self.state, self.out, self.persist = state, out, persist
        self.lineage = Lineage(state, persist)

    def live_owner(self, name: str, ranks: dict) -> str | None:
        """Why the attach of job ``name`` (every rank's message in ``ranks``) may not start
        yet: the job the cluster holds still has an owner, a run whose ranks heartbeat
        within :func:`~shadow.coordinator.trainers.heard_window_s`. No launch takes over a
        live owner, whatever ``overwrite`` says; None once its ranks are silent (they are
        then taken over), and at once for the owner's own ranks re-attaching (a resync: they
        prove it with their rank tokens) or for the next round of the same elastic launch
        (torchrun's restarts, a Slurm requeue: the same run, a later restart round, whose
        launcher ended the round before)."""
        old = self.state.job
        if old is None or old.status == JobStatus.DETACHED:
            return None
        now, window = time.monotonic(), heard_window_s(self.state.tuning)
        alive = old.ranks_heard(now, window)
        if not alive:
            return None
        msgs = {r: m for r, (_, m) in ranks.items()}
        if old.name != name and not msgs[min(msgs)]["overwrite"]:
            return None  # refused at once by start_job: another job only replaces this one with overwrite
        layout = agreed_layout([msgs[r] for r in sorted(msgs)])
        if isinstance(layout, str) or self._memory_problem(name, layout, msgs[min(msgs)]["optim"]) is not None:
            return None  # refused at once by start_job, whoever owns the job (nothing changes)
        if old.name == name and all(proves_owner(old, r, m.get("owner")) for r, m in msgs.items()):
            return None
        launch = launch_of(msgs[min(msgs)].get("launch"))
        if old.name == name and old.launch is not None and next_round(old.launch, launch):
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
        return self._owned(old, alive, now, window) + (
            ": this attach waits until they are silent for that long and then takes over; stop the other run, "
            "or detach it on purpose with `shadow drop job=" + old.name + " force=true`"
        )

    def _owned(self, old: JobRec, alive: list[int], now: float, window: float) -> str:
        latest = now - max(old.last_heard(r) for r in alive)
        return (
            f"job {old.name!r} (epoch {old.epoch}, generation {old.generation}, committed iteration "
            f"{old.cut if old.cut >= old.base else 'none yet'}) is owned by a live run: "
            f"{len(alive)} of its {old.world} ranks sent a heartbeat within the last {window:g} s "
            f"(SHADOW_WORKER_LOST_S), the latest {latest:.1f} s ago. A launch never takes over a live job "
            "(overwrite=True neither)"
        )

    def _disagreement(self, name: str, text: str, ranks: dict) -> str:
        """``text`` (why the ranks' attaches disagree), and, when a live run owns job
        ``name``, that run: ranks that each restored from a live job's memory can restore
        different iterations, as it moves on between their restores, and the live owner is
        then the cause to fix, not the ranks."""
        old = self.state.job
        if old is None or old.name != name or old.status == JobStatus.DETACHED:
            return text
        msgs = {r: m for r, (_, m) in ranks.items()}
        if all(proves_owner(old, r, m.get("owner")) for r, m in msgs.items()):
            return text
        now, window = time.monotonic(), heard_window_s(self.state.tuning)
        alive = old.ranks_heard(now, window)
        if not alive:
            return text
        return (
            f"{text}; {self._owned(old, alive, now, window)}: ranks that restored from its memory while it "
            "trained on can name different iterations. Stop the other run, or detach it on purpose with "
            f"`shadow drop job={old.name} force=true`, then launch again"
        )

    def start_job(self, name: str, ranks: dict) -> None:
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

        layout = agreed_layout(msgs)
        if isinstance(layout, str):
            return fail(self._disagreement(name, layout, ranks))
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
        if old is not None and old.name != name and self.blocks(old) and not first["overwrite"]:
            self.state.refuse("trainer", "replace_without_overwrite")  # (attaches start from the loop too)
            return fail(
                f"the cluster holds job {old.name!r} (committed iteration {old.cut}), which has not detached and "
                f"whose ranks are still heard from; attach job {name!r} with overwrite=True to replace it (its "
                "in-memory checkpoint is dropped), or close that job's session first (a job whose ranks fall "
                f"silent for {heard_window_s(self.state.tuning):g} s, SHADOW_WORKER_LOST_S, blocks no other job)"
            )
        generation = self.lineage.generation(name, msgs, old)
        if isinstance(generation, str):
            return fail(generation)
        took_over = self._takeover(name, msgs, old)
        keep = keepable(name, msgs, generation, old)
        self._new_epoch(name, first, layout, idents, generation, old, took_over, keep)

    def blocks(self, old: JobRec) -> bool:
        """Whether job ``old``, which the cluster holds, keeps another job name out (without
        ``overwrite``): it has not detached and some rank of it was heard within
        :func:`~shadow.coordinator.trainers.heard_window_s`. A job whose ranks crashed blocks
        no one: the next job takes its memory over (its last iteration written to the local
        tier first, :meth:`~shadow.coordinator.cut.Cut.keep_last`)."""
        if old.status == JobStatus.DETACHED:
            return False
        return bool(old.ranks_heard(time.monotonic(), heard_window_s(self.state.tuning)))

    def _memory_problem(self, name: str, layout: Layout, optim: dict) -> str | None:
        return memory_problem(self.state, name, layout, optim, self.persist.config.local.enabled)

    def _takeover(self, name: str, msgs: list[dict], old: JobRec | None) -> str:
        """What the new ranks of job ``name`` are told when they take over a job whose
        previous run did not detach (its ranks crashed or were killed): the old epoch and
        generation, and how long its ranks have been silent; "" otherwise (a new job, the
        old one detached, or its own ranks re-attaching)."""
        if old is None or old.status == JobStatus.DETACHED:
            return ""
        if old.name == name and all(proves_owner(old, r, m.get("owner")) for r, m in enumerate(msgs)):
            return ""
        silent = time.monotonic() - max((old.last_heard(r) for r in range(old.world)), default=old.created)
        held = (
            f"(epoch {old.epoch}, generation {old.generation}, committed iteration "
            f"{old.cut if old.cut >= old.base else 'none'}), whose ranks were last heard {silent:.1f} s ago and "
            "never detached"
        )
        text = (
            f"took over job {old.name!r} from its previous run {held}"
            if old.name == name
            else f"took the cluster's memory over from job {old.name!r} {held}"
        )
        logger.warning("job %s: %s", name, text)
        return text

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
        epoch's state as the base, see :func:`~shadow.coordinator.attach_checks.keepable`)."""
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
        job.launch = launch_of(first.get("launch"))
        job.took_over = took_over
        same_ranges = old is not None and [tuple(r) for r in ranges] == [tuple(r) for r in old.ranges]
        job.keep = keep if same_ranges else None  # each worker keeps its own range
        self.persist.reset(base)
        st.tokens.clear()
        for w in st.workers:
            w.configured, w.prepared, w.stale, w.kept = -1, base - 1, "", False
            w.undelivered, w.out_of_service = "", False
            st.new_data_key(w, retire=True)
            self.out.to_worker(w, "configure", **configure_fields(st, w, self.persist, base, keep=job.keep))
        logger.info(
            "job %s epoch %d: configuring %d workers for %d params (%d elements)",
            name,
            st.epoch,
            len(self.state.workers),
            len(layout.params),
            layout.total,
        )
