"""LoRA adapters: the adapter a request was served by, accounted under its own name (the
``lora_name`` metric label, the request log's ``lora_name``) and priced with its base
model's cost model, whose weights and KV cache it uses.

The name is the OpenAI ``model`` field a request was sent with, kept only if the server
serves an adapter of that name when the request finishes (a name it does not serve was
answered 404 and never finished). Bounded: the first ``capacity`` adapters that finish a
request keep their name; any later one (adapters loaded at run time, one after another) is
accounted as ``other``."""

from __future__ import annotations

import threading
from collections.abc import Container

OTHER_ADAPTER = "other"


class LoraNames:
    """The adapter names this API server accounts requests under."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be ≥ 1, not {capacity}")
        self.capacity = capacity
        self.enabled = False  # the server serves LoRA adapters: the middleware reads the model field
        self.served: Container[str] | None = None  # the server's adapters by name, live (None: not known yet)
        self.overflowed = 0  # requests accounted as OTHER_ADAPTER past the capacity
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._names)

    def account(self, requested: str | None) -> str | None:
        """The adapter name a finished request sent for model ``requested`` is accounted
        under: None for the base model (or nothing known), the adapter's name, or
        ``other`` past the capacity."""
        served = self.served
        if requested is None or served is None or requested not in served:
            return None
        with self._lock:
            if requested in self._names:
                return requested
            if len(self._names) < self.capacity:
                self._names.add(requested)
                return requested
            self.overflowed += 1
            return OTHER_ADAPTER
