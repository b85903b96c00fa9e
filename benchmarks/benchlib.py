"""Shared bits of the benchmarks: the machine a figure was measured on, the goals each
benchmark checks (:class:`Goal`, :func:`check`), a lazy matplotlib for their ``plot``, and
the example GPT of ``examples/gpt.py`` (:func:`example`).

Every ``bench_*.py`` here has one interface (``bench_all.py`` relies on it):

* ``parser()``: its command line; ``main(argv=None)`` parses it, calls ``run`` and writes
  ``--json``;
* ``run(args) -> dict``: the measurement (it prints its tables as it goes); the dict is
  what ``--json`` writes;
* ``GOALS``: a list of :class:`Goal`, the figures of that dict it checks (and a few it only
  reports, ``target=None``);
* ``plot(results, path) -> bool``: a PNG of its main figure (False when matplotlib, the
  ``[bench]`` extra, is missing);
* ``ARGS_QUICK`` / ``ARGS_FULL`` / ``ARGS_SMOKE``: the arguments ``bench_all.py`` runs it
  with by default, with ``--full`` and with ``--smoke`` (seconds; the figures meaningless).
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def machine_info() -> dict:
    """CPU model, cores, load and library versions (recorded beside every figure)."""
    import numpy as np
    import zmq

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = None
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_GiB": round(mem_gib, 1) if mem_gib else None,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "platform": platform.platform(),
        "loadavg_1m_at_start": load,
    }
    for mod in ("torch", "numba", "xxhash"):
        try:
            info[mod] = __import__(mod).__version__ if mod != "xxhash" else __import__(mod).VERSION
        except ImportError:
            pass
    try:  # the ISA torch's CPU kernels were picked for, and the CPU numba compiles for
        import torch

        info["torch_isa"] = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        pass
    try:
        import llvmlite.binding as ll

        info["numba_target"] = os.environ.get("NUMBA_CPU_NAME") or ll.get_host_cpu_name()
    except ImportError:
        pass
    return info


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as the module ``name`` (``example("gpt").GPT``): the benchmarks
    train the example GPT, which lives beside the example trainer, not in this folder."""
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
        if spec is None or spec.loader is None:
            raise ImportError(f"no examples/{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


# -- goals ---------------------------------------------------------------------------------
OPS = {"<=": lambda v, t: v <= t, ">=": lambda v, t: v >= t, "==": lambda v, t: v == t}


@dataclass(frozen=True)
class Goal:
    """One figure a benchmark checks against its goal.

    ``key`` is the dotted path of the figure in ``run()``'s results; a ``*`` step takes every
    item of a list or dict there (``"rows.*.zc_vs_bare"``), and ``name`` may then use the
    item's fields and its ``{key}`` (``"{transport} {shape}: ..."``). ``where`` keeps the
    items whose fields match fnmatch patterns (``{"path": "shadow local*"}``; ``!`` in front
    negates). ``target`` None: a figure reported beside the goals, checked against nothing."""

    name: str
    key: str
    target: float | bool | None
    op: str = ">="
    unit: str = ""
    where: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"goal {self.name!r}: op {self.op!r} is not one of {sorted(OPS)}")

    @property
    def goal(self) -> str:
        """The goal as text (``<= 1.05x``), "" for a figure with no target."""
        if self.target is None:
            return ""
        target = self.target if isinstance(self.target, bool) else f"{self.target:g}"
        return f"{self.op} {target}{self.unit}" if self.unit in ("x", "") else f"{self.op} {target} {self.unit}"


@dataclass(frozen=True)
class Verdict:
    name: str  #: the goal's name, with the item's fields filled in
    value: object  #: the measured figure (None: not measured in this run)
    goal: Goal

    @property
    def met(self) -> bool | None:
        """True / False against the target; None when there is none or nothing was measured."""
        if self.goal.target is None or self.value is None:
            return None
        return bool(OPS[self.goal.op](self.value, self.goal.target))

    @property
    def status(self) -> str:
        """PASS, MISS, "" (a figure without a goal) or "n/a" (not measured)."""
        if self.goal.target is None:
            return ""
        if self.value is None:
            return "n/a"
        return "PASS" if self.met else "MISS"


def fmt(value, unit: str = "") -> str:
    """A figure for a table: 2 decimals (3 under 0.1), the unit after it."""
    if value is None:
        return "not measured"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value}{unit}"
    if isinstance(value, int):
        text = str(value)
    else:
        text = f"{value:.3f}" if abs(value) < 0.1 else f"{value:.2f}"
    return f"{text}{unit}" if unit in ("x", "") else f"{text} {unit}"


