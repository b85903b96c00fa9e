"""Where the compiled replay kernels are cached, and compiling them once per host.

numba caches compiled kernels next to their source by default, which a read-only
install (site-packages owned by root, a container image) cannot write: every worker
would then compile for ~15 s at every start. The kernels are cached in a user cache
directory instead:

* ``NUMBA_CACHE_DIR``, when set, wins (numba's own setting);
* else ``SHADOW_CACHE_DIR``/numba;
* else ``$XDG_CACHE_HOME/shadow/numba`` (``~/.cache/shadow/numba``);
* a directory that cannot be written, or is not private to this user (another account owns
  it or may write to it: numba loads what it finds there, and its index files are pickles),
  falls back to a per-user temporary directory, created 0700 and checked the same way;
  when even that one is not private (another account made it first), to a fresh private
  directory of this process's own (the kernels then compile again in every process).

The directory is chosen when the kernel modules are first imported (numba binds a
kernel's cache when it is decorated), so :func:`configure` runs at that import.
:func:`compile_lock` serialises the first compilation between the worker processes of
one host: one compiles, the others then load its result from the cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import types
from collections.abc import Callable, Iterator

from shadow.private import private_problem

logger = logging.getLogger(__name__)

_chosen: str | None = None


def _writable(path: str) -> str:
    """Why ``path`` cannot hold this user's kernel cache ("" if it can)."""
    problem = private_problem(path)
    if problem:
        return problem
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        return f"cannot write to it ({exc})"
    return ""


def default_dir() -> str:
    """The cache directory shadow asks for when ``NUMBA_CACHE_DIR`` is not set."""
    explicit = os.environ.get("SHADOW_CACHE_DIR")
    if explicit:
        return os.path.join(os.path.expanduser(explicit), "numba")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shadow", "numba")


def configure() -> str:
    """Point numba's kernel cache at the user cache directory (see the module docstring);
    returns the directory in use. Idempotent."""
    global _chosen
    from numba.core import config

    numba_dir = os.environ.get("NUMBA_CACHE_DIR")
    if numba_dir:
        _chosen = numba_dir
        return _chosen
    if _chosen is not None:
        return _chosen
    path = default_dir()
    problem = _writable(path)
    if problem:
        fallback = os.path.join(tempfile.gettempdir(), f"shadow-numba-{os.getuid()}")
        logger.warning(
            "kernel cache directory %s cannot be used: %s; using %s (set SHADOW_CACHE_DIR to choose another)",
            path,
            problem,
            fallback,
        )
        path = fallback
        problem = _writable(path)
        if problem:
            path = tempfile.mkdtemp(prefix=f"shadow-numba-{os.getuid()}-")
            logger.warning(
                "the fallback kernel cache directory %s cannot be used either: %s; using %s, this "
                "process's own (the kernels compile again in every process until SHADOW_CACHE_DIR "
                "names a private directory)",
                fallback,
                problem,
                path,
            )
    config.CACHE_DIR = path  # type: ignore[attr-defined]  # numba sets its config attributes at run time
    _chosen = path
    return path


def kernel(fn: Callable, parallel: bool) -> Callable:
    """``fn`` compiled by numba (cached, no GIL, numpy's error model), multi-threaded over
    its ``prange`` loops or not.

    numba keys its cache by the Python function (module, qualified name, line) and the
    signature, not by the compile flags: two dispatchers of one function, one parallel
    and one not, share one cache entry, and whichever compiled first is what the other
    loads from then on (a worker ran the single-threaded replay, 30-50% slower, after a
    trainer on its host had compiled that first). So the single-threaded kernel is
    compiled from a copy of ``fn`` named ``<name>_serial``: a cache entry of its own."""
    from numba import njit

    if not parallel:
        fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
        fn.__qualname__ = fn.__name__
    return njit(parallel=parallel, cache=True, nogil=True, error_model="numpy")(fn)


def cache_dir() -> str:
    """The directory numba caches the replay kernels in."""
    return configure()


@contextlib.contextmanager
def compile_lock() -> Iterator[None]:
    """Hold the host-wide lock on the kernel cache while compiling (or loading) the kernels:
    the first process compiles and fills the cache, the next ones load from it."""
    import fcntl

    path = os.path.join(cache_dir(), ".compile.lock")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as exc:  # no lock then: each process compiles on its own, as numba would
        logger.warning("cannot open the kernel cache lock %s (%s); compiling without it", path, exc)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


configure()
