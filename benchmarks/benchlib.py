"""Shared bits of the benchmark scripts: the machine a figure was measured on."""

from __future__ import annotations

import os
import platform
from pathlib import Path


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
