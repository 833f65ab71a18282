"""Start and stop a real ``redis-server`` (Debian's package) on a free port: the session store
a fleet of replicas shares, for the demo, the tests and the bench."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from pte_instrument.devtools.serving import free_port


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class RedisServer:
    """A redis-server on loopback with its append-only file in ``workdir`` (``fsync``:
    ``always`` acknowledges only what is on disk, so a killed server restarts with every write
    it answered; ``everysec`` is Redis's default). ``stop`` and ``start`` keep port and data."""

    def __init__(self, workdir: str | Path, fsync: str = "everysec") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.binary = binary
        self.workdir = Path(workdir)
        self.fsync = fsync
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", self.fsync]
        self.proc = subprocess.Popen(args, cwd=self.workdir, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Kill it (as a crash would): what it acknowledged is in its append-only file."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
