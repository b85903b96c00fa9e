"""The lineage of an attaching job: the generation it goes on as from its ranks' start
iteration. Going back behind what the cluster holds takes ``overwrite``, or a claim by every
rank to have restored that very iteration from this cluster, checked here against the memory
and the tiers; either way a new generation, recorded in every tier, supersedes what was newer."""

from __future__ import annotations

import logging

from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.records import JobRec
from shadow.persist import checkpoints
from shadow.storage.url import local_path

logger = logging.getLogger(__name__)


class Lineage:
    """Which generation an attaching job goes on as (:meth:`generation`), and whether its
    ranks' restore claims check out (counted ``restored_unchecked`` when not)."""

    def __init__(self, state: ClusterState, persist: Persistence) -> None:
        self.state, self.persist = state, persist

    def generation(self, name: str, msgs: list[dict], old: JobRec | None) -> int | str:
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
        self.persist.lane.flush()  # the manifests submitted before are written
        try:
            found = checkpoints.list_checkpoints(t.storage, t.name, name, sign_key=self.persist.sign_key)
        except Exception as exc:  # an unreadable tier vouches for nothing
            logger.warning("tier %s: cannot check a restore claim: %s: %s", t.name, type(exc).__name__, exc)
            return False
        return any(c.iteration == base and not c.superseded and not c.diverged for c in found)
