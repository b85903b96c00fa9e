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

from shadow.errors import ShadowError

JOB_NAME_RULE = "letters, digits, '.', '_' and '-' only (A-Za-z0-9._-), not '.' or '..'"
_VALID = re.compile(r"[A-Za-z0-9._-]+")


class InvalidJobNameError(ShadowError, ValueError):
    """A job name that cannot be a directory under the persist root; nothing was written."""


def suggest_job_name(name: object) -> str:
    """A valid name close to ``name`` (other characters become ``-``), for error messages."""
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name) if name is not None else "").strip("-.")
    return text or "my-job"


def job_name_problem(name: object) -> str | None:
    """Why ``name`` is not a valid job name (naming it, the rule and a fix), or None if it is."""
    if isinstance(name, str) and _VALID.fullmatch(name) and name not in (".", ".."):
        return None
    return (
        f"job name {name!r} is not allowed: a job name is one directory name, {JOB_NAME_RULE}; "
        f"use e.g. job={suggest_job_name(name)!r}"
    )


def check_job_name(name: object) -> str:
    """``name`` if it is a valid job name, else :class:`InvalidJobNameError` saying why."""
    problem = job_name_problem(name)
    if problem is not None:
        raise InvalidJobNameError(problem)
    return name  # type: ignore[return-value]
