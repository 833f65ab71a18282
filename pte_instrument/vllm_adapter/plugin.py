"""``vllm.general_plugins`` entry point: runs in every vLLM process. In the first one (the
API server) it creates the engine → API-server transport address; the engine processes,
spawned later, inherit it (see ``pte_instrument.transport``)."""

from __future__ import annotations


def register() -> None:
    from pte_instrument.transport import ensure_address

    ensure_address()
