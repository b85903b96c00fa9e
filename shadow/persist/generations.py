"""Generations of a job: when it goes on from an older iteration than a tier holds, a
record ``<root>/<job>/generation-<g>.json`` (its base iteration) marks every checkpoint of
an older generation after that base as superseded -- kept, but never the newest. A record
written because the shadow diverged from its trainer (``diverged``) makes what it
supersedes unrestorable too: those checkpoints hold a state the trainer never had.

With ``persist.sign=true`` the coordinator signs each record as it signs manifests
(:mod:`~shadow.persist.signing`, a tag of its own); a reader given the key ignores a record
whose signature is missing or wrong (a forged one would roll a restore back to its base)
and reports it."""

from __future__ import annotations

import glob
import json
import logging
import posixpath
import time

from shadow.persist import signing
from shadow.storage import Storage, storage_for

logger = logging.getLogger(__name__)

GENERATION = "generation-{:06d}.json"
GENERATION_FORMAT = "shadow-generation/1"


def write_generation(
    root: str | Storage,
    job: str,
    generation: int,
    base: int,
    diverged: bool = False,
    sign_key: bytes | None = None,
) -> None:
    """Record that ``job`` went on from iteration ``base`` in a new ``generation``: every
    checkpoint of an older generation after ``base`` is superseded (never picked as the
    newest again, but kept). Written before the new generation persists anything; signed
    with ``sign_key`` if given."""
    record: dict = {"format": GENERATION_FORMAT, "job": job, "generation": generation, "base": base}
    record["created"] = time.time()
    if diverged:
        record["diverged"] = True
    if sign_key is not None:
        record = signing.signed(record, sign_key, signing.GENERATION_TAG)
    st = storage_for(root)
    st.write_atomic(
        st.join(job, GENERATION.format(generation)), json.dumps(record, indent=1, sort_keys=True).encode(), True
    )


def read_generations(
    root: str | Storage,
    job: str,
    diverged: dict[int, int] | None = None,
    sign_key: bytes | None = None,
    skipped: list[tuple[str, str]] | None = None,
) -> dict[int, int]:
    """``{generation: base}`` recorded for ``job`` under ``root``; ``diverged``, if given,
    gets those written for a divergence. An unreadable record, and with ``sign_key`` one
    whose signature is missing or wrong, is skipped with a warning and appended to
    ``skipped`` (if given) as ``(path, reason)``."""
    st = storage_for(root)
    paths = st.list(posixpath.join(glob.escape(st.base), glob.escape(job), "generation-*.json"))
    return records_of(((path, lambda path=path: st.cat(path)) for path in paths), job, diverged, sign_key, skipped)


def records_of(
    records,
    job: str,
    diverged: dict[int, int] | None = None,
    sign_key: bytes | None = None,
    skipped: list[tuple[str, str]] | None = None,
) -> dict[int, int]:
    """:func:`read_generations` of ``records``, ``(path, read)`` pairs (``read()``: the
    record's bytes): a tier's files, or the records a coordinator's catalog carries, which
    a client checks with its own key exactly as it would read them from the tier."""
    out: dict[int, int] = {}
    for path, read in records:
        try:
            rec = json.loads(read())
            if not isinstance(rec, dict) or rec.get("format") != GENERATION_FORMAT or rec.get("job") != job:
                raise ValueError(f"not a generation record of job {job!r}")
            if sign_key is not None:
                signing.check(rec, sign_key, signing.GENERATION_TAG, f"generation record {path}")
            generation, base = int(rec["generation"]), int(rec["base"])
            if generation < 1 or base < -1:
                raise ValueError(f"generation {generation} from iteration {base} is not a generation record's")
            out[generation] = base
            if diverged is not None and rec.get("diverged") is True:
                diverged[int(rec["generation"])] = int(rec["base"])
        except signing.SignatureError as exc:
            logger.warning("ignoring generation record %s: %s", path, exc)
            if skipped is not None:
                skipped.append((path, str(exc)))
        except (ValueError, TypeError, KeyError, AttributeError, OSError) as exc:
            logger.warning("ignoring unreadable generation record %s: %s", path, exc)
            if skipped is not None:
                skipped.append((path, f"unreadable generation record: {exc}"))
    return out


def superseded(generation: int, iteration: int, generations: dict[int, int]) -> bool:
    """Whether checkpoint ``(generation, iteration)`` was superseded: a later generation
    went on from an earlier iteration."""
    return any(g > generation and iteration > b for g, b in generations.items())
