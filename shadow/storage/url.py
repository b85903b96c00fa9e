"""The one place that tells a local tier root from a remote one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shadow.storage.base import Storage
from shadow.storage.modes import DIR_MODE, FILE_MODE


def storage_for(
    url: str | Storage,
    file_mode: int = FILE_MODE,
    dir_mode: int = DIR_MODE,
    options: Mapping[str, Any] | None = None,
) -> Storage:
    """The storage behind a tier root: :class:`LocalStorage` for a path or a ``file://``
    URL, creating files with permissions ``file_mode`` and directories ``dir_mode``
    (:mod:`shadow.storage.modes`); :class:`FsspecStorage` for any other URL (its back end
    decides permissions; ``options``: the back end's fsspec storage options); a
    :class:`Storage` is returned as it is."""
    if isinstance(url, Storage):
        return url
    if "://" not in url or url.startswith("file://"):
        from shadow.storage.local import LocalStorage  # fsspec loads with the first storage made

        return LocalStorage(url, file_mode, dir_mode)
    from shadow.storage.remote import FsspecStorage

    return FsspecStorage(url, options)


def source_tier(source: str) -> str:
    """The tier name a checkpoint directory named on a command line is reported under:
    ``remote`` for a URL (a ``file://`` one too: it names the shared copy), ``local`` for
    a plain path. Which storage reads it is :func:`storage_for`'s decision."""
    return "remote" if "://" in source else "local"


def local_path(root: str) -> str:
    """A local tier root as a path (a ``file://`` URL without its scheme); any other root as it is."""
    return root[len("file://") :] if root.startswith("file://") else root
