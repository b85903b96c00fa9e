"""The local file system as a :class:`~shadow.storage.base.Storage`: durable writes
(tmp, fsync, rename, directory fsync), ``O_DIRECT`` shard images, and the same glob and
listing rules as fsspec's local file system. Every file and directory it creates gets the
tier's permissions (:mod:`shadow.storage.modes`: ``0600``/``0700`` unless ``persist.mode``
says otherwise), whatever the umask."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from typing import BinaryIO, cast

import fsspec
from fsspec.implementations.local import LocalFileSystem

from shadow.storage import modes
from shadow.storage.base import Image
from shadow.storage.remote import FsspecStorage


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(
    path: str, file_mode: int = modes.FILE_MODE, dir_mode: int = modes.DIR_MODE, parents: bool = True
) -> Iterator[str]:
    """Write ``path`` durably through ``<path>.<writer>.tmp`` (yielded, already created with
    permissions ``file_mode``: the body opens it again): renamed over ``path`` and its
    directory fsynced once the body returns; removed if it raises (a full disk would
    otherwise keep the partial file's space until retention finds it). ``parents`` creates
    the missing directories above it first, each ``dir_mode``. The temporary name is the
    writer's own (process and thread), so two writers of the same file -- the replicas of
    a shard on one shared disk, whose bytes are equal -- never write into each other's."""
    tmp = f"{path}.{os.getpid()}-{threading.get_ident():x}.tmp"
    d = os.path.dirname(path) or "."
    if parents:
        modes.makedirs(d, dir_mode)
    try:
        modes.create(tmp, file_mode)
        yield tmp
        os.chmod(tmp, file_mode)  # whatever the body did to it
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)
    fsync_dir(d)


def open_under(root: str, names: tuple[str, ...]) -> int:
    """Open ``root/names[0]/.../names[-1]`` for reading (a file descriptor), one component
    at a time, following no link on the way (a linked job or checkpoint directory, or a
    linked file, is ``OSError``): only what lies under ``root`` itself (a worker's files
    socket serves its disk's shard files this way)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        for name in names[:-1]:
            nxt = os.open(name, flags | getattr(os, "O_DIRECTORY", 0), dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(names[-1], flags, dir_fd=fd)
    finally:
        os.close(fd)


class LocalStorage(FsspecStorage):
    """A directory on this host (``url``: a path or a ``file://`` URL). What it creates
    gets permissions ``file_mode`` (files) and ``dir_mode`` (directories), whatever the
    umask (:mod:`shadow.storage.modes`); reading needs neither."""

    local = True

    def __init__(self, url: str, file_mode: int = modes.FILE_MODE, dir_mode: int = modes.DIR_MODE) -> None:
        self.url = url
        self.file_mode, self.dir_mode = file_mode, dir_mode
        fs, self.base = fsspec.core.url_to_fs(url)  # an absolute POSIX path, as fsspec names it
        assert isinstance(fs, LocalFileSystem), url
        self.fs, self.keys_only = fs, False

    def write_atomic(self, path: str, data: bytes, parents: bool = False) -> None:
        # a full disk: no partial file left behind (replacing removes it)
        with replacing(path, self.file_mode, self.dir_mode, parents) as tmp, open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def write_image(self, path: str, image: Image) -> int:
        return image.write(path, file_mode=self.file_mode, dir_mode=self.dir_mode)

    def read_into(self, path: str, out: memoryview, offset: int = 0) -> int:
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            return f.readinto(out) or 0

    def rm(self, path: str, recursive: bool = True) -> None:
        self.fs.rm(path, recursive=recursive)  # the local rm takes paths as they are

    def put_file(self, src: str, path: str) -> None:
        with replacing(path, self.file_mode, self.dir_mode) as tmp, open(src, "rb") as f, open(tmp, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())

    def open(self, path: str, mode: str = "rb") -> BinaryIO:
        if any(c in mode for c in "wax+") and not os.path.exists(path):  # a new file: the tier's permissions
            modes.create(path, self.file_mode, exclusive=True)
        return cast(BinaryIO, open(path, mode))  # noqa: SIM115 -- the caller closes it

    def makedirs(self, path: str) -> None:
        modes.makedirs(path, self.dir_mode)

    def move(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def shard_file(self, directory: str, name: str, size: int) -> str:
        path = os.path.join(directory, name)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            real, home = os.path.realpath(path), os.path.realpath(directory)
            if os.path.dirname(real) != home:
                raise ValueError(f"{path} is a link to {real}, outside the checkpoint directory")
            st = os.stat(real)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_size != size:
            raise ValueError(f"{path} is {st.st_size} bytes, manifest says {size}")
        return path

    def free_space(self, path: str) -> str:
        try:
            d = path
            while d and not os.path.isdir(d):
                d = os.path.dirname(d)
            usage = shutil.disk_usage(d or ".")
        except OSError:
            return ""
        return f" ({usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB)"
