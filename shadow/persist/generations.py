"""Generations of a job: when it goes on from an older iteration than a tier holds, a
record ``<root>/<job>/generation-<g>.json`` (its base iteration) marks every checkpoint of
an older generation after that base as superseded -- kept, but never the newest. A record
written because the shadow diverged from its trainer (``diverged``) makes what it
supersedes unrestorable too: those checkpoints hold a state the trainer never had."""

from __future__ import annotations

import glob
import json
import logging
import posixpath
import time

from shadow.storage import Storage, storage_for

logger = logging.getLogger(__name__)

GENERATION = "generation-{:06d}.json"
GENERATION_FORMAT = "shadow-generation/1"


def write_generation(root: str | Storage, job: str, generation: int, base: int, diverged: bool = False) -> None:
    """Record that ``job`` went on from iteration ``base`` in a new ``generation``: every
    checkpoint of an older generation after ``base`` is superseded (never picked as the
    newest again, but kept). Written before the new generation persists anything."""
    record = {"format": GENERATION_FORMAT, "job": job, "generation": generation, "base": base, "created": time.time()}
    if diverged:
        record["diverged"] = True
    st = storage_for(root)
    st.write_atomic(
        st.join(job, GENERATION.format(generation)), json.dumps(record, indent=1, sort_keys=True).encode(), True
    )


def read_generations(root: str | Storage, job: str, diverged: dict[int, int] | None = None) -> dict[int, int]:
    """``{generation: base}`` recorded for ``job`` under ``root`` (unreadable records are
    skipped with a warning); ``diverged``, if given, gets those written for a divergence."""
    st = storage_for(root)
    out: dict[int, int] = {}
    for path in st.list(posixpath.join(glob.escape(st.base), glob.escape(job), "generation-*.json")):
        try:
            rec = json.loads(st.cat(path))
            if rec.get("format") != GENERATION_FORMAT or rec.get("job") != job:
                raise ValueError(f"format {rec.get('format')!r}, job {rec.get('job')!r}")
            out[int(rec["generation"])] = int(rec["base"])
            if diverged is not None and rec.get("diverged") is True:
                diverged[int(rec["generation"])] = int(rec["base"])
        except (ValueError, TypeError, KeyError, AttributeError, OSError) as exc:
            logger.warning("ignoring unreadable generation record %s: %s", path, exc)
    return out


def superseded(generation: int, iteration: int, generations: dict[int, int]) -> bool:
    """Whether checkpoint ``(generation, iteration)`` was superseded: a later generation
    went on from an earlier iteration."""
    return any(g > generation and iteration > b for g, b in generations.items())
