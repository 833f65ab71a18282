"""The request log: opt-in JSONL, one object per finished request (README: field list).

Every line of the file is one whole record:

- each record is appended in one ``os.write`` on an ``O_APPEND`` descriptor, under an
  exclusive ``flock`` (several API servers append to the same file); a record the disk
  cannot hold is undone by truncating the file back to the end of its last complete line,
  and the write raises, so the caller counts the lost record;
- before each write the path is checked as ``logging.handlers.WatchedFileHandler`` does
  (device and inode of the path against those of the open file): a log moved away
  (logrotate's ``create``) or deleted, its directory with it or not, is reopened at the
  configured path, the directory recreated. ``copytruncate`` needs nothing: appends land
  at the new end of the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from pte_instrument.failpoints import fires
from pte_instrument.server.records import RequestRecord

MAX_PARTIAL = 1 << 20  # a tail without a newline longer than this is not a record of ours: kept


class RequestLogWriter:
    """Appends one JSON line per record. A record that cannot be written raises (the caller
    counts it as a fault of stage ``request_log`` and the record as lost) and leaves the file as it was; the next
    write opens the path again, so a fixed path or a disk with space again recovers."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.written = 0
        self._fd: int | None = None
        self._file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file
        self._lock = threading.Lock()

    def check(self) -> OSError | None:
        """Open the log now (at start-up): None when it is writable, else why not."""
        with self._lock:
            try:
                self._current()
            except OSError as e:
                self._close()
                return e
        return None

    def export(self, record: RequestRecord) -> None:
        with self._lock:
            try:
                line = json.dumps(record.to_dict(), separators=(",", ":"), allow_nan=False) + "\n"
                _append(self._current(), line.encode())
            except Exception:
                self._close()  # reopened (and its tail checked) at the next record
                raise
            self.written += 1

    def _current(self) -> int:
        """The descriptor of the file now at the path, reopened when the path names
        another file or none."""
        if self._fd is not None:
            try:
                st = os.stat(self.path)
            except OSError:
                st = None
            if st is not None and (st.st_dev, st.st_ino) == self._file_id:
                return self._fd
            self._close()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a file where the directory should be: say so
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(self.path.parent)) from None
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            st = os.fstat(fd)
            with _locked(fd):  # a record cut by a crash or a failed truncate
                _cut_partial_tail(fd)
        except OSError:
            os.close(fd)
            raise
        self._fd, self._file_id = fd, (st.st_dev, st.st_ino)
        return fd

    def _close(self) -> None:
        fd, self._fd, self._file_id = self._fd, None, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._close()

    def stats(self) -> dict[str, object]:
        return {"path": str(self.path), "written": self.written}


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    """Exclusive against the other API servers' writers; where the filesystem has no
    locks, O_APPEND alone still keeps whole writes from interleaving."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)


def _write(fd: int, data: memoryview) -> int:
    if fires("request_log"):  # PTE_FAILPOINTS: a disk that fills in the middle of a record
        os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    return os.write(fd, data)


def _append(fd: int, data: bytes) -> None:
    """All of ``data`` at the end of the file, or none of it."""
    view = memoryview(data)
    with _locked(fd):
        start = os.fstat(fd).st_size
        try:
            done = 0
            while done < len(data):  # a short write is continued, under the lock
                n = _write(fd, view[done:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, "No space left on device (short write)")
                done += n
        except OSError:
            with contextlib.suppress(OSError):  # if this fails too, the next open cuts it
                _undo(fd, start)
            raise


def _undo(fd: int, start: int) -> None:
    """Take back a record cut short, written from ``start``: whatever its size, where nothing
    but it (no newline) follows ``start``; else cut the partial tail as an open does."""
    size = os.fstat(fd).st_size
    if size > start and b"\n" not in os.pread(fd, size - start, start):
        os.ftruncate(fd, start)
    else:
        _cut_partial_tail(fd)


def _cut_partial_tail(fd: int) -> None:
    """Truncate the file after its last newline, so no partial record stays (and none is
    glued onto the next one). Called with the lock held."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    tail = os.pread(fd, min(size, MAX_PARTIAL + 1), max(0, size - MAX_PARTIAL - 1))
    newline = tail.rfind(b"\n")
    if newline < 0 and size > MAX_PARTIAL:
        return  # not a record cut short: leave the file alone
    os.ftruncate(fd, size - len(tail) + newline + 1)
