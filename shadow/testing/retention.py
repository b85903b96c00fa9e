"""The retention contract of a persisted tier, as a fault scenario checks it after the fact
(:func:`retention_problems`)."""

from __future__ import annotations

from collections.abc import Iterable

from shadow.persist import checkpoints
from shadow.storage import Storage, storage_for


def retention_problems(
    root: str | Storage,
    job: str,
    keep: int,
    in_flight: Iterable[int] = (),
    copying: Iterable[int] = (),
    killed: bool = False,
    verify: bool = True,
) -> list[str]:
    """What the tier at ``root`` holds of ``job`` that breaks retention's contract; empty
    when it holds. The contract, as :func:`shadow.persist.retention.retain` and the
    coordinator's local tier keep it:

    * at most ``keep`` complete checkpoints (``keep`` 0: any number), however far apart
      their iterations are (retention counts complete checkpoints, not iterations: while
      the writers are behind and requests are skipped, an old one stays among the newest
      ``keep``); more where remote copies are in flight (``copying``: their iterations;
      the local tier keeps every one from the oldest of them on), and one more with
      ``killed`` (the coordinator died between a manifest and the retention after it);
    * no torn directory (shards, no manifest) older than the newest complete checkpoint,
      but those of iterations in ``in_flight`` (still being written, or abandoned by a kill
      mid-write);
    * with ``verify``: if any complete checkpoint is held, at least one reads back intact
      (retention never leaves only damaged ones where an intact one was held; a caller that
      damaged every one itself should not ask)."""
    st = storage_for(root)
    done = checkpoints.list_checkpoints(st, job=job)
    problems = []
    if keep > 0:
        allowed = keep
        held = sorted(copying)
        if held:
            allowed = max(allowed, sum(1 for c in done if c.iteration >= held[0]))
        allowed += 1 if killed else 0
        if len(done) > allowed:
            problems.append(
                f"{len(done)} complete checkpoints of {job} under {st.url} "
                f"({', '.join(str(c.iteration) for c in done)}), more than {allowed} (keep={keep})"
            )
    if done:
        newest = (done[-1].generation, done[-1].iteration)
        busy = set(in_flight)
        for d in checkpoints.list_torn(st, job):
            key = checkpoints.dir_key(d)
            if key is not None and key < newest and key[1] not in busy:
                problems.append(f"torn {d} is older than the newest complete checkpoint (iteration {newest[1]})")
    if verify and done:
        damage = {c.iteration: checkpoints.verify(c) for c in done}
        if all(damage.values()):
            problems.append(
                f"no complete checkpoint of {job} under {st.url} reads back intact: "
                + "; ".join(p for found in damage.values() for p in found)
            )
    return problems
