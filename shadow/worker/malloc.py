"""Received gradient frames on transparent huge pages.

zmq allocates every received frame with ``malloc``; a large one is a fresh ``mmap`` of
4 KiB pages each iteration, and the replay kernel then streams the gradient frames and the
three state arrays (numpy puts those on huge pages) through the TLB at once. glibc's
``glibc.malloc.hugetlb=1`` tunable (glibc 2.35+) makes ``malloc`` advise its mappings for
transparent huge pages, where the kernel allows them (THP ``madvise`` or ``always``).
Measured with ``benchmarks/bench_apply.py --params 50e6`` (AMD EPYC, 2 threads, a noisy
shared VM): the whole worker path over the replay alone was 1.37x, 1.25x and 1.36x in
three runs with it, 1.34x, 1.57x and 1.50x without.

glibc reads its tunables once, at process start, so ``shadow cluster`` starts its workers
with the tunable and ``shadow worker`` started by hand executes itself again with it
(once: the second start finds it set). ``SHADOW_WORKER_HUGEPAGES=0`` turns both off.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

from shadow.config.tuning import Tuning

TUNABLE = "glibc.malloc.hugetlb=1"
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether a worker started with ``env`` should get the tunable: Linux with glibc 2.35+,
    transparent huge pages not ``never``, not already set, not turned off."""
    env = os.environ if env is None else env
    if sys.platform != "linux" or not Tuning.load(env).worker_hugepages:
        return False
    lib, version = platform.libc_ver()
    try:
        if lib != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
            return False
        if "[never]" in _THP.read_text():
            return False
    except (OSError, ValueError):
        return False
    return "glibc.malloc.hugetlb" not in env.get("GLIBC_TUNABLES", "")


def environ(env: dict | None = None) -> dict:
    """``env`` (default: this process's) with the tunable added where :func:`wanted`."""
    env = dict(os.environ if env is None else env)
    if wanted(env):
        env["GLIBC_TUNABLES"] = ":".join(x for x in (env.get("GLIBC_TUNABLES", ""), TUNABLE) if x)
    return env


def reexec() -> None:
    """Execute this process's own command again with the tunable, where :func:`wanted`;
    returns only where it is not (already set, or not available here)."""
    if not wanted():
        return
    argv = list(getattr(sys, "orig_argv", []))
    if not argv:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], environ())
