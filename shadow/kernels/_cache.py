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

numba checks a cached kernel against its own source file only, not against the modules of
the functions it compiles in (the Adam kernels' element rules and loops are modules of their
own): :func:`kernel` keys each kernel's cache entry by every source of its package too
(:func:`sources_digest`), so a kernel compiled before a change to any of them is not loaded
after it.

The directory is chosen when the kernel modules are first imported (numba binds a
kernel's cache when it is decorated), so :func:`configure` runs at that import.
:func:`compile_lock` serialises the first compilation between the processes of one host
(workers, trainer ranks calibrating at attach): one compiles, the others then load its result
from the cache. The wait for it is bounded (:data:`COMPILE_LOCK_WAIT_S`): a process that
holds it longer (hung, stopped, or a forked child that inherited it) delays the others by
that much, never without end; they then go on without it, loading what the cache holds and
writing nothing to it (see :func:`compile_lock`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator

from shadow.security.private import private_problem

logger = logging.getLogger(__name__)

_chosen: str | None = None

#: the longest a process waits for another one's :func:`compile_lock` (seconds) before it
#: goes on without it. Well under ``Tuning.connect_timeout_s`` (60 s): the other ranks of a
#: job wait that long at the coordinator for a rank still calibrating at attach, and this
#: wait plus the compilation that follows it must fit in it. A module constant, not a
#: Tuning knob: the lock is taken below ``trainer_hooks.attach``'s options (in the
#: optimizer's description) and at a worker's start alike.
COMPILE_LOCK_WAIT_S = 20.0
#: a worker's wait (:mod:`shadow.worker.startup`): longer, as a cold compilation of every
#: replay kernel takes ~20 s on an idle machine and more on a loaded one, and a starting
#: worker keeps the coordinator told meanwhile; bounded all the same
WORKER_COMPILE_LOCK_WAIT_S = 120.0

_POLL_S = (0.01, 0.25)  # the non-blocking tries' first and longest pause
_stuck: set[str] = set()  # lock files this process gave up waiting for: tried once from then on
_unlocked = 0  # blocks of this process running without the lock (cache writes are off meanwhile)
_unlocked_guard = threading.Lock()
_saved_save: Callable | None = None


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
    compiled from a copy of ``fn`` named ``<name>_serial``: a cache entry of its own.

    numba also checks a cache entry against ``fn``'s own source file only; the entry's key
    here holds :func:`sources_digest` of ``fn``'s package as well (see the module docstring)."""
    from numba import njit

    if not parallel:
        fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
        fn.__qualname__ = fn.__name__
    dispatcher = njit(parallel=parallel, cache=True, nogil=True, error_model="numpy")(fn)
    dispatcher._cache = _sources_cache_class()(dispatcher.py_func)  # type: ignore[attr-defined]  # what enable_caching sets
    return dispatcher


@functools.cache
def sources_digest(directory: str) -> str:
    """A digest of the Python sources in ``directory`` (names and contents): what the kernels
    compiled from that package depend on. Read once per process."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".py"):
            continue
        try:
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read()
        except OSError as exc:  # unreadable: named as such (numba reads the kernel's own file)
            data = f"unreadable: {exc.strerror}".encode()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


@functools.cache
def _sources_cache_class() -> type:
    """numba's function cache, its index key extended by :func:`sources_digest` of the
    function's package (built on first use: numba is imported then)."""
    from numba.core.caching import FunctionCache

    class SourcesCache(FunctionCache):
        def _index_key(self, sig, codegen):
            key = super()._index_key(sig, codegen)
            return (*key, sources_digest(os.path.dirname(os.path.abspath(self._py_func.__code__.co_filename))))

    return SourcesCache


def cache_dir() -> str:
    """The directory numba caches the replay kernels in."""
    return configure()


@contextlib.contextmanager
def compile_lock(wait_s: float | None = None) -> Iterator[None]:
    """Hold the host-wide lock on the kernel cache while compiling (or loading) the kernels:
    the first process compiles and fills the cache, the next ones load from it.

    The lock is polled (non-blocking ``flock``) for at most ``wait_s`` seconds (default
    :data:`COMPILE_LOCK_WAIT_S`, a trainer rank's), logging who waits, for whom and how long. Past that, and
    when the lock file cannot be opened, the block runs without the lock, with numba's
    cache writes off in this process (:func:`_cache_read_only`): numba writes each cache
    file atomically, but a kernel's index and data files are two files it rewrites
    read-modify-write, so two processes compiling one kernel for different signatures at
    once can leave an index naming the other's data. Loading stays safe (the one writer
    left is the lock's holder); the kernels this process compiles are kept in memory only.
    A process that gave up on a lock tries it once, without waiting, from then on."""
    path = os.path.join(cache_dir(), ".compile.lock")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as exc:  # no lock then: each process compiles on its own, writing no cache
        logger.warning("cannot open the kernel cache lock %s (%s); compiling without it", path, exc)
        with _cache_read_only():
            yield
        return
    try:
        if _acquire(fd, path, COMPILE_LOCK_WAIT_S if wait_s is None else wait_s):
            _stuck.discard(path)
            _mark_holder(fd)
            yield
            return
        with _cache_read_only():
            yield
    finally:
        os.close(fd)  # closing releases the lock


def _acquire(fd: int, path: str, wait_s: float) -> bool:
    """Whether ``fd`` got the lock on ``path`` within ``wait_s`` seconds (one try only when
    this process gave up on it before)."""
    import fcntl

    t0 = time.monotonic()
    pause = _POLL_S[0]
    logged = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        except OSError as exc:  # a file system without flock: as if the lock file could not be opened
            logger.warning("cannot lock the kernel cache lock %s (%s); compiling without it", path, exc)
            return False
        else:
            if logged:
                logger.info(
                    "pid %d got the kernel cache lock %s after %.1f s", os.getpid(), path, time.monotonic() - t0
                )
            return True
        waited = time.monotonic() - t0
        if path in _stuck or waited >= wait_s:
            logger.warning(
                "pid %d %s the kernel cache lock %s, held by %s; going on without it: the kernels are "
                "loaded from the cache or compiled here, and nothing is written to the cache",
                os.getpid(),
                "still cannot take" if path in _stuck else f"waited {waited:.1f} s for",
                path,
                _holder(fd),
            )
            _stuck.add(path)
            return False
        if not logged:
            logger.info(
                "pid %d waits for the kernel cache lock %s, held by %s (compiling the kernels), for %.0f s at most",
                os.getpid(),
                path,
                _holder(fd),
                wait_s,
            )
            logged = True
        time.sleep(min(pause, max(wait_s - waited, 0.0)))
        pause = min(pause * 2, _POLL_S[1])


def _mark_holder(fd: int) -> None:
    """Write who holds the lock into its file, for the processes waiting for it to name."""
    me = f"pid {os.getpid()} ({' '.join(sys.argv)[:200] or sys.executable})"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode("utf-8", "replace"), 0)
    except OSError:
        pass


def _holder(fd: int) -> str:
    """Who the lock file says holds it (best effort)."""
    try:
        said = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        said = ""
    return said.splitlines()[0][:300] if said else "another process"


@contextlib.contextmanager
def _cache_read_only() -> Iterator[None]:
    """numba writes no kernel to its cache in this process meanwhile (it still loads): see
    :func:`compile_lock`. Nested and concurrent blocks count; the last one out restores it."""
    global _unlocked, _saved_save
    from numba.core import caching

    cls = getattr(caching, "IndexDataCacheFile", None)
    with _unlocked_guard:
        if _unlocked == 0 and cls is not None and hasattr(cls, "save"):
            _saved_save = cls.save
            cls.save = _skip_save
        _unlocked += 1
    try:
        yield
    finally:
        with _unlocked_guard:
            _unlocked -= 1
            if _unlocked == 0 and _saved_save is not None and cls is not None:
                cls.save = _saved_save
                _saved_save = None


def _skip_save(self: object, key: object, data: object) -> None:
    """numba's cache-file save while this process runs without the compile lock: nothing."""
    logger.debug("kernel not written to the cache (compiled without the compile lock)")


configure()
