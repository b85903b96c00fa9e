"""Admission on a shared cluster: what a job needs (memory, cores) and whether the host has
it beside the jobs already admitted. A job that does not fit is refused at its attach,
with what it needs and what is free, never by failing later."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from shadow.core import optimizers
from shadow.core.layout import Layout
from shadow.planner.sizing import JOB_WORKER_FIXED_GB

GB = 1e9
#: what a job worker process costs beyond its shard (the interpreter, numba, sockets)
WORKER_FIXED_BYTES = int(JOB_WORKER_FIXED_GB * GB)
#: a worker's persistence images when a tier is configured (``shadow plan``'s default)
PERSIST_IMAGES = 2
#: iterations of gradients a worker holds besides its state: the lag, and the one arriving
INFLIGHT_ITERATIONS = 2


@dataclass(frozen=True)
class Need:
    """What one job holds on this host: its elements' state (``fields`` fp32 arrays per
    element, plus the persistence images) on ``replicas`` workers per shard, the gradients in
    flight, and ``workers`` job worker processes; ``cores`` pinned to it (0: not pinned)."""

    elements: int
    fields: int
    replicas: int
    workers: int
    images: int
    cores: int

    @property
    def bytes(self) -> int:
        per_element = 4 * (self.fields * (1 + self.images) + INFLIGHT_ITERATIONS)
        return self.elements * per_element * self.replicas + self.workers * WORKER_FIXED_BYTES

    def part(self, k: int) -> Need:
        """What ``k`` of its ``workers`` hold (a spread job's part on one host)."""
        return replace(self, elements=-(-self.elements * k // self.workers), workers=k)

    def describe(self, optim: str) -> str:
        return (
            f"{_count(self.elements)} parameters, {optim} ({self.fields} fp32 arrays each), "
            f"{self.replicas} replica{'s' if self.replicas > 1 else ''}, {self.workers} workers"
        )


def _count(n: int) -> str:
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"


def need_of(msg: dict[str, Any], workers: int, replicas: int, tiers: bool, cores: int) -> tuple[Need, str]:
    """The need of the job rank 0's ``attach`` describes (its layout and optimizer), and the
    optimizer's name; ``ValueError`` naming what is wrong with them."""
    if msg["layout"] is None:
        raise ValueError("an attach without the layout (only rank 0's carries it) cannot be admitted")
    elements = Layout.from_dict(msg["layout"]).total
    spec = optimizers.spec_of(msg["optim"])
    fields = len(optimizers.state_fields(msg["optim"]))
    images = PERSIST_IMAGES if tiers else 0
    return Need(elements, fields, replicas, workers, images, cores), spec.label


def gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def memory_budget(memory_gb: float) -> int:
    """The bytes the jobs may hold here: ``memory_gb``, or 80% of what is free now."""
    if memory_gb:
        return int(memory_gb * GB)
    free = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(0.8 * (free or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")))


class Budget:
    """The host's memory and cores, and what each admitted job holds of them."""

    def __init__(self, memory: int, cores: Iterable[int]) -> None:
        self.memory = memory
        self.cores = sorted(cores)
        self.held: dict[str, tuple[int, tuple[int, ...]]] = {}  # job -> (bytes, cores)

    def used(self) -> int:
        return sum(b for b, _ in self.held.values())

    def free_cores(self) -> list[int]:
        taken = {c for _, cs in self.held.values() for c in cs}
        return [c for c in self.cores if c not in taken]

    def admit(self, job: str, need: Need, optim: str, ended: dict[str, str]) -> tuple[int, ...] | str:
        """The cores given to ``job`` (empty: not pinned) when it fits, else why not, with the
        figures. ``ended``: jobs that hold memory though their trainers are gone, and why."""
        free = self.memory - self.used()
        cores = self.free_cores()
        short = []
        if need.bytes > free:
            short.append(f"it needs {gb(need.bytes)} of memory and {gb(max(0, free))} of {gb(self.memory)} is free")
        if need.cores > len(cores):
            short.append(f"it needs {need.cores} cores of its own and {len(cores)} of {len(self.cores)} are free")
        if not short:
            given = tuple(cores[: need.cores])
            self.held[job] = (need.bytes, given)
            return given
        others = ", ".join(f"{j} {gb(b)}{f' ({len(cs)} cores)' if cs else ''}" for j, (b, cs) in self.held.items())
        gone = "; ".join(f"{j} ({why})" for j, why in ended.items())
        return (
            f"attach of job {job!r} refused: {' and '.join(short)} on this shared cluster ({need.describe(optim)}); "
            f"jobs holding it: {others or 'none'}; ended jobs among them: "
            + (f"{gone}: `shadow drop job=NAME` frees one" if gone else "none")
        )

    def release(self, job: str) -> None:
        self.held.pop(job, None)
