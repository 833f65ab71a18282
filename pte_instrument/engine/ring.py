"""A one-writer, one-reader ring of messages in shared memory: the engine thread's way to
hand work to its pricing process without copying it through a socket; the writer wakes the
reader apart from it (one byte on a pipe per pass), and the reader takes every message
published since its last look.

Layout: an 8-byte count of bytes ever written (the writer's), an 8-byte count of bytes ever
read (the reader's), then the data area. A message is its length (4 bytes), its CRC-32
(4 bytes) and its bytes, wrapping around the end of the area. The writer publishes a message
by advancing its count after the bytes; on a processor that may make the count visible
before the bytes (weak memory ordering), the reader sees a CRC that does not match yet and
reads the message again on its next poll.

The file lives in ``/dev/shm`` (memory) where it has room, else in the temporary directory;
its space is reserved when it is made, so that a full memory file system is an error at
start-up rather than a bus error on the engine thread later.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import zlib
from pathlib import Path

_COUNTS = struct.Struct("<QQ")
_HEAD = struct.Struct("<II")  # length, CRC-32
_WRITTEN, _READ = 0, 8
DATA = _COUNTS.size


def ring_directories() -> list[str]:
    """Where a ring may go, in order: memory-backed where the system has it, else the
    temporary directory."""
    shm = "/dev/shm"
    return [shm, tempfile.gettempdir()] if os.path.isdir(shm) else [tempfile.gettempdir()]


class Ring:
    def __init__(self, path: str | Path, size: int | None = None) -> None:
        """``size``: create the file with a data area of that many bytes, its space reserved
        (a write into a full memory file system would kill the process); None: open it."""
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if size is not None:
                os.posix_fallocate(fd, 0, DATA + size)
            self._mm = mmap.mmap(fd, 0)
            if size is not None:  # its pages now, not on the engine thread's first pass over them
                for at in range(DATA, DATA + size, 1 << 20):
                    self._mm[at : at + (1 << 20)] = bytes(min(1 << 20, DATA + size - at))
        except OSError:
            if size is not None:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path = str(path)
        self.size = len(self._mm) - DATA
        self._written, self._read = _COUNTS.unpack_from(self._mm, 0)  # each side keeps its own

    @classmethod
    def create(cls, name: str, size: int) -> Ring:
        """A new ring in the first of ``ring_directories()`` with room for it."""
        problems = []
        for directory in ring_directories():
            try:
                return cls(Path(directory) / name, size)
            except OSError as e:
                problems.append(f"{directory}: {e.strerror or e}")
        raise OSError(f"no room for a {size / (1 << 20):g} MiB ring ({'; '.join(problems)})")

    def put(self, payload: bytes) -> bool:
        """Append one message; False (nothing written) where the reader has left no room."""
        n = _HEAD.size + len(payload)
        read = struct.unpack_from("<Q", self._mm, _READ)[0]
        if n > self.size - (self._written - read):
            return False
        self._copy_in(self._written, _HEAD.pack(len(payload), zlib.crc32(payload)) + payload)
        self._written += n
        struct.pack_into("<Q", self._mm, _WRITTEN, self._written)
        return True

    def take(self) -> list[bytes]:
        """Every message published and whole since the last call, in order."""
        written = struct.unpack_from("<Q", self._mm, _WRITTEN)[0]
        out = []
        while self._read < written:
            length, crc = _HEAD.unpack(self._copy_out(self._read, _HEAD.size))
            payload = self._copy_out(self._read + _HEAD.size, length)
            if not 0 < length <= self.size or zlib.crc32(payload) != crc:
                break  # not all of it visible yet
            out.append(payload)
            self._read += _HEAD.size + length
        if out:
            struct.pack_into("<Q", self._mm, _READ, self._read)
        return out

    def _copy_in(self, at: int, data: bytes) -> None:
        start = at % self.size
        first = min(len(data), self.size - start)
        self._mm[DATA + start : DATA + start + first] = data[:first]
        if first < len(data):
            self._mm[DATA : DATA + len(data) - first] = data[first:]

    def _copy_out(self, at: int, n: int) -> bytes:
        n = min(n, self.size)
        start = at % self.size
        first = min(n, self.size - start)
        data = self._mm[DATA + start : DATA + start + first]
        if first < n:
            data += self._mm[DATA : DATA + n - first]
        return data

    def close(self) -> None:
        self._mm.close()
