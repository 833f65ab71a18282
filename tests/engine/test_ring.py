"""The shared-memory ring between the engine thread and its pricing process."""

from __future__ import annotations

import errno
import os
import struct

import pytest

from pte_instrument.engine.ring import DATA, Ring


def pair(tmp_path, size: int) -> tuple[Ring, Ring]:
    writer = Ring(tmp_path / "ring", size)
    return writer, Ring(tmp_path / "ring")


def test_messages_arrive_whole_and_in_order_across_the_end_of_the_area(tmp_path):
    writer, reader = pair(tmp_path, 64)
    got = []
    for i in range(40):  # 8-byte heads + 5–25-byte messages: the area wraps many times
        message = bytes([i]) * (5 + i % 21)
        assert writer.put(message)
        if i % 2:
            got += reader.take()
    got += reader.take()
    assert got == [bytes([i]) * (5 + i % 21) for i in range(40)]
    assert reader.take() == []


def test_a_full_ring_refuses_a_message_and_keeps_the_others(tmp_path):
    writer, reader = pair(tmp_path, 64)
    assert writer.put(b"a" * 24) and writer.put(b"b" * 24)  # 2 × 32 bytes: full
    assert not writer.put(b"c")
    assert not writer.put(b"d" * 100)  # larger than the area: never fits
    assert reader.take() == [b"a" * 24, b"b" * 24]
    assert writer.put(b"c")
    assert reader.take() == [b"c"]


def test_a_message_whose_bytes_are_not_visible_yet_is_read_on_a_later_poll(tmp_path):
    """Weak memory ordering: the writer's count seen before the bytes it covers."""
    writer, reader = pair(tmp_path, 64)
    assert writer.put(b"first")
    assert writer.put(b"second")
    mm = writer._mm
    at = DATA + 8 + 5 + 8  # the second message's bytes
    mm[at : at + 6] = b"\0" * 6
    assert reader.take() == [b"first"]
    mm[at : at + 6] = b"second"
    assert reader.take() == [b"second"]
    assert struct.unpack_from("<QQ", mm, 0) == (27, 27)  # written, read


def test_a_memory_file_system_without_room_is_passed_over_and_leaves_no_file(tmp_path, monkeypatch):
    """A write into a full tmpfs would kill the engine (SIGBUS): the space is reserved at
    creation, and where it cannot be, the next directory is tried."""
    from pte_instrument.engine import ring

    full, roomy = tmp_path / "full", tmp_path / "roomy"
    full.mkdir()
    roomy.mkdir()
    reserve = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(full)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        reserve(fd, offset, length)

    monkeypatch.setattr(ring.os, "posix_fallocate", fallocate)
    monkeypatch.setattr(ring, "ring_directories", lambda: [str(full), str(roomy)])
    made = Ring.create("r", 1 << 16)
    assert made.path == str(roomy / "r") and made.size == 1 << 16
    assert not list(full.iterdir())
    monkeypatch.setattr(ring, "ring_directories", lambda: [str(full)])
    with pytest.raises(OSError, match=r"no room for a 0.0625 MiB ring \(.*No space left on device"):
        Ring.create("s", 1 << 16)
    assert not list(full.iterdir())
