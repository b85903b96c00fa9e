"""A keyed cluster's keys for tests (:func:`shadow.testing.keys.role_keys`)."""

from __future__ import annotations

from shadow.testing.keys import role_keys

__all__ = ["role_keys"]
