"""The pool file of the ``shm`` tier as memory: opened safely (never through a link, only a
regular file of this process's user whose mode grants no more than the configured one), created
whole under a temporary name and moved into place without replacing anything, checked against
the layout it must have, mapped shared by this process, and viewed part by part (numpy arrays of
the header, tables, entries, free extents, processes and holds; a torch tensor of the data area;
plain memoryviews for lookups). Nothing here changes the index after creation:
``tierkv_backends.shm.index`` and ``tierkv_backends.shm.pool`` do. About 400 lines, by choice:
opening, creating and sweeping a pool file are one safety argument, read together.

Why a pool file is checked this way: it holds every tenant's KV, and its default path under the
world-writable ``/dev/shm`` is predictable. A file another user planted there (a pool of theirs,
a link to one, a file of any kind) is refused with its owner and mode named, never used: a
process that used it would serve that user's bytes as hits and hand it its own prompts. Nothing
that exists at the path is ever reformatted: only a file this process created under a name of
its own becomes a pool, and it appears at the path whole (``renameat2(RENAME_NOREPLACE)``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import pwd
import secrets
import stat
import time

import numpy as np
import torch

from tierkv.chunks.memory import huge_pages
from tierkv.errors import ConfigError
from tierkv_backends.shm.journal import Journal
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
_OPEN_ATTEMPTS = 50
_CREATING = ".creating"
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


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
        self._fd = -1
        self._map: mmap.mmap | None = None
        try:
            self._fd = self._open()
            self._check_header()
            self._map = mmap.mmap(self._fd, self.layout.file_bytes, flags=mmap.MAP_SHARED | _populate(),
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._views()
        except BaseException:
            self._close_files()
            raise

    # -- opening -------------------------------------------------------------------------------
    def _open(self) -> int:
        """The pool file's descriptor, created first when there is none; refused when it is not
        this user's pool file (see ``_check_owner``)."""
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                self._create()
                continue
            except PermissionError as exc:
                raise ConfigError(f"{self.where}: no permission to open the pool at {self.path!r} ({exc.strerror}): "
                                  "it belongs to another user, or its mode keeps this one out; run as its owner, or "
                                  "give this process a path of its own") from exc
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise ConfigError(f"{self.where}: {self.path!r} is a symbolic link; a pool is never opened "
                                      "through a link (another user may have planted it). Remove it, or name the "
                                      "pool's real path") from exc
                raise ConfigError(f"{self.where}: cannot open the pool at {self.path!r}: {exc.strerror}") from exc
            try:
                if self._check_owner(fd, last=attempt == _OPEN_ATTEMPTS - 1):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            time.sleep(0.01)  # a creator without renameat2 is between its link and its unlink
        raise ConfigError(f"{self.where}: could not open or create the pool at {self.path!r} (it kept appearing "
                          "and disappearing): another process is creating and removing it")

    def _check_owner(self, fd: int, last: bool) -> bool:
        """Refuse a file that is not a regular file of this process's effective user (or, where
        ``mode`` shares the pool with a group, of a user of that group) with one name, and a mode
        that grants more than ``mode``; False: look again (a second name that may be a
        creator's)."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{self.where}: {self.path!r} is not a regular file ({_kind(info.st_mode)}), so not a "
                              "pool: remove it, or name another path")
        me = os.geteuid()
        shared_with_group = self.mode & 0o060 == 0o060
        in_group = info.st_gid == os.getegid() or info.st_gid in os.getgroups()
        if info.st_uid != me and not (shared_with_group and in_group):
            raise ConfigError(f"{self.where}: the pool file {self.path!r} belongs to {_user(info.st_uid)}, not to this "
                              f"process's user {_user(me)} (mode {stat.S_IMODE(info.st_mode):04o}): a pool another "
                              "user made is never used (it would read this process's prompts and serve its own "
                              "bytes as hits). Remove it, or give this process a path of its own")
        extra = stat.S_IMODE(info.st_mode) & ~self.mode
        if extra:
            raise ConfigError(f"{self.where}: the pool file {self.path!r} (owner {_user(info.st_uid)}) has mode "
                              f"{stat.S_IMODE(info.st_mode):04o}, which grants more than this config's mode "
                              f"{self.mode:04o}: every process sharing a pool gives it the same mode. Remove it, "
                              "or set mode to match")
        if info.st_nlink != 1:
            if not last:
                return False
            raise ConfigError(f"{self.where}: the pool file {self.path!r} has {info.st_nlink} names (hard links); a "
                              "pool file has one. Remove it, or name another path")
        return True

    def _check_header(self) -> None:
        """Refuse a file that is not a whole pool of this layout and geometry (never rewritten)."""
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, HEADER_BYTES, 0)
        problem: str | None
        if len(head) < HEADER_BYTES:
            problem = f"it is {size} bytes, shorter than a pool's header: not a tierkv pool"
        else:
            problem = header_problem(np.frombuffer(head, dtype=np.int64), self.geometry)
        if problem is None and size < self.layout.file_bytes:
            problem = f"it is {size} bytes, shorter than its geometry needs ({self.layout.file_bytes}): truncated"
        if problem is not None:
            raise ConfigError(f"{self.where}: the file at {self.path!r} is not a pool this process can use: "
                              f"{problem}. Remove it (once no process uses it) to create a new pool, or name "
                              "another path")

    # -- creating ------------------------------------------------------------------------------
    def _create(self) -> None:
        """Make a whole pool under a name of this process's, then move it to the path unless a
        pool is there by then (another process won the race: that one is used). A failure
        leaves no file."""
        directory = os.path.dirname(os.path.abspath(self.path)) or "."
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{self.where}: cannot make the directory of the pool {self.path!r}: "
                              f"{exc.strerror}") from exc
        _remove_stale_creations(self.path)
        need = self.layout.file_bytes
        stats = os.statvfs(directory)
        if stats.f_bavail * stats.f_frsize < need:
            raise ConfigError(f"{self.where}: a pool of capacity {self.geometry.capacity} bytes is a file of {need} "
                              f"bytes ({describe_size(self.layout)}), and {directory} has "
                              f"{stats.f_bavail * stats.f_frsize} free: give a smaller capacity, or grow it (e.g. "
                              "mount -o remount,size=... /dev/shm; a container: --shm-size). `tierkv pool-size` "
                              "says what a capacity costs")
        unique = f"{self.path}.{os.getpid()}-{secrets.token_hex(4)}"
        temporary = unique + _CREATING
        try:
            # made under a name the stale sweep does not match, locked, then renamed to one it
            # does: a sweeper never sees it unlocked while its creator lives (it only takes
            # unlocked files), so a concurrent creator cannot remove it from under us
            fd = os.open(unique, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, self.mode)
        except OSError as exc:
            raise ConfigError(f"{self.where}: cannot create the pool at {self.path!r}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # while held, the temporary file is being made (not stale)
            os.rename(unique, temporary)
            os.fchmod(fd, self.mode)  # exactly the mode asked for, whatever the umask
            try:
                os.posix_fallocate(fd, 0, need)  # every page now, not a SIGBUS on a full tmpfs later
            except OSError as exc:
                raise ConfigError(f"{self.where}: cannot allocate {need} bytes for the pool at {self.path!r}: "
                                  f"{exc.strerror}") from exc
            self._initialize_file(fd)
            if rename_noreplace(temporary, self.path):
                logger.info("%s: created a pool of %d bytes (a file of %d) at %s", self.where,
                            self.geometry.capacity, need, self.path)
        finally:
            for leftover in (unique, temporary):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
            os.close(fd)

    def _initialize_file(self, fd: int) -> None:
        mapping = mmap.mmap(fd, self.layout.data, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self._map = mapping
            self._views(data=False)
            self._initialize()
        finally:
            self._drop_views()
            self._map = None
            mapping.close()

    def shrunk(self) -> int | None:
        """The file's size when it is shorter than this process's mapping (someone truncated it:
        touching a page past its end is a SIGBUS), else None. One ``fstat``: cheap enough for
        every batch."""
        size = os.fstat(self._fd).st_size
        return size if size < self.layout.file_bytes else None

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
        words[Word.JOURNAL_BYTES] = geometry.journal_bytes
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
        self.journal = Journal(self.words, np.frombuffer(buffer, dtype=np.uint8, count=geometry.journal_bytes,
                                                         offset=layout.journal))
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
        for name in ("words", "tables", "entries", "free", "procs", "holds", "journal", "data"):
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


def describe_size(layout: Layout) -> str:
    """Where a pool file's bytes go besides its capacity (for sizing messages)."""
    geometry = layout.geometry
    holds = 4 * geometry.max_processes * geometry.holds_per_process
    index = layout.data - holds - HEADER_BYTES
    return (f"{geometry.capacity} of chunks, an index of {index} bytes for {geometry.max_chunks} chunks, hold rows "
            f"of {holds} bytes for {geometry.max_processes} processes x {geometry.holds_per_process} holds, aligned "
            "to 2 MiB")


def rename_noreplace(source: str, target: str) -> bool:
    """Move ``source`` to ``target`` unless ``target`` exists (False then; ``source`` stays).
    ``renameat2(RENAME_NOREPLACE)`` where the C library has it, else link and unlink (a second
    name for an instant, which openers wait out)."""
    function = getattr(_libc(), "renameat2", None)
    if function is not None:
        if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return True
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            return False
        if code not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code), target)
    try:
        os.link(source, target)
    except FileExistsError:
        return False
    os.unlink(source)
    return True


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _remove_stale_creations(path: str) -> None:
    """Remove temporary files of this user's creators of ``path`` that died before finishing
    (their flock is free): a pool's worth of memory each."""
    directory, name = os.path.split(os.path.abspath(path))
    try:
        names = [n for n in os.listdir(directory) if n.startswith(name + ".") and n.endswith(_CREATING)]
    except OSError:
        return
    for leftover in names:
        full = os.path.join(directory, leftover)
        try:
            fd = os.open(full, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its creator is still at work
            with contextlib.suppress(FileNotFoundError):
                os.unlink(full)
                logger.info("removed %s, left by a process that died while creating the pool", full)
        finally:
            os.close(fd)


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"
