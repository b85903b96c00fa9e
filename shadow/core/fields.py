"""The state arrays of a checkpoint, by their number: on the wire (a STATE frame's field),
in a worker's memory and on disk (a shard file's entry is the name in lower case). The
numbers and names never change: an optimizer's state tensors ride in these slots."""

from __future__ import annotations

from enum import IntEnum


class Field(IntEnum):
    """Which state array a STATE frame carries (GRAD and COMMIT frames use ``GRAD``)."""

    GRAD = 0
    PARAM = 1
    EXP_AVG = 2
    EXP_AVG_SQ = 3
    MAX_EXP_AVG_SQ = 4
