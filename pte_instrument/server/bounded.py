"""The one bounded mapping behind every per-request and per-session store of the API
server: whatever clients send, each holds at most ``capacity`` entries."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(Generic[K, V]):
    """A mapping ordered from least to most recently put (or touched). ``put`` past the
    capacity drops the oldest entries, returns them and counts them in ``dropped``. Not
    thread-safe: its owners hold their own lock."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be ≥ 1, not {capacity}")
        self.capacity = capacity
        self.dropped = 0
        self._map: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def __getitem__(self, key: K) -> V:
        return self._map[key]

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._map.get(key, default)

    def values(self) -> Iterator[V]:
        return iter(self._map.values())

    def items(self) -> Iterator[tuple[K, V]]:
        """Least recently put first."""
        return iter(self._map.items())

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Insert or replace ``key`` as the most recent entry; returns what was dropped."""
        self._map[key] = value
        self._map.move_to_end(key)
        dropped = []
        while len(self._map) > self.capacity:
            dropped.append(self._map.popitem(last=False))
        self.dropped += len(dropped)
        return dropped

    def touch(self, key: K) -> None:
        """Make ``key`` the most recent entry."""
        self._map.move_to_end(key)

    def pop(self, key: K, default: V | None = None) -> V | None:
        return self._map.pop(key, default)

    def oldest(self) -> tuple[K, V] | None:
        return next(iter(self._map.items()), None)

    def pop_oldest(self) -> tuple[K, V]:
        return self._map.popitem(last=False)
