"""What a reader checks of the shards a manifest names before it reads them.

A manifest is data found on storage: the shard ranges it names must tile the flat space
``[0, total)`` exactly, or a restore would hand out memory no shard wrote. (That each
file is the checkpoint's own -- a regular file inside its directory, of the recorded
size, checked before a byte is read -- is the storage's :meth:`shard_file`.)
"""

from __future__ import annotations


def tiling_problem(shards: list[dict], total: int) -> str | None:
    """What is wrong with the ranges of ``shards`` as a tiling of ``[0, total)``, or None."""
    at = 0
    for s in sorted(shards, key=lambda s: (s["start"], s["stop"])):
        if s["start"] != at:
            what = "overlap" if s["start"] < at else "leave a gap"
            return f"shard ranges do not tile [0, {total}): they {what} at element {min(at, s['start'])}"
        at = s["stop"]
    if at != total:
        return f"shard ranges do not tile [0, {total}): they end at element {at}"
    return None
