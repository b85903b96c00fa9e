"""Job names: one rule, checked wherever a name enters (attach, the coordinator, the
catalog, manifests read back).

A job name becomes a directory under every tier's root (``<root>/<job>/...``) and part
of glob patterns over it, so it must be a single, plain path component: letters,
digits, ``.``, ``_`` and ``-``, and not ``.`` or ``..``. Anything else could name
another job's checkpoints (``exp*``), match nothing (``gpt[small]``) or write outside
the root (``../escape``).
"""

from __future__ import annotations

import re

from shadow.core.errors import ShadowError

#: the longest job name: a directory name under every tier's root (255 bytes on most file
#: systems), a label of every metric and a part of every log line
JOB_NAME_MAX = 200
JOB_NAME_RULE = (
    f"letters, digits, '.', '_' and '-' only (A-Za-z0-9._-), at most {JOB_NAME_MAX} characters, not '.' or '..'"
)
_VALID = re.compile(r"[A-Za-z0-9._-]+")


class InvalidJobNameError(ShadowError, ValueError):
    """A job name that cannot be a directory under the persist root; nothing was written."""


def suggest_job_name(name: object) -> str:
    """A valid name close to ``name`` (other characters become ``-``), for error messages."""
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name) if name is not None else "").strip("-.")
    return text[:JOB_NAME_MAX].rstrip("-.") or "my-job"


def job_name_problem(name: object) -> str | None:
    """Why ``name`` is not a valid job name (naming it, the rule and a fix), or None if it is."""
    if isinstance(name, str) and len(name) <= JOB_NAME_MAX and _VALID.fullmatch(name) and name not in (".", ".."):
        return None
    shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
    return (
        f"job name {shown} is not allowed: a job name is one directory name, {JOB_NAME_RULE}; "
        f"use e.g. job={suggest_job_name(name)!r}"
    )


def check_job_name(name: object) -> str:
    """``name`` if it is a valid job name, else :class:`InvalidJobNameError` saying why."""
    problem = job_name_problem(name)
    if problem is not None:
        raise InvalidJobNameError(problem)
    return name  # type: ignore[return-value]


_PATTERN = re.compile(r"[A-Za-z0-9._*?-]+")


def job_pattern_problem(pattern: object) -> str | None:
    """Why ``pattern`` names neither a job nor a pattern of job names (``fnmatch``'s ``*`` and
    ``?`` over the job name rule: ``team-a-*``), or None. A job-scoped key's directory is named
    with one (:func:`shadow.security.load_peers`)."""
    if isinstance(pattern, str) and len(pattern) <= JOB_NAME_MAX and _PATTERN.fullmatch(pattern):
        if pattern not in (".", ".."):
            return None
    return (
        f"{pattern!r} names neither a job nor a pattern of job names: {JOB_NAME_RULE}, "
        "with '*' or '?' for any characters (e.g. team-a or team-a-*)"
    )
