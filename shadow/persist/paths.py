"""A tier's root: a local path (or ``file://`` URL), or any other fsspec URL."""

from __future__ import annotations


def is_local(root: str) -> bool:
    return "://" not in root or root.startswith("file://")


def local_path(root: str) -> str:
    return root[len("file://") :] if root.startswith("file://") else root
