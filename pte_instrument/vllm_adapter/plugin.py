"""``vllm.general_plugins`` entry point: runs in every vLLM process. In the first one (the
API server, or ``vllm serve``'s launcher) it creates the engine → API-server transport
address and, unless ``PTE_SESSION_STORE`` and ``PTE_INSTANCE`` name them, the server's own
session store path and replica name (by its port); the engine and API-server processes, spawned later, inherit both (see
``pte_instrument.transport``). The launcher of engines started ``--headless`` (a node
without an API server) names the settings it does not take, as an API server does."""

from __future__ import annotations

import multiprocessing
import os
import sys

VLLM_DEFAULT_PORT = 8000


def register() -> None:
    from pte_instrument.settings import default_instance, default_session_store, is_set, read
    from pte_instrument.transport import ADDRESS_ENV, ensure_address

    ensure_address(read(ADDRESS_ENV))
    port = serve_port(sys.argv)
    if port is not None:
        if not is_set("PTE_SESSION_STORE"):
            os.environ["PTE_SESSION_STORE"] = default_session_store(port)
        if not is_set("PTE_INSTANCE"):
            os.environ["PTE_INSTANCE"] = default_instance(port)
    # spawned processes carry their parent's argv: only the launcher itself speaks
    if "--headless" in sys.argv and multiprocessing.parent_process() is None:
        from pte_instrument.faults import install_log_handler, say_configuration
        from pte_instrument.settings import Settings

        install_log_handler()
        say_configuration(Settings.from_env().errors)


def serve_port(argv: list[str]) -> int | None:
    """The port ``vllm serve`` (or vLLM's OpenAI server module) listens on, from its
    command line; None for another program or a port that is not a number."""
    programs = [os.path.splitext(os.path.basename(a))[0] for a in argv[:3]]  # vllm serve, python -m …
    if not any(p in ("serve", "api_server") for p in programs):
        return None
    port = str(VLLM_DEFAULT_PORT)
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            port = argv[i + 1]
        elif arg.startswith("--port="):
            port = arg.removeprefix("--port=")
    return int(port) if port.isdigit() else None
