"""Paths under a tier's root that fsspec takes literally.

fsspec reads ``*``, ``?`` and ``[`` as glob syntax not only in :meth:`glob` but also in
``rm`` and ``mv``/``copy`` (on every file system but the local one, whose ``rm`` takes
paths as they are). A root such as ``/data/ckpt[1]`` would then match nothing, or worse,
match and delete a sibling's files. Patterns here escape the fixed parts with
:func:`glob.escape`, which fsspec's glob (local, memory, object stores) understands.
"""

from __future__ import annotations

import glob
import posixpath
import re

from shadow.jobs import check_job_name

_MAGIC = re.compile(r"[*?[]")


def pattern(base: str, job: str | None, *rest: str) -> str:
    """A glob pattern ``<base>/<job or *>/<rest...>`` whose base and job match literally
    (``rest`` is the pattern part); a job name must be valid (:func:`check_job_name`)."""
    if job is not None:
        check_job_name(job)
    return posixpath.join(glob.escape(base), glob.escape(job) if job is not None else "*", *rest)


def literal(fs, path: str) -> str:
    """``path`` as a glob-expanding fsspec call (``rm``) must be given it to mean exactly it."""
    from fsspec.implementations.local import LocalFileSystem

    return path if isinstance(fs, LocalFileSystem) else glob.escape(path)


def move(fs, src: str, dst: str) -> None:
    """Move one file; ``fs.mv`` where the paths hold no glob characters, else a literal
    copy and delete (``mv`` would read them as a pattern)."""
    if _MAGIC.search(src) or _MAGIC.search(dst):
        fs.cp_file(src, dst)
        fs.rm_file(src)
    else:
        fs.mv(src, dst)
