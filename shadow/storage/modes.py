"""Permissions of what a tier creates on a local file system: every checkpoint file and
directory gets exactly the configured mode (``persist.mode``; by default ``0600`` files and
``0700`` directories: a checkpoint is the whole training state), whatever the process's
umask. Each is created with its mode and then set to it (``fchmod``/``chmod``): the umask
can only narrow a mode at creation, so nothing is ever wider than configured, and a
restrictive umask does not leave it narrower.

Only what is created here is set; directories that already exist (a tier's root made by
an operator, say) keep their own permissions. A new directory keeps the set-group-ID bit
it inherits from a set-group-ID parent (``chmod g+s`` on the tier's root: everything below
then belongs to the root's group, for readers given ``persist.mode=0640``).
"""

from __future__ import annotations

import os
import stat

FILE_MODE = 0o600  #: a checkpoint file: the owner reads and writes it
DIR_MODE = 0o700  #: a checkpoint directory: the owner only
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a temporary file planted as a link is not followed


def makedirs(path: str, mode: int = DIR_MODE) -> None:
    """``os.makedirs(path, exist_ok=True)``, each directory it creates set to ``mode``."""
    path = path or "."
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path.rstrip("/"))
    if parent and parent != path and not os.path.exists(parent):  # a file there: mkdir says so, as os.makedirs
        makedirs(parent, mode)
    try:
        os.mkdir(path, mode)
    except FileExistsError:  # made meanwhile (another worker), or a file: as os.makedirs says
        if not os.path.isdir(path):
            raise
        return
    # a set-group-ID bit inherited from the parent stays: files made inside keep the tier's group
    os.chmod(path, mode | (os.stat(path).st_mode & stat.S_ISGID))


def create(path: str, mode: int = FILE_MODE, exclusive: bool = False) -> None:
    """Create ``path`` empty (or empty it) with permissions ``mode``, for a writer that opens
    it again (opening an existing file keeps its permissions). ``exclusive``: leave a file
    that exists (made meanwhile) as it is."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC) | _NOFOLLOW, mode)
    except FileExistsError:
        if exclusive:
            return
        raise
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
