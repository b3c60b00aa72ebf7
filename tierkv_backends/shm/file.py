"""The pool file of the ``shm`` tier as memory: opened (or created, whole, under the file's lock),
checked against the layout it must have, mapped shared by this process, and viewed part by part
(numpy arrays of the header, tables, entries, free extents, processes and holds; a torch tensor of
the data area; plain memoryviews for lookups). Nothing here changes the index after creation:
:mod:`tierkv_backends.shm.index` and :mod:`tierkv_backends.shm.pool` do.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import time

import numpy as np
import torch

from tierkv.chunks.memory import huge_pages
from tierkv.errors import ConfigError
from tierkv_backends.shm.layout import (
    EMPTY,
    ENTRY_FIELDS,
    HEADER_BYTES,
    MAGIC,
    PROCESS_FIELDS,
    VERSION,
    Geometry,
    Layout,
    State,
    Word,
    header_problem,
)

logger = logging.getLogger("tierkv_backends.shm_file")

MEMORY_FILE_SYSTEMS = ("tmpfs", "hugetlbfs", "ramfs")


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: one clock for every process on the node (last use, heartbeats)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def file_system_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (from /proc/self/mountinfo; "" if unknown)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                left, _, right = line.partition(" - ")
                mount_point = left.split()[4].replace("\\040", " ")
                if (real == mount_point or real.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) > len(best):
                    best, kind = mount_point, right.split()[0]
    except OSError:
        return ""
    return kind


class PoolFile:
    """One process's mapping of a pool file (see the module docstring)."""

    def __init__(self, path: str, geometry: Geometry, mode: int, where: str) -> None:
        self.path = path
        self.geometry = geometry
        self.layout = Layout.of(geometry)
        self.where = where
        self.mode = mode
        self._fd = self._open(mode)
        self._map: mmap.mmap | None = None
        try:
            self._create_or_check()
            self._map = mmap.mmap(self._fd, self.layout.file_bytes, flags=mmap.MAP_SHARED | _populate(),
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._views()
        except BaseException:
            self._close_files()
            raise

    def _open(self, mode: int) -> int:
        directory = os.path.dirname(os.path.abspath(self.path)) or "."
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
        except PermissionError as exc:
            raise ConfigError(f"{self.where}: no permission to open the pool at {self.path!r} ({exc.strerror}): it "
                              "belongs to another user, or its mode keeps this one out; run as its owner, or give "
                              "this process a path of its own") from exc
        except OSError as exc:
            raise ConfigError(f"{self.where}: cannot open the pool at {self.path!r}: {exc.strerror}") from exc
        return fd

    def _create_or_check(self) -> None:
        """Under the lock: create the pool if the file is new (or a creator died before it was
        whole), else check that it is a pool of this layout and geometry."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(self._fd).st_size
            words = np.frombuffer(os.pread(self._fd, HEADER_BYTES, 0).ljust(HEADER_BYTES, b"\0"), dtype=np.int64)
            if size == 0 or not words.any():  # new, or its creator died before writing the magic word
                self._create()
                return
            problem = header_problem(words, self.geometry)
            if problem is not None:
                raise ConfigError(f"{self.where}: the file at {self.path!r} is not a pool this process can use: "
                                  f"{problem}. Remove it (once no process uses it) to create a new pool, or name "
                                  "another path")
            if size < self.layout.file_bytes:
                raise ConfigError(f"{self.where}: the pool at {self.path!r} is {size} bytes, shorter than its "
                                  f"geometry needs ({self.layout.file_bytes}): a damaged file; remove it")
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _create(self) -> None:
        need = self.layout.file_bytes
        directory = os.path.dirname(os.path.abspath(self.path)) or "."
        stats = os.statvfs(directory)
        if stats.f_bavail * stats.f_frsize < need:
            raise ConfigError(f"{self.where}: the pool needs {need} bytes at {self.path!r}, and its file system has "
                              f"{stats.f_bavail * stats.f_frsize} free: give a smaller capacity, or grow it (e.g. "
                              "mount -o remount,size=... /dev/shm)")
        os.ftruncate(self._fd, 0)
        os.fchmod(self._fd, self.mode)  # exactly the mode asked for, whatever the umask
        try:
            os.posix_fallocate(self._fd, 0, need)  # every page now, not a SIGBUS on a full tmpfs later
        except OSError as exc:
            os.ftruncate(self._fd, 0)
            raise ConfigError(f"{self.where}: cannot allocate {need} bytes for the pool at {self.path!r}: "
                              f"{exc.strerror}") from exc
        mapping = mmap.mmap(self._fd, self.layout.data, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self._map = mapping
            self._views(data=False)
            self._initialize()
        finally:
            self._drop_views()
            self._map = None
            mapping.close()
        logger.info("%s: created a pool of %d bytes at %s", self.where, self.geometry.capacity, self.path)

    def _initialize(self) -> None:
        """Write an empty index and the header of a new pool; the magic word last."""
        geometry, words = self.geometry, self.words
        self.tables[0][:] = EMPTY
        self.tables[1][:] = EMPTY
        self.entries["state"][:] = State.FREE
        self.holds[:] = -1
        self.procs["pid"][:] = 0
        self.free[0] = (0, geometry.capacity)
        words[Word.FREE_COUNT] = 1
        words[Word.VERSION] = VERSION
        words[Word.CAPACITY] = geometry.capacity
        words[Word.TABLE_SIZE] = geometry.table_size
        words[Word.MAX_CHUNKS] = geometry.max_chunks
        words[Word.MAX_PROCESSES] = geometry.max_processes
        words[Word.HOLDS_PER_PROCESS] = geometry.holds_per_process
        words[Word.DATA_OFFSET] = self.layout.data
        words[Word.GEOMETRY_DIGEST] = geometry.digest()
        words[Word.CREATED_NS] = time.time_ns()
        words[Word.MAGIC] = MAGIC  # last: the pool exists once this word does

    def _views(self, data: bool = True) -> None:
        """numpy views of every part of the mapping (and a torch view of the data area)."""
        assert self._map is not None
        layout, geometry, buffer = self.layout, self.geometry, self._map
        self.words = np.frombuffer(buffer, dtype=np.int64, count=HEADER_BYTES // 8, offset=0)
        self.tables = [np.frombuffer(buffer, dtype=np.int32, count=geometry.table_size, offset=offset)
                       for offset in layout.tables]
        self.entries: dict[str, np.ndarray] = {}
        for name, kind, shape in ENTRY_FIELDS:
            count = geometry.max_chunks * int(np.prod(shape, dtype=np.int64))
            array = np.frombuffer(buffer, dtype=kind, count=count, offset=layout.entries[name])
            self.entries[name] = array.reshape((geometry.max_chunks, *shape)) if shape else array
        self.free = np.frombuffer(buffer, dtype=np.int64, count=2 * (geometry.max_chunks + 1),
                                  offset=layout.free).reshape(-1, 2)
        self.procs = {name: np.frombuffer(buffer, dtype=kind, count=geometry.max_processes, offset=layout.processes[name])
                      for name, kind, _ in PROCESS_FIELDS}
        self.holds = np.frombuffer(buffer, dtype=np.int32, count=geometry.max_processes * geometry.holds_per_process,
                                   offset=layout.holds).reshape(geometry.max_processes, geometry.holds_per_process)
        if data:
            self.data = torch.frombuffer(buffer, dtype=torch.uint8, count=geometry.capacity, offset=layout.data)
            # plain memoryviews for the lookup path: indexing one gives a Python int in tens of ns,
            # where a numpy element or a small vectorised probe costs microseconds
            whole = memoryview(buffer)
            words_view = whole[: 8 * len(Word)].cast("q")
            table_views = [whole[offset : offset + 4 * geometry.table_size].cast("i") for offset in layout.tables]
            digest_view = whole[layout.entries["digest"] : layout.entries["digest"] + 16 * geometry.max_chunks].cast("Q")
            state_view = whole[layout.entries["state"] : layout.entries["state"] + 4 * geometry.max_chunks].cast("i")
            self._lookup_views = (whole, words_view, table_views, digest_view, state_view)
            huge_pages(self.data)  # 2 MiB pages where the mount allows them (tmpfs huge=advise / within_size)

    def _drop_views(self) -> None:
        for view in self.__dict__.pop("_lookup_views", ())[::-1]:
            if isinstance(view, list):
                for part in view:
                    part.release()
            else:
                view.release()
        for name in ("words", "tables", "entries", "free", "procs", "holds", "data"):
            self.__dict__.pop(name, None)

    def _close_files(self) -> None:
        self._drop_views()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still lent out: the mapping goes with it
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1



def _populate() -> int:
    """MAP_POPULATE where Linux has it: the mapping's page tables are filled at attach, not by
    faults on the first copies."""
    return getattr(mmap, "MAP_POPULATE", 0)
