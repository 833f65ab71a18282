"""The request log survives rotation, deletion and a full disk: every line in the file at
the configured path is one complete record, and every record that could not be written is
counted."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pte_instrument.server.exporters.request_log import RequestLogWriter
from pte_instrument.server.runtime import Runtime
from pte_instrument.settings import Settings
from tests.helpers import fill
from tests.server.test_pricer import make, req


def record(acc, i: int):
    return acc.on_finished(req(i))


def ids(path: Path) -> list[str]:
    """Request ids of the file's lines; fails on any line that is not one whole record."""
    text = path.read_text()
    assert not text or text.endswith("\n"), f"partial last line: {text[-80:]!r}"
    return [json.loads(line)["request_id"] for line in text.splitlines()]


@pytest.fixture
def acc(tmp_path):
    return make(tmp_path / "unused")[0]


def test_a_rotated_log_is_reopened_at_its_path(tmp_path, acc):
    path = tmp_path / "logs" / "requests.jsonl"
    w = RequestLogWriter(path)
    w.export(record(acc, 0))
    path.rename(path.with_suffix(".jsonl.1"))  # logrotate without copytruncate, before `create`
    w.export(record(acc, 1))
    path.rename(path.with_suffix(".jsonl.2"))
    path.touch()  # `create`: a new empty file under the old name
    w.export(record(acc, 2))
    assert ids(path.with_suffix(".jsonl.1")) == ["r0"]
    assert ids(path.with_suffix(".jsonl.2")) == ["r1"]
    assert ids(path) == ["r2"]


def test_a_deleted_directory_is_recreated(tmp_path, acc):
    path = tmp_path / "logs" / "requests.jsonl"
    w = RequestLogWriter(path)
    w.export(record(acc, 0))
    shutil.rmtree(path.parent)
    for i in range(1, 4):
        w.export(record(acc, i))
    assert ids(path) == ["r1", "r2", "r3"]


def test_copytruncate_continues_at_the_start_of_the_file(tmp_path, acc):
    path = tmp_path / "requests.jsonl"
    w = RequestLogWriter(path)
    w.export(record(acc, 0))
    shutil.copy(path, tmp_path / "requests.jsonl.1")
    os.truncate(path, 0)  # the copy is the rotated file; the writer keeps its descriptor
    w.export(record(acc, 1))
    assert ids(path) == ["r1"]  # appended at offset 0: no hole of NUL bytes before it


def half_then_enospc(monkeypatch, path: Path, failures: int = 1) -> list[int]:
    """os.write on the log writes half its bytes then fails as a full disk would, ``failures`` times."""
    real_write, failed = os.write, []

    def write(fd: int, data: bytes) -> int:
        if len(failed) < failures and path.exists() and os.fstat(fd).st_ino == path.stat().st_ino:
            failed.append(real_write(fd, bytes(data[: len(data) // 2])))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    return failed


def test_a_full_disk_leaves_no_partial_line_and_counts_the_loss(tmp_path, monkeypatch):
    acc, registry, path = make(tmp_path)  # its request log writes to `path`
    acc.on_finished(req(0))
    failed = half_then_enospc(monkeypatch, path)
    acc.on_finished(req(1))  # half written, then ENOSPC: the record is lost
    acc.on_finished(req(2))  # space is back
    assert failed, "the simulated full disk was hit"
    assert ids(path) == ["r0", "r2"]
    assert registry.get_sample_value("pte_plugin_faults_total", {"stage": "request_log"}) == 1


def test_a_record_over_a_mebibyte_cut_by_a_full_disk_is_undone_too(tmp_path, acc, monkeypatch):
    """A record the writer cut short itself is undone whatever its size: the tail check made
    for a record cut by a crash leaves a tail over a mebibyte alone (it may be no record of
    ours), and the next record was glued onto the half-written one."""
    from dataclasses import replace

    path = tmp_path / "requests.jsonl"
    w = RequestLogWriter(path)
    w.export(record(acc, 0))
    failed = half_then_enospc(monkeypatch, path)
    with pytest.raises(OSError):
        w.export(replace(record(acc, 1), request_id="r" * (3 << 20)))  # 3 MiB of id
    assert failed[0] > 1 << 20
    w.export(record(acc, 2))
    assert ids(path) == ["r0", "r2"]


def test_a_short_write_is_completed_or_undone(tmp_path, acc, monkeypatch):
    path = tmp_path / "requests.jsonl"
    w = RequestLogWriter(path)
    w.export(record(acc, 0))
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))  # 7 bytes a call
    w.export(record(acc, 1))  # a short write is continued, never left partial
    monkeypatch.setattr(os, "write", lambda fd, data: 0)  # nothing more fits
    with pytest.raises(OSError):
        w.export(record(acc, 2))
    monkeypatch.setattr(os, "write", real_write)
    w.export(record(acc, 3))
    assert ids(path) == ["r0", "r1", "r3"]


def test_a_partial_line_left_by_a_crash_is_cut_when_the_log_opens(tmp_path, acc):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"request_id":"old"}\n{"request_id":"cut sh')
    RequestLogWriter(path).export(record(acc, 0))
    assert ids(path) == ["old", "r0"]


@pytest.fixture
def tiny_fs(tmp_path) -> Path:
    """A real 64 KiB filesystem (tmpfs), where the kernel allows mounting one."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "--lazy", str(mnt)], check=True)  # lazy: even with a file still open


def test_a_real_full_disk_leaves_no_partial_line(tmp_path, tiny_fs):
    acc, *_ = make(tmp_path)  # its own log outside the tiny filesystem
    path = tiny_fs / "requests.jsonl"
    w = RequestLogWriter(path)
    w.export(record(acc, 0))
    filler = fill(tiny_fs)
    lost = 0
    for i in range(1, 12):  # the rest of the log's last page fills, then every write fails
        try:
            w.export(record(acc, i))
        except OSError as e:
            assert e.errno == errno.ENOSPC
            lost += 1
    written = ids(path)
    assert lost and len(written) + lost == 12
    filler.unlink()
    w.export(record(acc, 99))
    w.close()
    assert ids(path) == [*written, "r99"]  # not glued onto a partial record


def test_an_unwritable_request_log_is_reported_once_at_start_up(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    path = blocker / "requests.jsonl"
    with caplog.at_level(logging.INFO, logger="pte_instrument"):
        runtime = Runtime(Settings(request_log=str(path)), CollectorRegistry())
    lines = [r for r in caplog.records if "PTE_REQUEST_LOG" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert str(path) in lines[0].getMessage() and lines[0].exc_info is None  # one line, no traceback
    assert runtime.request_log is not None  # kept: it writes again once the path works
    caplog.clear()
    acc, *_ = make(tmp_path / "unused")
    with caplog.at_level(logging.INFO, logger="pte_instrument"):
        with pytest.raises(OSError):
            runtime.request_log.export(record(acc, 0))
        runtime.faults.record("request_log", OSError(errno.ENOTDIR, "Not a directory"))
    assert all(r.exc_info is None for r in caplog.records)  # an I/O error needs no traceback
    blocker.unlink()
    runtime.request_log.export(record(acc, 1))
    assert ids(path) == ["r1"]
