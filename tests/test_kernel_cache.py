"""The multi-threaded and single-threaded replay kernels never share a numba cache entry.

numba keys its cache by the Python function, not by the compile flags; a parallel and a
serial dispatcher of one function used to share an entry, so a worker loaded the
single-threaded kernel after a trainer on its host had compiled that one first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from shadow.kernels import _cache

ROOT = Path(__file__).resolve().parents[1]

MODULE = textwrap.dedent("""
    import numba
    import numpy as np
    from numba import prange

    from shadow.kernels import _cache


    def thread_ids(out):
        for i in prange(out.shape[0]):
            out[i] = numba.get_thread_id()


    parallel, serial = _cache.kernel(thread_ids, True), _cache.kernel(thread_ids, False)
""")

RUN = textwrap.dedent("""
    import json, sys
    import numpy as np
    import probe_kernels as m
    fn = m.parallel if sys.argv[1] == "parallel" else m.serial
    out = np.full(64, -1, dtype=np.int64)
    fn(out)
    print(json.dumps({"threads": sorted(set(out.tolist())), "compiled": len(fn.stats.cache_misses)}))
""")


def _run(tmp_path: Path, which: str) -> dict:
    env = dict(
        os.environ,
        NUMBA_CACHE_DIR=str(tmp_path / "cache"),
        NUMBA_NUM_THREADS="2",
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    res = subprocess.run(
        [sys.executable, "-c", RUN, which], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_serial_kernel_is_a_distinct_function():
    def f(x):
        return x

    par, ser = _cache.kernel(f, True), _cache.kernel(f, False)
    assert par.py_func.__qualname__ != ser.py_func.__qualname__
    assert ser.py_func.__qualname__.endswith("_serial") and ser.py_func.__code__ is f.__code__


def test_parallel_kernel_is_not_loaded_from_the_serial_ones_cache(tmp_path):
    (tmp_path / "probe_kernels.py").write_text(MODULE)
    first = _run(tmp_path, "serial")  # compiles and caches the single-threaded kernel
    assert first == {"threads": [0], "compiled": 1}
    second = _run(tmp_path, "parallel")  # a later process on the same host (same cache)
    assert second["compiled"] == 1, "the parallel kernel came from the serial kernel's cache entry"
    assert second["threads"] == [0, 1], f"the parallel kernel ran on threads {second['threads']}"
    again = _run(tmp_path, "parallel")  # and it is cached under its own entry
    assert again == {"threads": [0, 1], "compiled": 0}
