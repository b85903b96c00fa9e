"""Glob patterns under a tier's root that match its fixed parts literally.

fsspec reads ``*``, ``?`` and ``[`` as glob syntax, so a root such as ``/data/ckpt[1]``
would match nothing, or a sibling's files. Patterns here escape the fixed parts with
:func:`glob.escape`, which fsspec's glob (local, memory, object stores) understands; the
storage's ``rm`` and ``move`` take their paths literally (:mod:`shadow.storage.remote`).
"""

from __future__ import annotations

import glob
import posixpath

from shadow.core.jobs import check_job_name


def pattern(base: str, job: str | None, *rest: str) -> str:
    """A glob pattern ``<base>/<job or *>/<rest...>`` whose base and job match literally
    (``rest`` is the pattern part); a job name must be valid (:func:`check_job_name`)."""
    if job is not None:
        check_job_name(job)
    return posixpath.join(glob.escape(base), glob.escape(job) if job is not None else "*", *rest)
