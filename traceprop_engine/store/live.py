"""A store read while its train writes it: a lock file beside the store.

HDF5 without SWMR keeps no reader consistent while another process writes the file. A flush
rewrites a growing dataset's last chunk and the B-tree that finds it, so a reader that opens the
file during a flush, or reads through metadata it cached before one, meets "bad object header
version number", "addr overflow" or a checksum failure (and, where a chunk moved, could read
another chunk's bytes). ``python benchmarks/live_read.py`` polls a real ``traceprop train``: before
this lock, 560 of 2665 opens and reads of the running store failed.

So the writer holds an exclusive ``flock`` on ``store.h5.lock`` while it changes the file (each
:class:`~.writer.StoreWriter` method, which ends in a flush) and counts its changes in the lock
file's first 8 bytes. A reader in another process holds a shared ``flock`` while it opens the
file and during each read, and reopens the file first when the count moved since it last read
(its cached metadata may point where chunks no longer are). A reader sees the store as it was
when opened: its ``n_records`` stays, and the rows below it do not change.

The lock file exists from the writer's start to its close, which removes it: a completed store
is read without it. A killed writer leaves it behind, and the kernel drops its lock. Without
``fcntl`` (Windows) nothing is locked, as before.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import struct
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

_COUNT = struct.Struct("<Q")
log = logging.getLogger(__name__)


def lock_path(store: str | os.PathLike) -> Path:
    """The lock file of ``store`` (``store.h5`` -> ``store.h5.lock``)."""
    p = Path(store)
    return p.with_name(p.name + ".lock")


def _count(fd: int) -> int:
    raw = os.pread(fd, _COUNT.size, 0)
    return _COUNT.unpack(raw)[0] if len(raw) == _COUNT.size else 0


def _lockable(path: Path, flags: int) -> int | None:
    """``path`` opened with ``flags``, or None where it cannot be opened or its filesystem takes
    no ``flock`` (some network filesystems: the store is then read and written as before the
    lock, with a warning from the writer)."""
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:  # a writer holds it now: it works
        pass
    except OSError as e:
        os.close(fd)
        if flags & os.O_CREAT:  # the writer's: no lock file is left behind
            with contextlib.suppress(OSError):
                os.unlink(path)
            log.warning(
                "no file lock on %s (%s): reading this store while its train writes it may fail",
                path,
                e,
            )
        return None
    return fd


class WriteLock:
    """The writer's lock: a thread lock (one background writer thread and the loop) and, across
    processes, the exclusive ``flock``; leaving it counts one change. Created before the store
    file, so that no reader can open the file before its first flush."""

    def __init__(self, store: str | os.PathLike) -> None:
        self.path = lock_path(store)
        self._thread = threading.Lock()
        self._removed = False
        self._fd = _lockable(self.path, os.O_RDWR | os.O_CREAT) if fcntl else None
        if self._fd is not None:
            try:  # the count's 8 bytes now: a later flush's count never needs new disk space
                os.pwrite(self._fd, _COUNT.pack(_count(self._fd)), 0)
            except OSError:
                self.remove_now()

    def __enter__(self) -> WriteLock:
        self._thread.acquire()
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except BaseException:
                self._thread.release()
                raise
        return self

    def __exit__(self, *exc) -> None:
        fd = self._fd
        try:
            if fd is not None:
                try:
                    os.pwrite(fd, _COUNT.pack(_count(fd) + 1), 0)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            if fd is not None and self._removed:
                os.close(fd)
                self._fd = None
            self._thread.release()

    @property
    def own(self) -> threading.Lock:
        """The thread lock alone: the writer's own reads of its file, which change nothing and
        so count nothing (readers do not reopen for them)."""
        return self._thread

    def remove(self) -> None:
        """Remove the lock file (the store is closed; called while holding the lock). Readers that
        hold it still get the last count; later readers open the store without a lock."""
        if self._fd is not None and not self._removed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self._removed = True

    def remove_now(self) -> None:
        """Remove the lock file and close it (a writer that failed to start; not holding it)."""
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = None


class ReadLock:
    """A reader's side of :class:`WriteLock`: ``with lock as count`` holds the shared ``flock``
    and gives the writer's change count."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def open(cls, store: str | os.PathLike) -> ReadLock | None:
        """The lock of a store a writer has open (or had, when killed), or None."""
        if fcntl is None:
            return None
        fd = _lockable(lock_path(store), os.O_RDONLY)
        return None if fd is None else cls(fd)

    def __enter__(self) -> int:
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        return _count(self._fd)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def read_locked(store: str | os.PathLike):
    """Hold the shared lock of ``store`` for a one-off read of the file with h5py (nothing
    when no writer has it open)."""
    lock = ReadLock.open(store)
    if lock is None:
        yield
        return
    try:
        with lock:
            yield
    finally:
        lock.close()


class LiveReads:
    """The store reader's half (a mixin of :class:`~.reader.Store`): its open and every read under
    the shared lock when the store has one. Needs ``path``, ``_f`` and ``_reopened()``."""

    _live: ReadLock | None = None

    def _open_live(self, open_file) -> None:
        """``open_file()`` (opens and validates ``_f``) under the store's lock, which is kept for
        the reads when there is one."""
        lock = ReadLock.open(self.path)
        if lock is None:
            open_file()
            return
        try:
            with lock as count:
                open_file()
        except BaseException:
            lock.close()
            raise
        self._live, self._live_count = lock, count
        self._live_inode = os.stat(self.path).st_ino
        self._live_thread, self._live_depth = threading.RLock(), 0

    @contextlib.contextmanager
    def _fresh(self):
        """Hold the shared lock (once per thread: nested reads run under the outer one), the
        file reopened first if the writer changed it since."""
        lock = self._live
        if lock is None or lock._fd is None:
            yield
            return
        with self._live_thread:
            if self._live_depth:
                yield
                return
            with lock as count:
                if count != self._live_count:
                    self._reopen_live()
                    self._live_count = count
                self._live_depth += 1
                try:
                    yield
                finally:
                    self._live_depth -= 1

    def _reopen_live(self) -> None:
        from ..errors import StoreError

        try:
            same = os.stat(self.path).st_ino == self._live_inode
        except OSError:
            same = False
        if not same:
            raise StoreError(
                f"{self.path} was replaced by another run while this reader had it open: open it "
                "again"
            )
        self._f.close()
        self._reopened()

    def _close_live(self) -> None:
        if self._live is not None:
            self._live.close()


def live_read(method):
    """Run a :class:`LiveReads` method under :meth:`LiveReads._fresh`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self._live is None:  # no writer had the store open: no lock (the query path)
            return method(self, *args, **kwargs)
        with self._fresh():
            return method(self, *args, **kwargs)

    return wrapper
