"""Session identity: validating client-supplied session ids, and remembering which session
a request belongs to until the server reports it finished. Both bounded."""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_SESSION_ID_LEN = 128


def validate_session_id(raw: bytes | str) -> tuple[str | None, str | None]:
    """``(session_id, None)`` for a usable id, else ``(None, reason)`` with reason one of
    ``empty``, ``too_long``, ``invalid_chars`` (a bounded set: it is a metric label)."""
    if isinstance(raw, str):
        try:
            raw = raw.encode("ascii")
        except UnicodeEncodeError:
            return None, "invalid_chars"
    if not raw.strip():
        return None, "empty"
    if len(raw) > MAX_SESSION_ID_LEN:
        return None, "too_long"
    if any(b < 0x21 or b > 0x7E for b in raw):  # visible ASCII only
        return None, "invalid_chars"
    return raw.decode("ascii"), None


class PendingSessions:
    """request key → session id, for requests not yet finished. Least recently added
    entries are dropped past ``capacity`` (requests that never reach the engine)."""

    def __init__(self, capacity: int = 20000) -> None:
        self.capacity = capacity
        self.dropped = 0
        self._map: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._map)

    def put(self, key: str, session_id: str) -> None:
        with self._lock:
            self._map[key] = session_id
            self._map.move_to_end(key)
            while len(self._map) > self.capacity:
                self._map.popitem(last=False)
                self.dropped += 1

    def pop(self, *keys: str) -> str | None:
        """The session of the first key present (callers try several spellings of an id)."""
        with self._lock:
            for key in keys:
                sid = self._map.pop(key, None)
                if sid is not None:
                    return sid
        return None
