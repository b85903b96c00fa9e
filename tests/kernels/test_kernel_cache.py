"""The multi-threaded and single-threaded replay kernels never share a numba cache entry, and
a kernel cached before a change to a module of its package is not loaded after it.

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

ROOT = Path(__file__).resolve().parents[2]

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


HELPER = textwrap.dedent("""
    from numba import njit


    @njit
    def value():
        return {value}
""")

USES_HELPER = textwrap.dedent("""
    from numba import prange

    from shadow.kernels import _cache
    from probe_helper import value


    def fill(out):
        for i in prange(out.shape[0]):
            out[i] = value()


    parallel, serial = _cache.kernel(fill, True), _cache.kernel(fill, False)
""")

RUN_FILL = textwrap.dedent("""
    import json
    import numpy as np
    import probe_uses as m
    out = np.zeros(4, dtype=np.int64)
    m.serial(out)
    print(json.dumps({"values": sorted(set(out.tolist())), "compiled": len(m.serial.stats.cache_misses)}))
""")


def test_a_change_to_a_module_a_kernel_compiles_in_is_not_served_from_the_cache(tmp_path):
    """numba checks a cache entry against the kernel's own file only: the Adam kernels'
    element rules and loops live in modules of their own, whose changes must reach them."""
    (tmp_path / "probe_uses.py").write_text(USES_HELPER)
    env = dict(
        os.environ,
        NUMBA_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        PYTHONDONTWRITEBYTECODE="1",
    )

    def run() -> dict:
        res = subprocess.run(
            [sys.executable, "-c", RUN_FILL], env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    (tmp_path / "probe_helper.py").write_text(HELPER.format(value=1))
    assert run() == {"values": [1], "compiled": 1}
    assert run() == {"values": [1], "compiled": 0}  # cached
    (tmp_path / "probe_helper.py").write_text(HELPER.format(value=2))
    assert run() == {"values": [2], "compiled": 1}, "the kernel came from a cache entry older than its helper"
    assert run() == {"values": [2], "compiled": 0}


def _configure_in(tmp_path: Path, plant) -> tuple[str, str]:
    """The kernel cache directory a fresh process picks when its cache home cannot be
    created (``XDG_CACHE_HOME`` is a file) and its temporary directory holds what ``plant``
    put at the per-user fallback's path; and what it logged."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(parents=True)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    fallback = tmp / f"shadow-numba-{os.getuid()}"
    plant(fallback)
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "SHADOW_CACHE_DIR")}
    env.update(XDG_CACHE_HOME=str(blocker), TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    code = "import logging; logging.basicConfig(); from shadow.kernels import _cache; print(_cache.configure())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), out.stderr


def _is_private(path: str) -> bool:
    info = os.lstat(path)
    return os.path.isdir(path) and not os.path.islink(path) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def test_the_fallback_cache_is_created_private(tmp_path):
    got, _ = _configure_in(tmp_path, lambda p: None)
    assert got == str(tmp_path / "tmp" / f"shadow-numba-{os.getuid()}") and _is_private(got)


def test_a_fallback_cache_another_account_planted_is_not_used(tmp_path):
    """numba loads the index files it finds in its cache directory (pickles): a directory
    another account made, or may write to, or a link to one, is never the cache."""

    def theirs(p: Path) -> None:
        p.mkdir(mode=0o755)
        (p / "planted.nbi").write_bytes(b"not from this user")
        if os.getuid() == 0:
            os.chown(p, 65534, 65534)
        else:  # not root: a directory of ours that others may write to stands for it
            p.chmod(0o777)

    def open_to_all(p: Path) -> None:
        p.mkdir()
        p.chmod(0o777)

    def link(p: Path) -> None:
        (p.parent / "elsewhere").mkdir(mode=0o700)
        p.symlink_to(p.parent / "elsewhere")

    for i, plant in enumerate((theirs, open_to_all, link)):
        got, log = _configure_in(tmp_path / str(i), plant)
        planted = tmp_path / str(i) / "tmp" / f"shadow-numba-{os.getuid()}"
        assert got != str(planted) and not got.startswith(str(planted) + "/"), plant.__name__
        assert _is_private(got) and "cannot be used either" in log, (plant.__name__, log)
