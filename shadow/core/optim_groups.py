"""A param group's replay settings, by their former home: the groups now live with their
optimizers in :mod:`shadow.core.optimizers` (``AdamGroup`` in :mod:`.optimizers.adam`,
``SgdGroup`` in :mod:`.optimizers.sgd`); this module keeps the old import path.

Imports neither torch nor numba: the trainer and the service both use it.
"""

from __future__ import annotations

from shadow.core.optimizers import AdamaxGroup, AdamGroup, SgdGroup, group_from_wire

__all__ = ["AdamGroup", "AdamaxGroup", "SgdGroup", "group_from_wire"]