def _matches(fields: dict, where: dict) -> bool:
    for k, pattern in where.items():
        neg = pattern.startswith("!")
        hit = fnmatch.fnmatchcase(str(fields.get(k)), pattern[1:] if neg else pattern)
        if hit == neg:
            return False
    return True


def lookup(results, key: str) -> list[tuple[dict, object]]:
    """``(fields, value)`` of every figure at ``key`` (see :class:`Goal`); ``fields`` holds
    the dict items a ``*`` went through (their scalar fields, and ``key``)."""
    found: list[tuple[dict, object]] = [({}, results)]
    for step in key.split("."):
        nxt = []
        for fields, node in found:
            if step == "*":
                items = node.items() if isinstance(node, dict) else enumerate(node or [])
                for k, item in items:
                    f = dict(fields, key=k)
                    if isinstance(item, dict):
                        f.update({n: v for n, v in item.items() if isinstance(v, (str, int, float, bool))})
                    nxt.append((f, item))
            elif isinstance(node, dict) and step in node:
                nxt.append((fields, node[step]))
            elif isinstance(node, dict) and step.isdigit() and int(step) in node:
                nxt.append((fields, node[int(step)]))  # int keys before a JSON round trip
        found = nxt
    return found


def check(goals: list[Goal], results: dict) -> list[Verdict]:
    """Every goal against ``results``: one verdict per figure found (a goal whose key is
    missing gives one "not measured" verdict, unless it fans out with ``*``)."""
    out = []
    for g in goals:
        hits = [(f, v) for f, v in lookup(results, g.key) if _matches(f, g.where)]
        if not hits and "*" not in g.key:
            hits = [({}, None)]
        for fields, value in hits:
            try:
                name = g.name.format(**fields)
            except (KeyError, IndexError):
                name = g.name
            out.append(Verdict(name, value, g))
    return out


def print_verdicts(verdicts: list[Verdict], title: str = "") -> None:
    """The verdicts as a table: figure, value, goal, PASS / MISS."""
    if title:
        print(title)
    width = max([len(v.name) for v in verdicts] + [6])
    for v in verdicts:
        print(f"  {v.name:{width}s}  {fmt(v.value, v.goal.unit):>14s}  {v.goal.goal:>10s}  {v.status}")


# -- plots ---------------------------------------------------------------------------------
def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed
    (``pip install -e .[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig, path) -> bool:
    """Write ``fig`` to ``path`` (a PNG) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def bars(path, labels, values, title: str, ylabel: str, goal: float | None = None, horizontal: bool = False) -> bool:
    """A plain bar chart (the plot of a benchmark with no more telling one); False without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels, values = [str(x) for x in labels], [float("nan") if v is None else v for v in values]
    if horizontal:
        ax.barh(labels, values)
        ax.set_xlabel(ylabel)
    else:
        ax.bar(labels, values)
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelsize=8)
    if goal is not None:
        (ax.axvline if horizontal else ax.axhline)(goal, color="red", lw=0.8, ls="--", label=f"goal {goal:g}")
        ax.legend(fontsize=8)
    ax.set_title(title)
    return save(fig, path)


def example_gpt():
    """``GPT, CharData, GPTConfig, corpus`` of ``examples/gpt.py``."""
    m = example("gpt")
    return m.GPT, m.CharData, m.GPTConfig, m.corpus


def destroy_process_group() -> None:
    """``torch.distributed.destroy_process_group()`` for a process that has already dropped
    its DDP modules (``del ddp``, and any trainer_hooks session attached to one).

    A DDP module's C++ ``Reducer`` holds the process group, and its Python wrapper is freed
    with the GIL held. A DDP module that outlives the group's registration (freed when the
    function holding it returns, after this call) is the group's last owner:
    ``ProcessGroupGloo``'s destructor then joins gloo's worker threads with the GIL held,
    while one of them may still be releasing the last collective's work, whose captured
    thread-local state needs the GIL; the process never exits (a rank of bench_overhead hung
    in about 1 run in 10; pytorch/pytorch#56297). Dropped before, the group's last owner is
    its Python handle, whose destructor releases the GIL while it joins."""
    import gc

    import torch.distributed as dist

    gc.collect()  # a DDP module caught in a reference cycle goes now, while the group is registered
    dist.destroy_process_group()
