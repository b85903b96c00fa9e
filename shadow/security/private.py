"""Directories only this user may use: the kernel cache, the per-user state (a worker's
slot tokens).

numba loads the index files it finds in its cache (pickles), and a worker sends whatever
token file it finds to its coordinator: a directory another account owns or may write to
(a pre-created one under a shared ``/tmp``, a link to one) must never be taken. Each is
created 0700 where missing and checked where it exists."""

from __future__ import annotations

import os
import stat
import tempfile


def private_problem(path: str) -> str:
    """Why ``path`` may not be this user's private directory ("" if it may): it is created
    (0700, with its parents) when missing, and must then be a directory, not a link, owned by
    this user and writable by no one else."""
    try:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        info = os.lstat(path)
    except OSError as exc:
        return f"cannot create it ({exc})"
    return dir_problem(info, 0o022)


def dir_problem(info: os.stat_result, others: int) -> str:
    """Why a directory with ``info`` (from ``lstat``) is not this user's alone ("" if it is):
    not a directory (a link or a file), another owner, or any of the mode bits ``others``
    (0o022: others may write to it; 0o077: others may use it at all)."""
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory (a link or a file)"
    if info.st_uid != os.getuid():
        return f"it belongs to uid {info.st_uid}, not to this user ({os.getuid()})"
    if info.st_mode & others:
        who = "may write to it" if others == 0o022 else "may use it"
        return f"others {who} (mode {stat.S_IMODE(info.st_mode):o})"
    return ""


def state_dir() -> str | None:
    """This user's shadow state directory (``$XDG_STATE_HOME/shadow``, else
    ``~/.local/state/shadow``; a private ``shadow-state-<uid>`` under the temporary
    directory where that cannot be used), or None when neither is private."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    for path in (os.path.join(base, "shadow"), os.path.join(tempfile.gettempdir(), f"shadow-state-{os.getuid()}")):
        if not private_problem(path):
            return path
    return None
